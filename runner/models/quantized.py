"""Quantized layers as the Go runner imports them, where mlx-lm's stock layers fall short.

mlx-lm's `QuantizedLinear` / `QuantizedEmbedding` cover the formats themselves (affine int4 /
int8, mxfp4, mxfp8, nvfp4: MLX modes of the same names). Two things they lack:
- nvfp4's optional global scale (`P.weight.global_scale`, else `P.weight_scale_2`: one
  number for the tensor, or one per output row): the output of the quantized product is
  multiplied by it, and dequantized rows are multiplied by their row's scale;
- an embedding's dequantized rows in the compute dtype: MLX dequantizes scales without a
  dtype of their own (the microscaled formats') to bfloat16.
`adopt` gives the quantized layers of a loaded module these subclasses (parameters keep their
names; a global scale becomes the layer's `global_scale`), before the weights are loaded.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import infer_quant_config

from runner.sources.source import ModelLoadError

GLOBAL_SCALE = "global_scale"


def _row_scales(layer: nn.Module) -> mx.array | None:
    """The layer's global scale as a vector: [1] for the tensor, or [rows]."""
    scale = layer.get(GLOBAL_SCALE)
    return None if scale is None else scale.reshape(-1)


class ScaledQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose product is multiplied by its global scale, before the bias."""

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        scale = _row_scales(self)
        if scale is not None:
            y = y * scale.astype(y.dtype)
        if "bias" in self:
            y = y + self["bias"]
        return y


class ScaledQuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding whose rows come out in `dtype` (None: MLX's choice) times their
    global scale, and whose `as_linear` (a tied head) scales its product the same way."""

    dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        rows = mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x],
            biases=biases[x] if biases is not None else None,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            dtype=self.dtype,
        )
        scale = _row_scales(self)
        if scale is None:
            return rows
        per_row = scale[x][..., None] if scale.size > 1 else scale
        return rows * per_row.astype(rows.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        y = super().as_linear(x)
        scale = _row_scales(self)
        return y if scale is None else y * scale.astype(y.dtype)


def adopt(module: nn.Module, weights: dict[str, Any], dtype: mx.Dtype | None) -> None:
    """Make `module`'s quantized embeddings `ScaledQuantizedEmbedding`s (rows in `dtype`),
    and give every layer with a `P.global_scale` in `weights` that parameter; refuse a
    global scale on anything but a quantized linear or embedding layer, or of a size that
    is neither one number nor one per row."""
    layers = dict(module.named_modules())
    for layer in layers.values():
        if type(layer) is nn.QuantizedEmbedding:
            layer.__class__ = ScaledQuantizedEmbedding
            layer.dtype = dtype
    for name in sorted(weights):
        if not name.endswith("." + GLOBAL_SCALE):
            continue
        path = name[: -len(GLOBAL_SCALE) - 1]
        layer = layers.get(path)
        if type(layer) is nn.QuantizedLinear:
            layer.__class__ = ScaledQuantizedLinear
        elif not isinstance(layer, ScaledQuantizedEmbedding):
            raise ModelLoadError(
                f"tensor {name}: a global quantization scale needs a quantized linear or "
                f"embedding layer at {path}"
            )
        rows = layer["scales"].shape[0]
        size = weights[name].size
        if size not in (1, rows):
            raise ModelLoadError(
                f"tensor {name}: {size} global scales for {rows} rows (expected 1 or {rows})"
            )
        setattr(layer, GLOBAL_SCALE, mx.ones(weights[name].shape, dtype=mx.float32))


class _Shape:
    """What `infer_quant_config` reads of an unquantized layer: its weight's shape."""

    def __init__(self, in_dims: int):
        self.weight = mx.zeros((1, in_dims))


def dequantize_weight(weights: dict[str, mx.array], path: str, in_dims: int) -> mx.array:
    """Layer `path`'s weight in float32 from its packed `weight`, `scales`, `biases` and
    global scale in `weights` (those are removed), with group size, bits and mode read off
    the arrays as mlx-lm reads them: for a sanitize that must reshape a quantized tensor."""
    try:
        params = infer_quant_config(path, _Shape(in_dims), weights)  # type: ignore[arg-type]
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    dense = mx.dequantize(
        weights[f"{path}.weight"],
        weights.pop(f"{path}.scales"),
        weights.pop(f"{path}.biases", None),
        dtype=mx.float32,
        **params,
    )
    scale = weights.pop(f"{path}.{GLOBAL_SCALE}", None)
    if scale is not None:
        scale = scale.reshape(-1).astype(mx.float32)
        dense = dense * (scale[:, None] if scale.size > 1 else scale)
    return dense
