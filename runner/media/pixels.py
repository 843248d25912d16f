"""The pixel rules a transformers image processor shares across families, read from a
model's preprocessor_config.json: RGB conversion, the resample filter, the rescale factor,
the normalisation. A family supplies its processor class's defaults; the file's values win,
as they do in transformers. Families keep their own geometry (square resize, patches).

The steps, as transformers' PIL backends do them: RGB with transparency composited onto
white (`to_rgb`); resize of the uint8 image with `resample`; float64 x * rescale cast to
float32; (x - mean) / std in float32 (`normalise`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from runner.sources.source import ModelLoadError, show
from runner.sources.values import number


@dataclass(frozen=True)
class PixelRules:
    resample: Image.Resampling
    rescale: float
    mean: np.ndarray  # [3, 1, 1] float32
    std: np.ndarray
    convert_rgb: bool

    @classmethod
    def read(
        cls,
        p: dict[str, Any],
        resample: Image.Resampling,
        rescale: float,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
    ) -> PixelRules:
        """The rules of preprocessor_config.json `p` over the class defaults given; a
        ModelLoadError names a value transformers would not accept."""
        chosen = p.get("resample", resample)
        try:
            filter_ = Image.Resampling(chosen)
        except (ValueError, TypeError):
            raise ModelLoadError(
                f"preprocessor_config.json: resample {show(chosen)} is not a PIL filter"
            ) from None
        factor = (
            number(
                p.get("rescale_factor", rescale), "rescale_factor", file="preprocessor_config.json"
            )
            if p.get("do_rescale", True)
            else 1.0
        )
        means, stds = p.get("image_mean", mean), p.get("image_std", std)
        if not p.get("do_normalize", True):
            means, stds = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        for name, values in (("image_mean", means), ("image_std", stds)):
            if not (
                isinstance(values, list | tuple)
                and len(values) == 3
                and all(isinstance(v, int | float) and math.isfinite(v) for v in values)
            ) or (name == "image_std" and 0 in values):
                raise ModelLoadError(
                    f"preprocessor_config.json: {name} {show(values)} is not three finite numbers"
                )
        return cls(
            resample=filter_,
            rescale=factor,
            mean=np.array(means, np.float32)[:, None, None],
            std=np.array(stds, np.float32)[:, None, None],
            convert_rgb=p.get("do_convert_rgb", True) is not False,
        )

    def rgb(self, image: Image.Image) -> Image.Image:
        return to_rgb(image) if self.convert_rgb or image.mode != "RGB" else image

    def normalise(self, resized: Image.Image) -> np.ndarray:
        """float32 [3, H, W] of a resized RGB image."""
        chw = np.asarray(resized).transpose(2, 0, 1)
        scaled = (chw.astype(np.float64) * self.rescale).astype(np.float32)
        return np.ascontiguousarray((scaled - self.mean) / self.std, dtype=np.float32)


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: transparency (an alpha band or a palette's transparent
    index) composited onto white, everything else converted by Pillow (an RGB image as it
    is).

    The compositing is a paste of the RGBA image onto white through its own alpha, equal to
    transformers' `Image.alpha_composite` with a white background for every (value, alpha)
    pair (tests/test_media_limits.py checks all 65,536): Pillow's `alpha_composite` holds
    the GIL throughout (1.4 s for a 9000 x 9000 image, the event loop stalled meanwhile),
    `paste` and `convert` release it, and the white RGB image replaces two RGBA ones."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, (0, 0), rgba)
        return white
    return image if image.mode == "RGB" else image.convert("RGB")
