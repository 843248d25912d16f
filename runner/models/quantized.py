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

GGML's Q6_K blocks (what Q4_K_M files hold for `ffn_down`, `attn_v` and often the embedding),
Q3_K blocks (most of a Q3_K_M file) and Q2_K blocks (most of a Q2_K file) have a scale per 16
weights, which MLX's affine format cannot group, and IQ4_XS and IQ4_NL blocks (an IQ4_XS file's
matrices whose rows are not whole 256s: most of SmolLM2's) a table of 16 values no affine map
makes; their exact float32 values take 4.9x, 9.3x, 12.2x, 7.5x and 7.1x the file's bytes. Q4_K
and Q5_K repack exactly onto MLX's affine 4- and 5-bit groups of 32, but only with float32
scales and biases (6 and 7 bits a weight, against the file's 4.5 and 5.5), which a decode step,
bound by the bytes it reads, pays for. The grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, IQ1_S, IQ1_M: 1.56 to 3.44 bits a weight) become 8-bit affine codes where their scale
covers 32 weights (10 bits a weight), float32 where it covers 16. A GGUF source names such
layers in its quantization config (`{"ggml_type": "Q6_K"}`, `"Q4_K"`, ..., `"IQ1_M"`,
runner/sources/gguf/model.py) with their blocks as `P.blocks`; `adopt_blocks` keeps them as
`GGMLLinear` / `GGMLEmbedding` layers where a native step will read them
(runner/backend/native_step.py, runner/native/quantized.c) or where the CPU backend's library
computes their products from MLX's graph (`BlockProducts`: runner/backend/library_products.py;
a family without a native step, a forward the step declines), and otherwise (Metal, CUDA, a
sharded model) makes the types AFFINE_REPACKS names the affine repack and the others float32
weights, as before. A layer without products (MLX's path) dequantizes the blocks with MLX
operations (the grid types with numpy), to the values llama.cpp's dequantization gives, bit
for bit. A GGUF's F16 and BF16 matrices (HALF_TYPES) come as their rows' bytes too: kept so
only where a native step reads them (on the CPU, float32 for MLX's path with exact half copies
beside it for the step took 3x their bytes: Ollama's gpt-oss:20b holds all but its experts
in BF16), else plain arrays of their dtype again.

A mixture of experts' stacked projections ([experts, out, bytes a row] of blocks: Qwen3-MoE's
Q4_K_M holds Q4_K and Q6_K experts, nearly all its bytes) become `GGMLSwitchLinear`s in
place of mlx-lm's switch layers where the library computes their products, for any family:
Q6_K experts as float32 would take ~5x the file. Elsewhere they become MLX's formats as the
other layers do. Layers in MLX's own affine quantization (mlx-lm's conversions) that no native
step reads compute by the library too where it reads them (`compute_affine`: AffineLinear,
AffineSwitchLinear, a tied ScaledQuantizedEmbedding's head), not by MLX's CPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import infer_quant_config

from runner.sources.gguf import quants
from runner.sources.gguf.quants import IQ4_NL_VALUES
from runner.sources.source import ModelLoadError

GLOBAL_SCALE = "global_scale"


def float32_affine(scales: mx.array, biases: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """An affine quantization's floating scales and biases widened (exactly) to float32:
    MLX dequantizes in the scales' dtype whatever `dtype` asks, so half scales would round
    the float32 values. Integer scales (the microscaled formats') are returned as they are."""
    if not mx.issubdtype(scales.dtype, mx.floating):
        return scales, biases
    return scales.astype(mx.float32), None if biases is None else biases.astype(mx.float32)


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
    # computes `as_linear` where set (compute_affine)
    products: BlockProducts | None = None

    def __call__(self, x: mx.array) -> mx.array:
        scales, biases = self["scales"][x], self.get("biases")
        biases = biases[x] if biases is not None else None
        if self.dtype == mx.float32:  # the rows as the float32 values
            scales, biases = float32_affine(scales, biases)
        rows = mx.dequantize(
            self["weight"][x],
            scales=scales,
            biases=biases,
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
        if self.products is not None:  # (only where there is no global scale)
            return self.products.matmul_affine(x, self)
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
    scales, biases = float32_affine(
        weights.pop(f"{path}.scales"), weights.pop(f"{path}.biases", None)
    )
    dense = mx.dequantize(weights[f"{path}.weight"], scales, biases, dtype=mx.float32, **params)
    scale = weights.pop(f"{path}.{GLOBAL_SCALE}", None)
    if scale is not None:
        scale = scale.reshape(-1).astype(mx.float32)
        dense = dense * (scale[:, None] if scale.size > 1 else scale)
    return dense


# A GGUF source's quantization entry for a layer kept in GGML blocks, and their parameter.
GGML_TYPE = "ggml_type"
BLOCKS = "blocks"
Q6_K, Q4_K, Q5_K, Q3_K, Q2_K, IQ4_XS = "Q6_K", "Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS"
IQ4_NL = "IQ4_NL"
# the grid i-quants (blocks of 256: a scale per 32 or 16 weights times grid values)
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS = "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"
IQ3_S, IQ1_S, IQ1_M = "IQ3_S", "IQ1_S", "IQ1_M"
GRID_TYPES = (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
BLOCK_WEIGHTS = 256  # weights a block, of all these types but IQ4_NL
IQ4_NL_WEIGHTS = 32
Q6_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q3_K_BYTES, Q2_K_BYTES = 210, 144, 176, 110, 84  # a block
IQ4_XS_BYTES, IQ4_NL_BYTES = 136, 18
# GGUF's half-precision matrices, kept as stored only where a native step reads them (their
# "blocks" are the rows' bytes; `adopt_blocks`), else plain arrays of their dtype again
HALF_TYPES = {"F16": mx.float16, "BF16": mx.bfloat16}


def dequantize_half(blocks: mx.array, ggml_type: str) -> mx.array:
    """float32 [..., k] from a half-precision matrix's bytes [..., 2 k] (uint8): each value
    widened exactly."""
    return blocks.view(HALF_TYPES[ggml_type]).astype(mx.float32)


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
    return (scale * codes.reshape(*lead, n, 16, 16)).reshape(*lead, n * BLOCK_WEIGHTS)


def _two_bit_codes(qs: mx.array) -> mx.array:
    """The 2-bit codes of qs [..., n, 64] (Q2_K's codes, Q3_K's low bits) as [..., n, 2, 4, 32]
    uint8, in order of k: weight 128h + 32s + l is bits 2s, 2s + 1 of qs[32h + l]."""
    *lead, n, _ = qs.shape
    shifts = mx.array([0, 2, 4, 6], mx.uint8).reshape(4, 1)
    return (qs.reshape(*lead, n, 2, 1, 32) >> shifts) & 3


def dequantize_q3_k(blocks: mx.array) -> mx.array:
    """float32 [..., k] from Q3_K blocks [..., k / 256 * 110] (uint8): llama.cpp's values
    (each block: hmask[32], the codes' low 2 bits qs[64], twelve bytes of sixteen 6-bit scales,
    float16 d; weight 128h + 32s + l's code is its low bits less 4 where bit 4h + s of hmask[l]
    is clear, its value (d * (sc - 32)) * code: every product exact)."""
    *lead, width = blocks.shape
    n = width // Q3_K_BYTES
    x = blocks.reshape(*lead, n, Q3_K_BYTES)
    hmask = x[..., 0:32].reshape(*lead, n, 1, 1, 32)
    bits = mx.arange(8, dtype=mx.uint8).reshape(2, 4, 1)
    high = (hmask >> bits) & 1
    codes = _two_bit_codes(x[..., 32:96]).astype(mx.float32) + (high.astype(mx.float32) * 4 - 4)
    # the scales as llama.cpp unpacks them: sc_j's low 4 bits from the nibbles of bytes 0-7
    # (low nibbles first), its high 2 bits from bytes 8-11, two bits at a time
    low, top = x[..., 96:104], x[..., 104:108]
    nibbles = mx.concatenate([low & 15, low >> 4], axis=-1)
    pairs = mx.concatenate([(top >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    sc = (nibbles | (pairs << 4)).astype(mx.float32) - 32
    d = mx.contiguous(x[..., 108:110]).view(mx.float16).astype(mx.float32)
    scale = (d * sc).reshape(*lead, n, 16, 1)
    return (scale * codes.reshape(*lead, n, 16, 16)).reshape(*lead, n * BLOCK_WEIGHTS)


def dequantize_q2_k(blocks: mx.array) -> mx.array:
    """float32 [..., k] from Q2_K blocks [..., k / 256 * 84] (uint8): llama.cpp's values (each
    block: scales[16], a 4-bit scale and a 4-bit min a 16 weights, 2-bit codes qs[64], float16
    d and dmin; a weight is (d * (sc & 15)) * q - dmin * (sc >> 4): the products exact, the
    difference rounded once)."""
    *lead, width = blocks.shape
    n = width // Q2_K_BYTES
    x = blocks.reshape(*lead, n, Q2_K_BYTES)
    sc = x[..., 0:16]
    codes = _two_bit_codes(x[..., 16:80]).astype(mx.float32).reshape(*lead, n, 16, 16)
    d = mx.contiguous(x[..., 80:82]).view(mx.float16).astype(mx.float32)
    dmin = mx.contiguous(x[..., 82:84]).view(mx.float16).astype(mx.float32)
    scale = (d * (sc & 15).astype(mx.float32))[..., None]
    bias = (-(dmin * (sc >> 4).astype(mx.float32)))[..., None]
    return (scale * codes + bias).reshape(*lead, n * BLOCK_WEIGHTS)


def dequantize_iq4_xs(blocks: mx.array) -> mx.array:
    """float32 [..., k] from IQ4_XS blocks [..., k / 256 * 136] (uint8): llama.cpp's values
    (each block: float16 d, scales_h (uint16: bits 2b, 2b + 1 the high bits of sub-block b's
    6-bit scale ls_b), scales_l[4] (their low nibbles, sub-block 2i low, 2i + 1 high), qs[128]:
    in sub-block b, weight 32b + l is the low nibble of qs[16b + l], 32b + 16 + l its high one;
    a weight is (d * (ls_b - 32)) * IQ4_NL_VALUES[index]: every product exact)."""
    *lead, width = blocks.shape
    n = width // IQ4_XS_BYTES
    x = blocks.reshape(*lead, n, IQ4_XS_BYTES)
    d = mx.contiguous(x[..., 0:2]).view(mx.float16).astype(mx.float32)
    high = mx.contiguous(x[..., 2:4]).view(mx.uint16)
    shifts = mx.arange(0, 16, 2, dtype=mx.uint16)
    tops = ((high >> shifts) & 3).astype(mx.int32)  # [..., n, 8]
    low = x[..., 4:8]
    lows = mx.stack([low & 15, low >> 4], axis=-1).reshape(*lead, n, 8).astype(mx.int32)
    ls = (lows | (tops << 4)) - 32
    qs = x[..., 8:136].reshape(*lead, n, 8, 1, 16)
    index = mx.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*lead, n, 8, 32)
    values = mx.array(IQ4_NL_VALUES)[index.astype(mx.int32)]
    scale = (d * ls.astype(mx.float32))[..., None]
    return (scale * values).reshape(*lead, n * BLOCK_WEIGHTS)


def dequantize_iq4_nl(blocks: mx.array) -> mx.array:
    """float32 [..., k] from IQ4_NL blocks [..., k / 32 * 18] (uint8): llama.cpp's values
    (each block: float16 d, qs[16]: weight l is the low nibble of qs[l], 16 + l its high one;
    a weight is d * IQ4_NL_VALUES[index]: every product exact)."""
    *lead, width = blocks.shape
    n = width // IQ4_NL_BYTES
    x = blocks.reshape(*lead, n, IQ4_NL_BYTES)
    d = mx.contiguous(x[..., 0:2]).view(mx.float16).astype(mx.float32)
    qs = x[..., 2:18]
    index = mx.concatenate([qs & 15, qs >> 4], axis=-1)
    values = mx.array(IQ4_NL_VALUES)[index.astype(mx.int32)]
    return (d * values).reshape(*lead, n * IQ4_NL_WEIGHTS)


def _k_quant_parts(blocks: mx.array, ggml_type: str) -> tuple[mx.array, mx.array, mx.array]:
    """Q4_K blocks [..., n * 144] (or Q5_K [..., n * 176]) as (codes [..., n, 8, 32] uint8,
    scales d * sc_j and biases -(dmin * m_j) [..., n, 8, 1] float32): each block d, dmin
    (float16), 12 bytes of 6-bit sc_j, m_j (llama.cpp's get_scale_min_k4), Q5_K's qh[32],
    qs[128]: in chunk c, weight 64c + l is the low nibble of qs[32c + l], weight 64c + 32 + l
    its high one; Q5_K adds 16 times bit 2c (2c + 1) of qh[l]."""
    size = BLOCK_BYTES[ggml_type]
    *lead, width = blocks.shape
    n = width // size
    x = blocks.reshape(*lead, n, size)
    d = mx.contiguous(x[..., 0:2]).view(mx.float16).astype(mx.float32)
    dmin = mx.contiguous(x[..., 2:4]).view(mx.float16).astype(mx.float32)
    lo, mid, top = x[..., 4:8], x[..., 8:12], x[..., 12:16]
    sc = mx.concatenate([lo & 63, (top & 15) | ((lo >> 2) & 48)], axis=-1).astype(mx.float32)
    m = mx.concatenate([mid & 63, (top >> 4) | ((mid >> 2) & 48)], axis=-1).astype(mx.float32)
    qs = x[..., size - 128 : size].reshape(*lead, n, 4, 1, 32)
    codes = mx.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*lead, n, 8, 32)
    if ggml_type == Q5_K:
        qh = x[..., 16:48].reshape(*lead, n, 1, 32)
        codes = codes | (((qh >> mx.arange(8, dtype=mx.uint8).reshape(8, 1)) & 1) << 4)
    return codes, (d * sc)[..., None], (-(dmin * m))[..., None]


def dequantize_k_quant(blocks: mx.array, ggml_type: str) -> mx.array:
    """float32 [..., k] from Q4_K or Q5_K blocks [..., k / 256 * bytes a block] (uint8):
    llama.cpp's values, (d * sc_j) * q - (dmin * m_j), the product rounded, then the
    difference."""
    codes, scales, biases = _k_quant_parts(blocks, ggml_type)
    *lead, n, _, _ = codes.shape
    return (scales * codes.astype(mx.float32) + biases).reshape(*lead, n * BLOCK_WEIGHTS)


def affine_repack(blocks: mx.array, ggml_type: str) -> tuple[mx.array, mx.array, mx.array]:
    """Blocks [rows, k / 256 * bytes a block] of a type AFFINE_REPACKS names as MLX's affine
    quantization: Q4_K (Q5_K) 4 (5) bits, float32 scales d * sc_j and biases -(dmin * m_j);
    IQ2_XXS, IQ3_XXS, IQ3_S and IQ1_S 8 bits (the signed grid value + 128), their scale and
    -128 times it: the same values exactly, by GGUF loading's own repack (numpy: MLX's
    element-wise CPU operations take seconds a 1B). quants.NotExact where a grid block's
    scale is not finite (llama.cpp's values are then not an affine map's)."""
    import numpy as np

    raw = np.asarray(blocks)
    rows, k = raw.shape[0], block_columns(ggml_type, raw.shape[1])
    repacked = quants.repack(raw.reshape(-1), quants.BY_NAME[ggml_type].id, (rows, k))
    assert repacked.biases is not None
    return mx.array(repacked.weight), mx.array(repacked.scales), mx.array(repacked.biases)


def dequantize_grid(blocks: mx.array, ggml_type: str) -> mx.array:
    """float32 [..., k] from blocks of a grid i-quant (GRID_TYPES) [..., k / 256 * bytes a
    block] (uint8): llama.cpp's values, by GGUF loading's own dequantization (numpy: the grids'
    lookups, checked against gguf-py's and llama.cpp's values)."""
    import numpy as np

    raw = np.asarray(blocks)
    shape = (*raw.shape[:-1], block_columns(ggml_type, raw.shape[-1]))
    kind = quants.BY_NAME[ggml_type].id
    return mx.array(quants.dequantize(np.ascontiguousarray(raw).reshape(-1), kind, shape))


DEQUANTIZE: dict[str, Callable[[mx.array], mx.array]] = {
    Q6_K: dequantize_q6_k,
    Q4_K: partial(dequantize_k_quant, ggml_type=Q4_K),
    Q5_K: partial(dequantize_k_quant, ggml_type=Q5_K),
    Q3_K: dequantize_q3_k,
    Q2_K: dequantize_q2_k,
    IQ4_XS: dequantize_iq4_xs,
    IQ4_NL: dequantize_iq4_nl,
    **{t: partial(dequantize_grid, ggml_type=t) for t in GRID_TYPES},
    **{t: partial(dequantize_half, ggml_type=t) for t in HALF_TYPES},
}
BLOCK_BYTES = {
    Q6_K: Q6_K_BYTES, Q4_K: Q4_K_BYTES, Q5_K: Q5_K_BYTES, Q3_K: Q3_K_BYTES, Q2_K: Q2_K_BYTES,
    IQ4_XS: IQ4_XS_BYTES, IQ4_NL: IQ4_NL_BYTES,
    **{t: quants.BY_NAME[t].type_size for t in (*GRID_TYPES, *HALF_TYPES)},
}  # fmt: skip


def block_columns(ggml_type: str, width: int) -> int:
    """The columns of a matrix whose rows are `width` bytes of `ggml_type` blocks."""
    info = quants.BY_NAME[ggml_type]
    return width // info.type_size * info.block_size


def block_width(ggml_type: str, columns: int) -> int:
    """The bytes of a row of `columns` weights in `ggml_type` blocks."""
    info = quants.BY_NAME[ggml_type]
    return columns // info.block_size * info.type_size


class BlockProducts(Protocol):
    """Products over GGML blocks computed elsewhere than MLX's graph (the CPU backend's native
    library: runner/backend/library_products.py)."""

    def reads(self, ggml_type: str, rows: int, columns: int) -> bool:
        """Whether it computes products of a matrix [rows, columns] of `ggml_type`."""
        ...

    def matmul(self, x: mx.array, blocks: mx.array, ggml_type: str) -> mx.array:
        """`x @ W.T` for the matrix W of `blocks` [rows, bytes a row]: [..., rows]."""
        ...

    def gather(self, x: mx.array, indices: mx.array, blocks: mx.array, ggml_type: str) -> mx.array:
        """`mx.gather_mm(x, W.swapaxes(-1, -2), rhs_indices=indices)` for the experts W of
        `blocks` [experts, rows, bytes a row]: [batch..., m, rows] in x's dtype."""
        ...

    def reads_affine(self, layer: Any) -> bool:
        """Whether it computes the products of an affine `QuantizedLinear`,
        `QuantizedEmbedding` or `QuantizedSwitchLinear`'s weight."""
        ...

    def matmul_affine(self, x: mx.array, layer: Any) -> mx.array:
        """The affine `layer`'s `quantized_matmul` (without its bias)."""
        ...

    def gather_affine(self, x: mx.array, indices: mx.array, layer: Any) -> mx.array:
        """The `QuantizedSwitchLinear` `layer`'s `gather_qmm` (without its bias)."""
        ...


class _GGMLBlocks(nn.Module):
    """A weight of GGML blocks of `ggml_type` (BLOCK_BYTES' types), [rows, columns / weights a
    block * bytes a block] as a GGUF stores them."""

    def __init__(self, rows: int, columns: int, ggml_type: str):
        super().__init__()
        self.ggml_type = ggml_type
        # where set, products are computed from the blocks (not dequantized in the graph)
        self.products: BlockProducts | None = None
        self.blocks = mx.zeros((rows, block_width(ggml_type, columns)), mx.uint8)

    def dequantized(self, rows: mx.array | None = None) -> mx.array:
        """The weight's float32 values (of `rows` only, if given)."""
        blocks = self[BLOCKS] if rows is None else self[BLOCKS][rows]
        return DEQUANTIZE[self.ggml_type](blocks)


class GGMLLinear(_GGMLBlocks):
    """A linear layer whose weight is GGML blocks [out, in / weights * bytes a block]: its
    `products` compute each call where set, else MLX's path dequantizes the whole weight each
    call (the native step reads the blocks, and takes every forward it can)."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool, ggml_type: str):
        super().__init__(output_dims, input_dims, ggml_type)
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        if self.products is not None:
            y = self.products.matmul(x, self[BLOCKS], self.ggml_type)
        else:
            y = x @ self.dequantized().astype(x.dtype).T
        return y + self["bias"] if "bias" in self else y


class GGMLEmbedding(_GGMLBlocks):
    """An embedding whose table is GGML blocks [vocab, dims / weights * bytes a block]: rows
    dequantized as they are gathered; `as_linear` (a tied head) is its `products`' where set,
    else it dequantizes the table."""

    def __init__(self, num_embeddings: int, dims: int, ggml_type: str):
        super().__init__(num_embeddings, dims, ggml_type)

    def __call__(self, x: mx.array) -> mx.array:
        return self.dequantized(x)

    def as_linear(self, x: mx.array) -> mx.array:
        if self.products is not None:
            return self.products.matmul(x, self[BLOCKS], self.ggml_type)
        return x @ self.dequantized().astype(x.dtype).T


class GGMLSwitchLinear(nn.Module):
    """mlx-lm's `SwitchLinear` (a mixture of experts' stacked projections) whose experts are
    GGML blocks [experts, out, in / weights * bytes a block], as a GGUF stores them:
    `products` computes the routed tokens' products from the blocks where it is set (the CPU
    backend's native library); otherwise MLX's path dequantizes the experts a call chooses,
    and only those, and multiplies with `mx.gather_mm`."""

    def __init__(
        self, input_dims: int, output_dims: int, num_experts: int, bias: bool, ggml_type: str
    ):
        super().__init__()
        self.ggml_type = ggml_type
        self.products: BlockProducts | None = None
        width = block_width(ggml_type, input_dims)
        self.blocks = mx.zeros((num_experts, output_dims, width), mx.uint8)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if self.products is not None:
            y = self.products.gather(x, indices, self[BLOCKS], self.ggml_type)
        else:
            import numpy as np

            mx.eval(indices)
            chosen = np.asarray(indices)
            ids = np.unique(chosen)
            local = mx.array(np.searchsorted(ids, chosen).astype(np.uint32))
            experts = DEQUANTIZE[self.ggml_type](self[BLOCKS][mx.array(ids)])
            # MLX's CPU gather_mm multiplies float32 only (runner/models/moe.py)
            y = mx.gather_mm(
                x.astype(mx.float32),
                experts.swapaxes(-1, -2),
                rhs_indices=local,
                sorted_indices=sorted_indices,
            ).astype(x.dtype)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


class AffineLinear(nn.QuantizedLinear):
    """An `nn.QuantizedLinear` (MLX's affine quantization: mlx-lm's conversions) whose products
    are its `products`' where set (the CPU backend's library: MLX's CPU `quantized_matmul` runs
    at ~1-3 GFLOP/s), else MLX's."""

    products: BlockProducts | None = None

    def __call__(self, x: mx.array) -> mx.array:
        if self.products is None:
            return super().__call__(x)
        y = self.products.matmul_affine(x, self)
        return y + self["bias"] if "bias" in self else y


class AffineSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's `QuantizedSwitchLinear` (MLX's affine experts: mlx-lm's conversions of a mixture
    of experts) whose products are its `products`' where set (the CPU backend's library: MLX's
    CPU `gather_qmm` runs at ~1-3 GFLOP/s), else MLX's."""

    products: BlockProducts | None = None

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if self.products is None:
            return super().__call__(x, indices, sorted_indices)
        y = self.products.gather_affine(x, indices, self)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


def compute_affine(module: nn.Module, products: BlockProducts) -> int:
    """Make `module`'s affine layers whose weights `products` computes compute by it: an
    `nn.QuantizedLinear` an AffineLinear, a `QuantizedSwitchLinear` an AffineSwitchLinear (same
    parameters, same object), a ScaledQuantizedEmbedding's `as_linear` (a tied head). After
    any native step has taken the layers it reads (it reads the plain classes). Returns how
    many layers changed."""
    changed = 0
    swaps: dict[type, type] = {
        nn.QuantizedLinear: AffineLinear,
        QuantizedSwitchLinear: AffineSwitchLinear,
        ScaledQuantizedEmbedding: ScaledQuantizedEmbedding,
    }
    for _, layer in module.named_modules():
        cls = swaps.get(type(layer))
        if cls is not None and products.reads_affine(layer):
            layer.__class__ = cls
            layer.products = products
            changed += 1
    return changed


def block_layers(quantization: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[str]]:
    """A source's quantization config without its GGML block entries (what mlx-lm's
    quantization reads; None when nothing is left), and the paths of those entries."""
    if not quantization:
        return quantization, []
    paths = [p for p, q in quantization.items() if isinstance(q, dict) and GGML_TYPE in q]
    for path in paths:
        if quantization[path][GGML_TYPE] not in BLOCK_BYTES:
            raise ModelLoadError(f"{path}: GGML blocks of type {quantization[path][GGML_TYPE]}")
    rest = {p: q for p, q in quantization.items() if p not in paths}
    return (rest or None), paths


# How a layer of these types whose blocks are not kept is quantized instead (affine_repack)
Q4_K_AFFINE: dict[str, Any] = {"group_size": 32, "bits": 4, "mode": "affine"}
AFFINE_REPACKS: dict[str, dict[str, Any]] = {
    Q4_K: Q4_K_AFFINE,
    Q5_K: {**Q4_K_AFFINE, "bits": 5},
    **{t: {**Q4_K_AFFINE, "bits": 8} for t in (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S)},
}


def _affine_or_none(blocks: mx.array, ggml_type: str) -> tuple[mx.array, mx.array, mx.array] | None:
    """affine_repack of a matrix of blocks (or of stacked experts' [experts, rows, bytes])
    where its type has one and it holds; else None."""
    if ggml_type not in AFFINE_REPACKS or blocks.ndim not in (2, 3):
        return None
    lead = blocks.shape[:-1]
    try:
        parts = affine_repack(blocks.reshape(-1, blocks.shape[-1]), ggml_type)
    except quants.NotExact:
        return None
    weight, scales, biases = (p.reshape(*lead, p.shape[-1]) for p in parts)
    return weight, scales, biases


def _switch_layer(layers: dict[str, nn.Module], path: str) -> str | None:
    """Where the module holds the stacked experts a GGUF names `path` (`<p>.mlp.experts.<proj>`:
    mlx-lm's switch layer `<p>.mlp.switch_mlp.<proj>`, runner/models/moe.py's renaming), when
    that is an mlx-lm `SwitchLinear`; else None."""
    prefix, sep, proj = path.rpartition(".mlp.experts.")
    target = f"{prefix}.mlp.switch_mlp.{proj}"
    return target if sep and type(layers.get(target)) is SwitchLinear else None


def adopt_blocks(
    module: nn.Module,
    weights: dict[str, Any],
    quantization: dict[str, Any],
    paths: Iterable[str],
    keep: bool,
    products: BlockProducts | None = None,
) -> dict[str, Any] | None:
    """The layers at `paths`, whose weights are GGML blocks (`P.blocks` in `weights`, their
    type in `quantization[path]`): a linear or embedding layer becomes a GGMLLinear /
    GGMLEmbedding reading them when `keep` (a native step will) or where `products` reads
    them; stacked experts (`<p>.mlp.experts.<proj>`, [E, out, bytes]) become a
    GGMLSwitchLinear at their switch layer where `products` reads them; every layer kept
    computes by `products` (None: MLX's path dequantizes). F16 and BF16 matrices (HALF_TYPES)
    are kept only where `keep` and `products` reads them, and are otherwise plain weights of
    their dtype, as a GGUF's half tensors always were. Otherwise the types AFFINE_REPACKS
    names become MLX's affine quantization of the same values (`P.weight`, `P.scales`,
    `P.biases`, quantized as it says) and the others (Q6_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL, IQ2_XS,
    IQ2_S, IQ1_M, and a grid block with a scale that is not finite) float32 `P.weight`, as a
    dequantized tensor's were. Before the module's sanitize and load. Returns the source's
    quantization config without the block entries and with the affine layers' entries added
    (None if it is empty)."""
    layers = dict(module.named_modules())
    kept: list[tuple[str, nn.Module]] = []
    affine: dict[str, Any] = {}
    for path in paths:
        name = f"{path}.{BLOCKS}"
        if name not in weights:
            raise ModelLoadError(f"tensor {name} is missing")
        ggml_type = quantization[path][GGML_TYPE]
        blocks, layer = weights[name], layers.get(path)
        rows = blocks.shape[-2]  # (a matrix's, or each stacked expert's)
        width = block_columns(ggml_type, blocks.shape[-1])
        switch = _switch_layer(layers, path) if blocks.ndim == 3 else None
        computed = products is not None and products.reads(ggml_type, rows, width)
        stepped = keep and computed and blocks.ndim == 2
        if ggml_type in HALF_TYPES and not (stepped and type(layer) in (nn.Linear, nn.Embedding)):
            # as stored only for a native step that reads them (where else MLX's path would
            # widen them once, to the compute dtype), else a plain weight of its dtype again
            weights[f"{path}.weight"] = weights.pop(name).view(HALF_TYPES[ggml_type])
            continue
        new: GGMLLinear | GGMLEmbedding | GGMLSwitchLinear | None = None
        if (keep or computed) and blocks.ndim == 2 and type(layer) is nn.Linear:
            new = GGMLLinear(width, rows, "bias" in layer, ggml_type)
        elif (keep or computed) and blocks.ndim == 2 and type(layer) is nn.Embedding:
            new = GGMLEmbedding(rows, width, ggml_type)
        elif computed and switch is not None:
            bias = "bias" in layers[switch]
            new = GGMLSwitchLinear(width, rows, blocks.shape[0], bias, ggml_type)
            weights[f"{switch}.{BLOCKS}"] = weights.pop(name)
            path = switch
        if new is not None:
            new.products = products
            kept.append((path, new))
        elif (repacked := _affine_or_none(blocks, ggml_type)) is not None:
            del weights[name]
            weights[f"{path}.weight"], weights[f"{path}.scales"] = repacked[0], repacked[1]
            weights[f"{path}.biases"] = repacked[2]
            affine[path] = dict(AFFINE_REPACKS[ggml_type])
        else:
            weights[f"{path}.weight"] = DEQUANTIZE[ggml_type](weights.pop(name))
    if kept:
        module.update_modules(tree_unflatten(kept))
    rest, _ = block_layers(quantization)
    if not affine:
        return rest
    return {**Q4_K_AFFINE, **(rest or {}), **affine}


def release_blocks(module: nn.Module) -> bool:
    """Every GGMLLinear / GGMLEmbedding of `module` made what MLX's path computes well (where no
    native step reads the blocks and no products compute them: MLX's path would dequantize them
    in every forward): the types AFFINE_REPACKS names an affine QuantizedLinear /
    QuantizedEmbedding of the same values (Q4_K and Q5_K 4 and 5 bits, the grid i-quants with
    a scale per 32 weights 8), the others an nn.Linear / nn.Embedding of their float32 values;
    whether there was one."""
    swapped: list[tuple[str, nn.Module]] = []
    for path, layer in module.named_modules():
        if not isinstance(layer, (GGMLLinear, GGMLEmbedding)):
            continue
        blocks = layer[BLOCKS]
        rows = blocks.shape[0]
        width = block_columns(layer.ggml_type, blocks.shape[1])
        bias = "bias" in layer
        new: nn.Module
        repacked = _affine_or_none(blocks, layer.ggml_type)
        if repacked is not None:
            packed, scales, biases = repacked
            bits = AFFINE_REPACKS[layer.ggml_type]["bits"]
            if isinstance(layer, GGMLLinear):
                new = nn.QuantizedLinear(width, rows, bias, group_size=32, bits=bits)
            else:
                new = ScaledQuantizedEmbedding(rows, width, group_size=32, bits=bits)
                new.dtype = mx.float32
            new.weight, new.scales, new.biases = packed, scales, biases
        else:
            values = layer.dequantized()
            new = (
                nn.Linear(width, rows, bias=bias)
                if isinstance(layer, GGMLLinear)
                else nn.Embedding(rows, width)
            )
            new.weight = values
        if bias and isinstance(layer, GGMLLinear):
            new.bias = layer["bias"]
        swapped.append((path, new))
    if swapped:
        module.update_modules(tree_unflatten(swapped))
        mx.eval(module.parameters())
    return bool(swapped)
