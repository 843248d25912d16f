"""Images under hostile input (docs/PROTOCOL.md §7, "Limits"): Go's acceptance where
Pillow's is wider, read from the header before anything is decoded.

- A JPEG or PNG whose data is too short for the image it declares is refused from its
  header, as Go's decoders refuse it (libjpeg fills the missing blocks with grey), as are
  JPEG codings Go does not decode; valid files of every kind are not (the bounds are
  tight: maximally compressed files sit at them).
- Transparency is composited without `Image.alpha_composite` (it holds the GIL), to the
  same pixels for all 65,536 (value, alpha) pairs and every transparent mode.
- Error texts hold no object address, name the unsupported format and the pixel limit
  actually applied.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from bench.fuzz.media import declared_jpeg, pixel_bomb_png
from runner.media import images as images_module
from runner.media.images import MAX_IMAGE_PIXELS, check_jpeg, decode_image, read_header
from runner.media.pixels import to_rgb

QWEN = "Qwen3_5ForConditionalGeneration"
GEMMA = "Gemma3ForConditionalGeneration"
QUESTION = " Is it bright? Answer:"


def image_bytes(
    width: int, height: int, fmt: str = "PNG", mode: str = "RGB", seed: int = 0, **kwargs: Any
) -> bytes:
    """A `width` x `height` image of smooth content in `mode`, written as `fmt`."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 7 + seed) % 256, (y * 5) % 256, ((x + y) * 3) % 256], -1)
    image = Image.fromarray(rgb.astype(np.uint8))
    if mode == "I;16":
        image = Image.fromarray(((x * 300 + y * 7) % 65536).astype(np.uint16))
    elif mode == "RGBA":
        image.putalpha(Image.fromarray(((x * y) % 256).astype(np.uint8)))
    elif mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


# --- transparency without holding the GIL ---------------------------------------------------


def _reference_rgb(image: Image.Image) -> np.ndarray:
    """transformers' convert_to_rgb path: alpha_composite onto white, then RGB."""
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def test_compositing_equals_alpha_composite_for_every_value_and_alpha(monkeypatch):
    value, alpha = np.meshgrid(np.arange(256), np.arange(256))
    pixels = np.stack([value, 255 - value, (value * 7) % 256, alpha], -1).astype(np.uint8)
    rgba = Image.fromarray(pixels, "RGBA")
    expected = _reference_rgb(rgba)
    la = Image.fromarray(np.stack([value, alpha], -1).astype(np.uint8), "LA")
    expected_la = _reference_rgb(la)
    palette = Image.fromarray((value % 256).astype(np.uint8), "L").convert("P")
    palette.info["transparency"] = 7
    expected_palette = _reference_rgb(palette)
    rgb_key = Image.fromarray(pixels[..., :3].copy(), "RGB")
    rgb_key.info["transparency"] = (0, 255, 0)
    expected_key = _reference_rgb(rgb_key)

    def holds_the_gil(*args: Any) -> None:
        raise AssertionError("Image.alpha_composite holds the GIL")

    monkeypatch.setattr(Image, "alpha_composite", holds_the_gil)
    assert (np.asarray(to_rgb(rgba)) == expected).all()
    assert (np.asarray(to_rgb(la)) == expected_la).all()
    assert (np.asarray(to_rgb(palette)) == expected_palette).all()
    assert (np.asarray(to_rgb(rgb_key)) == expected_key).all()
    plain = Image.fromarray(pixels[..., :3].copy(), "RGB")
    assert to_rgb(plain) is plain  # nothing to convert: no copy


# --- what Go's decoders refuse ---------------------------------------------------------------


@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_declaring_more_than_it_holds_is_refused_from_its_header(progressive):
    data = declared_jpeg(9000, 9000)
    if progressive:
        out = io.BytesIO()
        Image.new("RGB", (16, 16), (90, 30, 200)).save(out, "JPEG", progressive=True)
        data = _declare(out.getvalue(), 9000, 9000)
    with pytest.raises(ValueError, match=r"^invalid image data: JPEG data too short: scan 1"):
        read_header(data)
    with pytest.raises(ValueError, match=r"^invalid image data: JPEG data too short"):
        decode_image(data)


def _declare(data: bytes, width: int, height: int) -> bytes:
    """The JPEG with its SOF header declaring `width` x `height`."""
    out = bytearray(data)
    i = 2
    while out[i + 1] not in (0xC0, 0xC1, 0xC2):
        i += 2 + struct.unpack(">H", out[i + 2 : i + 4])[0]
    out[i + 5 : i + 9] = struct.pack(">HH", height, width)
    return bytes(out)


JPEG_KINDS = [
    {"quality": 90},
    {"quality": 1},
    {"quality": 100, "subsampling": 0},
    {"quality": 75, "subsampling": 1},
    {"quality": 5, "optimize": True},
    {"progressive": True},
    {"progressive": True, "optimize": True, "quality": 1},
    {"progressive": True, "subsampling": 0, "quality": 95},
]


@pytest.mark.parametrize("kwargs", JPEG_KINDS)
@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_valid_jpegs_pass_the_check_even_at_its_bound(kwargs, mode):
    """Smooth, noisy and uniform images (a uniform one with optimised tables is coded in
    exactly the bound's bits: one DC and one AC bit a block) at many sizes."""
    rng = np.random.default_rng(3)
    for width, height in ((1, 1), (8, 8), (9, 17), (64, 48), (333, 201), (1024, 8), (1600, 1600)):
        for content in ("uniform", "noise", "smooth"):
            if content == "noise" and (kwargs.get("progressive") or width * height > 100_000):
                continue  # Pillow's progressive encoder runs out of its buffer on noise
            if content == "uniform":
                pixels = np.full((height, width, 3), 77, np.uint8)
            elif content == "noise":
                pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            else:
                y, x = np.mgrid[0:height, 0:width]
                pixels = np.stack([x % 256, y % 256, (x ^ y) % 256], -1).astype(np.uint8)
            out = io.BytesIO()
            image = Image.fromarray(pixels)
            (image if mode == "RGB" else image.convert(mode)).save(out, "JPEG", **kwargs)
            check_jpeg(out.getvalue())
            read_header(out.getvalue())


@pytest.mark.parametrize(
    ("marker", "name"), [(0xC3, "lossless"), (0xC5, "hierarchical"), (0xC9, "arithmetic")]
)
def test_jpeg_codings_go_does_not_decode_are_refused(marker, name):
    data = bytearray(image_bytes(32, 32, "JPEG"))
    i = 2
    while data[i + 1] != 0xC0:
        i += 2 + struct.unpack(">H", data[i + 2 : i + 4])[0]
    data[i + 1] = marker
    with pytest.raises(ValueError, match=rf"^invalid image data: unsupported JPEG coding \({name}"):
        check_jpeg(bytes(data))
    data[i + 1] = 0xC0
    data[i + 4] = 12  # 12-bit samples
    with pytest.raises(ValueError, match=r"^invalid image data: unsupported JPEG precision"):
        check_jpeg(bytes(data))


def _chunks(header: bytes, compressed: bytes) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", compressed)
        + chunk(b"IEND", b"")
    )


def _png(width: int, height: int, rows: bytes) -> bytes:
    """An RGB PNG whose IDAT holds `rows` (not necessarily all its rows)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return _chunks(header, zlib.compress(rows, 9))


def test_a_png_too_short_for_its_rows_is_refused_from_its_header():
    """8 rows of data for a 3000 x 3000 header: Pillow decoded it (the rest left black)."""
    data = _png(3000, 3000, b"".join(b"\0" + b"\x80" * 9000 for _ in range(8)))
    with pytest.raises(
        ValueError, match=r"^invalid image data: PNG data too short: \d+ compressed"
    ):
        read_header(data)


@pytest.mark.parametrize("kwargs", [{}, {"optimize": True}, {"compress_level": 9}])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1", "I;16"])
def test_valid_pngs_pass_the_check_even_at_its_bound(kwargs, mode):
    """Uniform images compress to ~1/1000 of their rows at zlib's best, near the bound."""
    for width, height in ((1, 1), (7, 3), (1000, 1000), (4000, 3000)):
        image = Image.new("RGB", (width, height), (200, 10, 10))
        image = image if mode == "RGB" else image.convert(mode)
        out = io.BytesIO()
        image.save(out, "PNG", **kwargs)
        read_header(out.getvalue())


def _adam7_png(width: int, height: int, rows_kept: int | None = None) -> bytes:
    """A uniform RGB PNG, interlaced (Adam7); `rows_kept` cuts its data to that many rows."""
    rows = []
    for x0, y0, dx, dy in images_module._ADAM7:
        across = -(-(width - x0) // dx) if width > x0 else 0
        down = -(-(height - y0) // dy) if height > y0 else 0
        if across:
            rows += [b"\0" + b"\x40\x80\xc0" * across] * down
    rows = rows[:rows_kept]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 1)
    return _chunks(header, zlib.compress(b"".join(rows), 9))


def test_interlaced_pngs_are_counted_by_their_passes():
    for width, height in ((1, 1), (5, 3), (9, 17), (3000, 2000)):
        data = _adam7_png(width, height)
        read_header(data)
        assert decode_image(data).size == (width, height)
    with pytest.raises(ValueError, match="PNG data too short"):
        read_header(_adam7_png(3000, 2000, rows_kept=10))


def test_a_gif_declaring_more_than_it_holds_is_refused():
    out = io.BytesIO()
    Image.new("P", (8, 8), 3).save(out, "GIF")
    data = bytearray(out.getvalue())
    data[6:10] = struct.pack("<HH", 4000, 4000)  # the logical screen
    descriptor = data.index(0x2C, 13)
    data[descriptor + 5 : descriptor + 9] = struct.pack("<HH", 4000, 4000)
    with pytest.raises(ValueError, match=r"^invalid image data: "):
        decode_image(bytes(data))


# --- tags and texts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"not an image at all", b"BM" + b"\0" * 60, b"\x00\x00\x01\x00" + b"\0" * 40],
)
def test_an_unsupported_format_is_named_without_an_address(data):
    if data.startswith(b"BM"):  # a real BMP: Pillow reads it, Go's runner does not
        out = io.BytesIO()
        Image.new("RGB", (4, 4)).save(out, "BMP")
        data = out.getvalue()
    with pytest.raises(ValueError) as e:
        read_header(data)
    assert str(e.value) == (
        "invalid image data: not a PNG, JPEG, GIF or WebP image (unsupported format)"
    )


def test_the_pixel_limit_cited_is_the_one_applied():
    over = pixel_bomb_png(20000, 20000)  # over twice the limit: Pillow's own error cited 2x
    with pytest.raises(ValueError) as e:
        read_header(over)
    assert str(e.value) == (
        "invalid image data: 20000 x 20000 is 400000000 pixels, over the limit of "
        f"{MAX_IMAGE_PIXELS} pixels per image"
    )
    just_over = pixel_bomb_png(MAX_IMAGE_PIXELS // 8000 + 1, 8000)
    with pytest.raises(ValueError, match=f"over the limit of {MAX_IMAGE_PIXELS} pixels"):
        read_header(just_over)
    at = _png(MAX_IMAGE_PIXELS // 9000, 9000, b"\0" * 9000 * 100)  # at the limit: not that
    with pytest.raises(ValueError, match="PNG data too short"):
        read_header(at)
