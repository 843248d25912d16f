"""Image bytes to a Pillow image, as the Go runner accepts them: PNG, JPEG, GIF, WebP.

Pillow is what transformers' image processors read, so a family's preprocessing can follow
its reference processor step by step on the same decoded pixels. Decoding happens while a
request is prepared, off the MLX thread; a bad image is the client's error, raised as a
ValueError whose text the request side turns into a 400.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

# The formats the Go runner decodes (docs/PROTOCOL.md); Pillow would open many more.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP")


def decode_image(data: bytes) -> Image.Image:
    """The image in `data`, fully decoded (a GIF's first frame), in its own mode: RGB
    conversion is the preprocessor's (transformers composites transparency onto white first).
    Raises ValueError("invalid image data: ...") for bytes that are not one whole image of a
    supported format."""
    if not data:
        raise ValueError("invalid image data: empty")
    try:
        with warnings.catch_warnings():
            # a decompression-bomb warning becomes the error below, never a log line
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            image.seek(0)  # the first frame of an animation
            image.load()  # decode now: a truncated file fails here, not in the preprocessor
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        raise ValueError(f"invalid image data: {e}") from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise ValueError(f"invalid image data: {e}") from None
    if image.width < 1 or image.height < 1:
        raise ValueError("invalid image data: no pixels")
    return image
