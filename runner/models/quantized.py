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

GGML's Q6_K blocks (what Q4_K_M files hold for `ffn_down`, `attn_v` and often the embedding)
have a scale per 16 weights, which MLX's affine format cannot group, and their exact float32
values take 4.9x the file's bytes. A GGUF source names such layers in its quantization config
(`{"ggml_type": "Q6_K"}`, runner/sources/gguf/model.py) with their blocks as `P.blocks`;
`adopt_blocks` keeps them as `Q6KLinear` / `Q6KEmbedding` layers where a native step will
read them (runner/backend/native_step.py, runner/native/quantized.c), and otherwise makes
them float32 weights as before. The layers' own forward (MLX's path) dequantizes the blocks
with MLX operations, to the values llama.cpp's dequantization gives, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
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


# A GGUF source's quantization entry for a layer kept in GGML blocks, and their parameter.
GGML_TYPE = "ggml_type"
BLOCKS = "blocks"
Q6_K = "Q6_K"
Q6_K_WEIGHTS, Q6_K_BYTES = 256, 210  # weights and bytes a block


def dequantize_q6_k(blocks: mx.array) -> mx.array:
    """float32 [..., k] from Q6_K blocks [..., k / 256 * 210] (uint8): llama.cpp's values
    (each block: codes' low 4 bits ql[128], high 2 bits qh[64], int8 scales[16] a 16
    weights, float16 d; a weight is (d * scale) * (code - 32), one rounding)."""
    *lead, width = blocks.shape
    n = width // Q6_K_BYTES
    x = blocks.reshape(*lead, n, Q6_K_BYTES)
    ql = x[..., 0:128].reshape(*lead, n, 2, 64)
    qh = x[..., 128:192].reshape(*lead, n, 2, 1, 32)
    scales = mx.contiguous(x[..., 192:208]).view(mx.int8).astype(mx.float32)
    d = mx.contiguous(x[..., 208:210]).view(mx.float16).astype(mx.float32)
    # per 128-weight half: weights 0-63 from ql's low nibbles, 64-127 its high ones; bits 2s,
    # 2s + 1 of qh[l] are the top two bits of weight 32s + l
    low = mx.concatenate([ql & 15, ql >> 4], axis=-1)
    shifts = mx.array([0, 2, 4, 6], mx.uint8).reshape(4, 1)
    high = ((qh >> shifts) & 3).reshape(*lead, n, 2, 128)
    codes = (low | (high << 4)).astype(mx.float32) - 32
    scale = (d * scales).reshape(*lead, n, 16, 1)
    return (scale * codes.reshape(*lead, n, 16, 16)).reshape(*lead, n * Q6_K_WEIGHTS)


class Q6KLinear(nn.Module):
    """A linear layer whose weight is Q6_K blocks [out, in / 256 * 210] as a GGUF stores
    them; MLX's path dequantizes the whole weight each call (the native step reads the
    blocks, and takes every forward it can)."""

    ggml_type = Q6_K

    def __init__(self, input_dims: int, output_dims: int, bias: bool):
        super().__init__()
        self.blocks = mx.zeros((output_dims, input_dims // Q6_K_WEIGHTS * Q6_K_BYTES), mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ dequantize_q6_k(self[BLOCKS]).astype(x.dtype).T
        return y + self["bias"] if "bias" in self else y


class Q6KEmbedding(nn.Module):
    """An embedding whose table is Q6_K blocks [vocab, dims / 256 * 210]: rows dequantized as
    they are gathered; `as_linear` (a tied head) dequantizes the table."""

    ggml_type = Q6_K

    def __init__(self, num_embeddings: int, dims: int):
        super().__init__()
        self.blocks = mx.zeros((num_embeddings, dims // Q6_K_WEIGHTS * Q6_K_BYTES), mx.uint8)

    def __call__(self, x: mx.array) -> mx.array:
        return dequantize_q6_k(self[BLOCKS][x])

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ dequantize_q6_k(self[BLOCKS]).astype(x.dtype).T


def block_layers(quantization: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[str]]:
    """A source's quantization config without its GGML block entries (what mlx-lm's
    quantization reads; None when nothing is left), and the paths of those entries."""
    if not quantization:
        return quantization, []
    paths = [p for p, q in quantization.items() if isinstance(q, dict) and GGML_TYPE in q]
    for path in paths:
        if quantization[path][GGML_TYPE] != Q6_K:
            raise ModelLoadError(f"{path}: GGML blocks of type {quantization[path][GGML_TYPE]}")
    rest = {p: q for p, q in quantization.items() if p not in paths}
    return (rest or None), paths


def adopt_blocks(
    module: nn.Module, weights: dict[str, Any], paths: Iterable[str], keep: bool
) -> None:
    """The layers at `paths`, whose weights are Q6_K blocks (`P.blocks` in `weights`): when
    `keep`, a linear or embedding layer becomes a Q6KLinear / Q6KEmbedding reading them;
    otherwise (or another kind of layer: experts, ...) `P.weight` becomes their float32
    values, as a dequantized tensor's were. Before the module's sanitize and load."""
    layers = dict(module.named_modules())
    kept: list[tuple[str, nn.Module]] = []
    for path in paths:
        name = f"{path}.{BLOCKS}"
        if name not in weights:
            raise ModelLoadError(f"tensor {name} is missing")
        blocks, layer = weights[name], layers.get(path)
        rows, width = blocks.shape[0], blocks.shape[-1] // Q6_K_BYTES * Q6_K_WEIGHTS
        if keep and blocks.ndim == 2 and type(layer) is nn.Linear:
            kept.append((path, Q6KLinear(width, rows, bias="bias" in layer)))
        elif keep and blocks.ndim == 2 and type(layer) is nn.Embedding:
            kept.append((path, Q6KEmbedding(rows, width)))
        else:
            weights[f"{path}.weight"] = dequantize_q6_k(weights.pop(name))
    if kept:
        module.update_modules(tree_unflatten(kept))


def release_blocks(module: nn.Module) -> bool:
    """Every Q6KLinear / Q6KEmbedding of `module` made an nn.Linear / nn.Embedding of its
    float32 values (where no native step reads the blocks: MLX's path would dequantize them
    in every forward); whether there was one."""
    swapped: list[tuple[str, nn.Module]] = []
    for path, layer in module.named_modules():
        if not isinstance(layer, (Q6KLinear, Q6KEmbedding)):
            continue
        values = dequantize_q6_k(layer[BLOCKS])
        rows, width = values.shape
        new: nn.Module
        if isinstance(layer, Q6KLinear):
            new = nn.Linear(width, rows, bias="bias" in layer)
            if "bias" in layer:
                new.bias = layer["bias"]
        else:
            new = nn.Embedding(rows, width)
        new.weight = values
        swapped.append((path, new))
    if swapped:
        module.update_modules(tree_unflatten(swapped))
        mx.eval(module.parameters())
    return bool(swapped)
