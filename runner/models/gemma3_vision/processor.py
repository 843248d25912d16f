"""Gemma3's image processing: image -> the tower's pixels (`Gemma3ImagePreprocessor`), and
the tokens an `[img-N]` tag becomes (`image_expansion`).

transformers 5 is the reference: the PIL backend of its Gemma3 image processor for the
pixels, and `Gemma3Processor.full_image_sequence` for the expansion: "\\n\\n",
<start_of_image>, mm_tokens_per_image soft tokens, <end_of_image>, "\\n\\n". The soft tokens
of one image attend to each other both ways, so an image is evaluated whole, in one
forward: its expansion is atomic (docs/DESIGN.md §3.5).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from runner.media.pixels import PixelRules
from runner.models.config import json_object
from runner.sources.source import ModelLoadError, show

# Gemma3ImageProcessor's class defaults, which Google's preprocessor_config.json repeats
# (size = the tower's image_size): bilinear resize, x/255, then (x - 0.5) / 0.5.
RESCALE = 1 / 255
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)

NEWLINES = "\n\n"  # what Gemma3Processor puts around each image


class Gemma3ImagePreprocessor:
    """Pixels for the tower: float32 [3, S, S], equal to transformers 5's Gemma3 image
    processor with pan-and-scan off (its default). That is the PIL backend
    (`Gemma3ImageProcessorPil`), the one `AutoImageProcessor` gives wherever torchvision is
    not installed, as in this project's reference environment. The torchvision backend
    (what AutoImageProcessor gives where torchvision is installed) resizes with torch's
    uint8 antialiasing, which differs from Pillow's by one grey level (2/255 after the
    normalisation) on up to a fifth of the pixels when upscaling. Steps, as
    transformers does them: RGB with transparency composited onto white; PIL bilinear resize
    of the uint8 image to S x S; float64 x / 255 cast to float32; (x - mean) / std in
    float32."""

    def __init__(self, vision: dict[str, Any], preprocessor: dict[str, Any] | None = None):
        """`vision`: the checked vision config, whose image_size the pixels must have;
        `preprocessor`: the model's preprocessor_config.json, whose resample filter,
        rescale factor, mean and std (and do_rescale / do_normalize / do_convert_rgb) win over
        the class defaults; its size must be the tower's."""
        self.size = int(vision["image_size"])
        p = json_object(preprocessor or {}, "preprocessor_config.json")
        size = p.get("size") or {"height": self.size, "width": self.size}
        if not isinstance(size, dict) or (size.get("height"), size.get("width")) != (
            self.size,
            self.size,
        ):
            raise ModelLoadError(
                f"preprocessor_config.json: size {show(size)} is not the vision tower's "
                f"{self.size} x {self.size}"
            )
        if p.get("do_pan_and_scan") or p.get("do_resize") is False:
            raise ModelLoadError(
                "preprocessor_config.json: pan-and-scan and no resizing are not supported"
            )
        self.pixels = PixelRules.read(p, Image.Resampling.BILINEAR, RESCALE, IMAGE_MEAN, IMAGE_STD)

    def __call__(self, image: Image.Image) -> np.ndarray:
        rgb = self.pixels.rgb(image)
        resized = rgb.resize((self.size, self.size), resample=self.pixels.resample)
        return self.pixels.normalise(resized)


def image_expansion(
    newline_ids: list[int], boi_id: int, image_id: int, eoi_id: int, image_tokens: int
) -> tuple[list[int], int, int]:
    """The token ids an image tag becomes, and the [start, end) of its soft tokens (the
    atomic range the features replace), as Gemma3Processor expands `<start_of_image>`.
    `newline_ids` are the tokenizer's "\\n\\n" on their own: the Go runner tokenizes the text
    around a tag separately, so they never merge with neighbouring text."""
    nl = list(newline_ids)
    start = len(nl) + 1
    ids = [*nl, boi_id, *[image_id] * image_tokens]
    ids += [eoi_id, *nl]
    return ids, start, start + image_tokens
