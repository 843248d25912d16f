"""Qwen3.5's image processing: image -> the tower's patches (`Qwen3_5ImagePreprocessor`,
with `smart_resize`), and the tokens an `[img-N]` tag becomes (`image_expansion`).

transformers 5 is the reference: the PIL backend of its Qwen2-VL image processor (what
AutoImageProcessor gives qwen3_5) for the pixels: `smart_resize` to multiples of
patch * merge within [min_pixels, max_pixels], bicubic, rescale, normalise, then patches
[grid_h * grid_w, C * temporal_patch * patch * patch] in merge-block order, the still image
repeated over the temporal patch; Qwen3VLProcessor for the expansion: `<|vision_start|>`,
grid_h * grid_w / merge^2 `<|image_pad|>`, `<|vision_end|>`. Attention stays causal over the
pads (no image attends both ways), so an image's item is **causal**: prefill chunks may
split it (docs/DESIGN.md §3.5).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image

from runner.media.pixels import PixelRules
from runner.media.prepare import Expansion, ExpansionItem
from runner.models.config import integer, json_object
from runner.sources.source import ModelLoadError, show

# Qwen2VLImageProcessorPil's class defaults (a preprocessor_config.json may override them).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
RESCALE = 1 / 255
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
MAX_ASPECT = 200  # smart_resize refuses longer images

Grid = tuple[int, int, int]  # (t, h, w) in patches, before the merge


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' `smart_resize`: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(
            f"invalid image data: aspect ratio {max(height, width) / min(height, width):.1f} "
            f"is over {MAX_ASPECT}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen3_5ImagePreprocessor:
    """Patches for the tower, equal to transformers 5's `Qwen2VLImageProcessorPil` (what
    AutoImageProcessor gives qwen3_5 where torchvision is not installed, as in this
    project's reference environment): RGB with transparency composited onto white;
    `smart_resize`; PIL resize of the uint8 image; float64 x * rescale cast to float32;
    (x - mean) / std in float32; patches in merge-block order (block row, block column,
    row in block, column in block), each C x temporal_patch x patch x patch with the image
    repeated over the temporal patch."""

    def __init__(self, vision: dict[str, Any], preprocessor: dict[str, Any] | None = None):
        """`vision`: the checked vision config, whose patch geometry the pixels must have;
        `preprocessor`: the model's preprocessor_config.json, whose sizes, filter, rescale,
        mean and std win over the class defaults."""
        p = json_object(preprocessor or {}, "preprocessor_config.json")
        for key, tower_key in (
            ("patch_size", "patch_size"),
            ("temporal_patch_size", "temporal_patch_size"),
            ("merge_size", "spatial_merge_size"),
        ):
            value = p.get(key, vision[tower_key])
            if value != vision[tower_key]:
                raise ModelLoadError(
                    f"preprocessor_config.json: {key} {show(value)} is not the vision tower's "
                    f"{vision[tower_key]}"
                )
        self.patch = int(vision["patch_size"])
        self.temporal = int(vision["temporal_patch_size"])
        self.merge = int(vision["spatial_merge_size"])
        size = p.get("size") or {}
        if not isinstance(size, dict):
            raise ModelLoadError(f"preprocessor_config.json: size {show(size)} is not an object")
        low = p.get("min_pixels", size.get("shortest_edge", MIN_PIXELS))
        high = p.get("max_pixels", size.get("longest_edge", MAX_PIXELS))
        self.min_pixels = integer(low, "preprocessor_config.json min_pixels")
        self.max_pixels = integer(high, "preprocessor_config.json max_pixels")
        factor = self.patch * self.merge
        if self.max_pixels < max(self.min_pixels, factor * factor):
            raise ModelLoadError(
                f"preprocessor_config.json: max_pixels {self.max_pixels} is below min_pixels "
                f"{self.min_pixels} or one merged patch ({factor} x {factor})"
            )
        if p.get("do_resize") is False:
            raise ModelLoadError("preprocessor_config.json: no resizing is not supported")
        self.pixels = PixelRules.read(p, Image.Resampling.BICUBIC, RESCALE, IMAGE_MEAN, IMAGE_STD)

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size `smart_resize` gives an image of `height` x `width` (ValueError for an
        aspect ratio over MAX_ASPECT): what decoding will give, known from a header."""
        factor = self.patch * self.merge
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[Grid, int]:
        """The grid (1, h, w) in patches of an image of `height` x `width`, and the bytes of
        its float32 patches."""
        resized_height, resized_width = self.resized(height, width)
        gh, gw = resized_height // self.patch, resized_width // self.patch
        return (1, gh, gw), gh * gw * 3 * self.temporal * self.patch * self.patch * 4

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, Grid]:
        """float32 patches [h * w, 3 * T * P * P] and the grid (1, h, w) in patches."""
        rgb = self.pixels.rgb(image)
        height, width = self.resized(rgb.height, rgb.width)
        resized = rgb.resize((width, height), resample=self.pixels.resample)
        pixels = self.pixels.normalise(resized)
        p, m, t = self.patch, self.merge, self.temporal
        gh, gw = height // p, width // p
        blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        patches = np.ascontiguousarray(repeated.reshape(gh * gw, 3 * t * p * p), np.float32)
        return patches, (1, gh, gw)


def image_tokens(grid: Grid, merge: int, start_id: int, pad_id: int, end_id: int) -> list[int]:
    """vision_start, one pad per merged patch of `grid`, vision_end."""
    n = grid[0] * grid[1] * grid[2] // (merge * merge)
    return [start_id, *[pad_id] * n, end_id]


def image_expansion(
    patches: np.ndarray, grid: Grid, merge: int, start_id: int, pad_id: int, end_id: int
) -> Expansion:
    """vision_start, the image's pads (one causal item, its grid the item's opaque state),
    vision_end."""
    tokens = image_tokens(grid, merge, start_id, pad_id, end_id)
    n = len(tokens) - 2
    return Expansion(tokens, [ExpansionItem(1, 1 + n, patches, causal=True, opaque=grid)])
