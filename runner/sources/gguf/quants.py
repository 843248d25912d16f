"""GGML's tensor types: their blocks, and how each becomes something MLX computes with, exactly.

Every type gets one of three treatments (`kind`):
- "plain": F32, F16, BF16, F64 and the integer types are arrays as stored (`plain`); BF16 stays
  bfloat16 (its bits as uint16 here, `mlx_plain` makes the MLX bfloat16 array), never float16.
- "repack": the block formats whose values are an affine map of unsigned codes with one scale
  and one offset per 32, 64 or 128 weights, or MLX's microscaled formats, are rewritten into
  MLX's own quantized layout (`repack`) so that `mx.dequantize` of the result gives, bit for
  bit, the float32 values llama.cpp's dequantization gives (scales and biases are float32, and
  every product in them is exact). MLX's affine values are `scale * q + bias`, q unsigned,
  packed as one little-endian bit stream per row (element i at bits [i*b, (i+1)*b) of the
  row's uint32 words, for every b: 3-, 5- and 6-bit codes straddle words). The grid i-quants
  whose values are one scale per 32 weights times a small signed integer (IQ2_XXS, IQ3_XXS,
  IQ3_S, IQ1_S: a grid value and its sign) become MLX's 8-bit codes, integer + 128, with the
  scale and -128 times it (10 bits a weight against float32's 32; every product in it exact).
  A model's matrices of the grid types, and of Q2_K to Q6_K, IQ4_XS and IQ4_NL, are kept as
  stored instead (KEPT_TYPES, runner/sources/gguf/model.py) where a native step reads them;
  so are F16 and BF16 matrices (on the CPU, where they would otherwise be widened to float32:
  twice the file's bytes), and elsewhere they are plain arrays again.
- "dequantize": the rest (groups of 16 weights, which MLX cannot group; non-uniform code books)
  become float32 exactly as llama.cpp computes them (`dequantize`): own numpy for Q2_K, Q3_K,
  Q6_K, IQ4_NL, IQ4_XS, MXFP4 and NVFP4, the `gguf` package's for the grid-based IQ types
  (IQ2_XS, IQ2_S, IQ1_M; and the other four's values where `dequantize` is asked for them).

`dequantize` accepts every supported type (the repacked ones too), and `convert` picks: the
repack, or the float32 values where a tensor's own blocks hold something the repack cannot
express (an infinite or NaN float16 scale in a format whose offset is a multiple of its scale
or in a grid i-quant, an MXFP4 exponent of 255, an NVFP4 scale byte of 0xFF); llama.cpp's
quantizers never write them. One difference is left: where llama.cpp's value is a negative zero
(a negative scale times a zero code, a zero scale times a negative grid value), MLX's
`scale * q + bias` gives +0.0; the two compare equal.

Shapes are numpy's: the reverse of a GGUF tensor's dims, so the last axis is ne[0], the row
that blocks run along. `raw` is a tensor's bytes (any uint8 array of exactly that many bytes,
such as `GGUFFile.raw`'s memmap). Work goes in chunks of about a million weights, so
temporaries stay small whatever the tensor's size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from runner.sources.source import ModelLoadError

if TYPE_CHECKING:  # runner/sources imports no MLX at module level (see source.py)
    import mlx.core as mx

Kind = Literal["plain", "repack", "dequantize"]


class GGMLType(NamedTuple):
    id: int
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block


# ggml's type traits (ggml/src/ggml.c, the block structs of ggml-common.h). gguf-py's
# GGML_QUANT_SIZES agrees on all but Q8_1, which it gives 40 bytes where ggml's struct has 36
# (two float16s and 32 int8s); Q8_1 and Q8_K are ggml's types for activations in dot
# products, which no file stores. Ids 4, 5 and 31-33, 36-38 were removed from ggml.
# the types a loaded model may keep as stored (runner/sources/gguf/model.py)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 10, 11, 12, 13, 14, 20, 23
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M = 16, 17, 22, 18, 21, 19, 29
F16, BF16 = 1, 30
KEPT_TYPES = (
    *(Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS),
    *(IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M),  # the grid i-quants
    *(F16, BF16),  # half-precision matrices: as stored where the CPU's native step reads them
)
TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 36),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
        GGMLType(34, "TQ1_0", 256, 54),
        GGMLType(35, "TQ2_0", 256, 66),
        GGMLType(39, "MXFP4", 32, 17),
        GGMLType(40, "NVFP4", 64, 36),
        GGMLType(41, "Q1_0", 128, 18),
    )
}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}
NOT_STORED = {9, 15}  # Q8_1, Q8_K: activation types, refused as tensors

# numpy dtypes of the plain types (BF16: its bits).
_PLAIN: dict[int, np.dtype[Any]] = {
    0: np.dtype("<f4"),
    1: np.dtype("<f2"),
    30: np.dtype("<u2"),
    28: np.dtype("<f8"),
    24: np.dtype("i1"),
    25: np.dtype("<i2"),
    26: np.dtype("<i4"),
    27: np.dtype("<i8"),
}


class MLXQuant(NamedTuple):
    group_size: int
    bits: int
    mode: str


# The repacks: MLX's group size, bits and mode for each.
REPACKS: dict[int, MLXQuant] = {
    2: MLXQuant(32, 4, "affine"),  # Q4_0: scale d, bias -8d
    3: MLXQuant(32, 4, "affine"),  # Q4_1: scale d, bias m
    6: MLXQuant(32, 5, "affine"),  # Q5_0: scale d, bias -16d
    7: MLXQuant(32, 5, "affine"),  # Q5_1: scale d, bias m
    8: MLXQuant(32, 8, "affine"),  # Q8_0: code q+128, scale d, bias -128d
    12: MLXQuant(32, 4, "affine"),  # Q4_K: scale d*sc_j, bias -dmin*m_j
    13: MLXQuant(32, 5, "affine"),  # Q5_K: the same with a fifth bit
    41: MLXQuant(128, 1, "affine"),  # Q1_0: scale 2d, bias -d
    34: MLXQuant(128, 2, "affine"),  # TQ1_0: code t+1 (ternary t), scale d, bias -d
    35: MLXQuant(128, 2, "affine"),  # TQ2_0: scale d, bias -d
    39: MLXQuant(32, 4, "mxfp4"),  # MXFP4: e8m0 scales as stored
    40: MLXQuant(16, 4, "nvfp4"),  # NVFP4: ue4m3 scales with the sign bit cleared
    # the grid i-quants with a scale per 32: code (signed grid value) + 128, scale, bias -128 s
    16: MLXQuant(32, 8, "affine"),  # IQ2_XXS: scale d * (0.5 + ls) / 4
    18: MLXQuant(32, 8, "affine"),  # IQ3_XXS: scale d * (0.5 + ls) / 2
    21: MLXQuant(32, 8, "affine"),  # IQ3_S: scale d * (1 + 2 s)
    19: MLXQuant(32, 8, "affine"),  # IQ1_S: scale d * (2 s + 1) / 8, codes (grid +- 1/8) * 8
}


def type_info(ggml_type: int) -> GGMLType:
    """The type's name and block geometry; a ModelLoadError for an id ggml does not have."""
    info = TYPES.get(ggml_type)
    if info is None:
        raise ModelLoadError(f"unknown GGML tensor type {ggml_type}")
    return info


def type_name(ggml_type: int) -> str:
    info = TYPES.get(ggml_type)
    return info.name if info is not None else f"type {ggml_type}"


def kind(ggml_type: int) -> Kind:
    """What a tensor of this type becomes: "plain" (an array as stored), "repack" (MLX's
    quantized layout, exactly; `convert` may still dequantize a tensor whose blocks the repack
    cannot express) or "dequantize" (float32). A ModelLoadError for unknown or unstorable
    types."""
    info = type_info(ggml_type)
    if ggml_type in NOT_STORED:
        raise ModelLoadError(f"{info.name} is ggml's type for activations, not for stored tensors")
    if ggml_type in _PLAIN:
        return "plain"
    return "repack" if ggml_type in REPACKS else "dequantize"


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this type and (numpy-order) shape; a ModelLoadError when its rows
    are not whole blocks."""
    info = type_info(ggml_type)
    row = shape[-1] if shape else 1
    if row % info.block_size:
        raise ModelLoadError(
            f"rows of {row} weights are not whole {info.name} blocks of {info.block_size}"
        )
    return math.prod(shape) // info.block_size * info.type_size


class Repacked(NamedTuple):
    """A tensor in MLX's quantized layout, as numpy: `weight` uint32 [..., row*bits/32],
    `scales` [..., row/group_size] (float32 for affine, the uint8 exponents or e4m3 bytes for
    mxfp4 / nvfp4), `biases` float32 like `scales` (None for mxfp4 / nvfp4)."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None
    group_size: int
    bits: int
    mode: str


class NotExact(ValueError):
    """This tensor's blocks hold values the repack cannot reproduce exactly."""


# --- helpers ------------------------------------------------------------------------------

_CHUNK_WEIGHTS = 1 << 20


def _blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    info = type_info(ggml_type)
    nbytes = tensor_nbytes(ggml_type, shape)
    flat = np.asarray(raw).reshape(-1)
    if flat.dtype != np.uint8:
        flat = flat.view(np.uint8)
    if flat.size != nbytes:
        raise ValueError(
            f"{info.name} tensor of shape {list(shape)} needs {nbytes} bytes, got {flat.size}"
        )
    return flat.reshape(-1, info.type_size)


def _chunks(n_blocks: int, block_size: int) -> list[slice]:
    step = max(1, _CHUNK_WEIGHTS // block_size)
    return [slice(i, min(i + step, n_blocks)) for i in range(0, n_blocks, step)]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].view(np.float16).astype(np.float32)


def _pairs_from_halves(qs: np.ndarray) -> np.ndarray:
    """Bytes whose low nibbles hold the first half of a run of codes and whose high nibbles
    the second (ggml's layout) -> bytes holding codes (2k, 2k+1) low nibble first (MLX's)."""
    a = qs[..., 0::2]
    b = qs[..., 1::2]
    half = a.shape[-1]
    out = np.empty(qs.shape, np.uint8)
    out[..., :half] = (a & 0x0F) | (b << 4)
    out[..., half:] = (a >> 4) | (b & 0xF0)
    return out


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [n, L] (each < 2**bits, L a multiple of 8) -> MLX's bit stream, bytes [n, L*bits/8]:
    code i at bits [i*bits, (i+1)*bits) of the row, little-endian."""
    n, length = q.shape
    q8 = q.reshape(n, length // 8, 8)
    out = np.zeros((n, length // 8, bits), np.uint8)
    for i in range(8):
        start = i * bits
        byte, shift = divmod(start, 8)
        out[..., byte] |= q8[..., i] << shift
        if shift + bits > 8:
            out[..., byte + 1] |= q8[..., i] >> (8 - shift)
    return out.reshape(n, length * bits // 8)


def _unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `_pack_bits`: bytes [n, L*bits/8] -> codes [n, L] uint8."""
    n = packed.shape[0]
    p = packed.reshape(n, -1, bits)
    out = np.empty((n, p.shape[1], 8), np.uint8)
    mask = np.uint8((1 << bits) - 1)
    for i in range(8):
        byte, shift = divmod(i * bits, 8)
        code = p[..., byte] >> shift
        if shift + bits > 8:
            code |= p[..., byte + 1] << (8 - shift)
        out[..., i] = code & mask
    return out.reshape(n, -1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's split-half nibbles -> codes: [..., k] bytes -> [..., 2k], low nibbles first."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# --- the repacks: blocks [n, type_size] -> (packed bytes [n, B], scales [n, G], biases) ------


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)
    return _pairs_from_halves(blocks[:, 2:18]), d, d * np.float32(-8)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _pairs_from_halves(blocks[:, 4:20]), _f16(blocks, 0), _f16(blocks, 2)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # bit j of the uint32: code j
    return _nibbles(qs) | (high << 4)


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)
    q = _q5_codes(blocks[:, 2:6], blocks[:, 6:22])
    return _pack_bits(q, 5), d, d * np.float32(-16)


def _q5_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = _q5_codes(blocks[:, 4:8], blocks[:, 8:24])
    return _pack_bits(q, 5), _f16(blocks, 0), _f16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)
    return blocks[:, 2:34] ^ np.uint8(0x80), d, d * np.float32(-128)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (d*sc_j, -(dmin*m_j)) for the 8 sub-blocks, float32 [n, 8]; the 6-bit
    sc_j, m_j unpacked as llama.cpp's get_scale_min_k4."""
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    s = blocks[:, 4:16]
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    m = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _k_scales(blocks)
    # 4 chunks of 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j+1
    qs = blocks[:, 16:144].reshape(-1, 4, 32)
    return _pairs_from_halves(qs).reshape(-1, 128), scales, biases


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _k_scales(blocks)
    n = blocks.shape[0]
    qh = blocks[:, 16:48]  # bit s of qh[l]: the fifth bit of code l of sub-block s
    high = np.unpackbits(qh[:, :, None], axis=-1, bitorder="little").transpose(0, 2, 1)
    q = _nibbles(blocks[:, 48:176].reshape(n, 4, 1, 32)).reshape(n, 8, 32)
    q |= high << 4
    return _pack_bits(q.reshape(n, 256), 5), scales, biases


def _q1_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)  # bit 1: +d, bit 0: -d; the bits are already MLX's 1-bit stream
    return blocks[:, 2:18], d * np.float32(2), -d


def _tq2_codes(blocks: np.ndarray) -> np.ndarray:
    qs = blocks[:, 0:64].reshape(-1, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return ((qs >> shifts) & 3).reshape(-1, 256)


_POW3_5 = np.array([1, 3, 9, 27, 81], np.uint8)
_POW3_4 = np.array([1, 3, 9, 27], np.uint8)


def _tq1_codes(blocks: np.ndarray) -> np.ndarray:
    """TQ1_0's base-3 digits, as gguf-py's (and ggml's) dequantization reads them: 0..2."""
    n = blocks.shape[0]
    qs0 = (blocks[:, 0:32].reshape(n, 1, 32) * _POW3_5.reshape(1, 5, 1)).reshape(n, 160)
    qs1 = (blocks[:, 32:48].reshape(n, 1, 16) * _POW3_5.reshape(1, 5, 1)).reshape(n, 80)
    qh = (blocks[:, 48:52].reshape(n, 1, 4) * _POW3_4.reshape(1, 4, 1)).reshape(n, 16)
    q = np.concatenate([qs0, qs1, qh], axis=1)
    return ((q.astype(np.uint16) * 3) >> 8).astype(np.uint8)


def _tq1_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 52)
    return _pack_bits(_tq1_codes(blocks), 2), np.repeat(d, 2, axis=1), np.repeat(-d, 2, axis=1)


def _tq2_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 64)
    return _pack_bits(_tq2_codes(blocks), 2), np.repeat(d, 2, axis=1), np.repeat(-d, 2, axis=1)


def _nibble_lut(code_map: Callable[[int], int]) -> np.ndarray:
    return np.array(
        [code_map(b & 0x0F) | (code_map(b >> 4) << 4) for b in range(256)], dtype=np.uint8
    )


# e2m1 code 8 is -0.0 to MLX and +0 to ggml (its code book's 8th entry is 0): make it code 0.
_FP4_ZERO = _nibble_lut(lambda c: 0 if c == 8 else c)
# ue4m3 bytes as ggml reads them: bit 7 ignored, 0x7F zero (0xFF is 480, which e4m3 lacks).
_UE4M3 = np.array([0 if (b & 0x7F) == 0x7F else b & 0x7F for b in range(256)], np.uint8)


def _pair_luts(code_map: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two ggml bytes (b0, b1), read as the little-endian uint16 b0 | b1 << 8 -> MLX's byte of
    their low nibbles' codes, and of their high nibbles' (`_pairs_from_halves` of each pair,
    `code_map` applied to every nibble first)."""
    b = np.arange(1 << 16, dtype=np.uint32)
    b0, b1 = code_map[b & 0xFF], code_map[b >> 8]
    low = (b0 & 0x0F) | ((b1 & 0x0F) << 4)
    return low.astype(np.uint8), ((b0 >> 4) | (b1 & 0xF0)).astype(np.uint8)


# MXFP4's 16 bytes of codes as 8 uint16 pairs -> MLX's bytes 0-7 and 8-15 (one lookup each
# instead of a lookup, four shifts and masks and two stores: a gpt-oss-20b's 12 GB of experts
# are most of its load).
_FP4_PAIRS_LOW, _FP4_PAIRS_HIGH = _pair_luts(_FP4_ZERO)


def _mxfp4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    e = blocks[:, 0:1]
    if (e == 0xFF).any():
        raise NotExact("an MXFP4 exponent of 255, which MLX reads as NaN")
    pairs = blocks[:, 1:17].view("<u2")  # rows of 17 bytes: each row's 16 contiguous
    out = np.empty((blocks.shape[0], 16), np.uint8)
    out[:, :8] = _FP4_PAIRS_LOW[pairs]
    out[:, 8:] = _FP4_PAIRS_HIGH[pairs]
    return out, e, None


def _nvfp4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    d = blocks[:, 0:4]
    if (d == 0xFF).any():
        raise NotExact("an NVFP4 scale byte of 0xFF, which ggml reads as 480")
    qs = _FP4_ZERO[blocks[:, 4:36]].reshape(-1, 4, 8)  # per 16: low nibbles 0-7, high 8-15
    return _pairs_from_halves(qs).reshape(-1, 32), _UE4M3[d], None


def _iq2_xxs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ2_XXS's scale of each 32 weights, as llama.cpp computes it: d * (0.5 + ls) * 0.25 (ls
    the top 4 bits of the second uint32 of each 8 bytes of qs)."""
    aux = blocks[:, 2:66].copy().view("<u4").reshape(-1, 8, 2)[..., 1]
    return _f16(blocks, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)


def _iq3_xxs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ3_XXS's: d * (0.5 + ls) * 0.5 (ls the top 4 bits of each uint32 after qs[64])."""
    aux = blocks[:, 66:98].copy().view("<u4")
    return _f16(blocks, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)


def _iq3_s_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ3_S's: d * (1 + 2 s) (s the nibbles of scales[4], the last 4 bytes, low first)."""
    scales = blocks[:, 106:110]
    nibbles = np.stack([scales & 15, scales >> 4], axis=-1).reshape(-1, 8)
    return _f16(blocks, 0) * (1 + 2 * nibbles).astype(np.float32)


def _iq1_s_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ1_S's d * (2 ((qh >> 12) & 7) + 1) / 8 (qh[8], uint16, after qs[32]): its values are
    that times (grid + delta) * 8, an odd integer (delta +-1/8)."""
    qh = blocks[:, 34:50].copy().view("<u2")
    dl = _f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    return dl * np.float32(0.125)


@functools.cache
def _grid(name: str) -> np.ndarray:
    """An i-quant's grid (llama.cpp's iq2xxs_grid, iq3xxs_grid, iq3s_grid, iq1s_grid) as
    int16 [entries, values], from the gguf package's copy of llama.cpp's tables."""
    gq = _gguf_quants()
    cls = getattr(gq, name)
    cls.init_grid()
    return np.asarray(cls.grid).reshape(cls.grid_shape).astype(np.int16)


@functools.cache
def _sign_table() -> np.ndarray:
    """llama.cpp's ksigns_iq2xs as +-1 [128, 8]: bit j of entry i clear, + at j."""
    ksigns = np.frombuffer(_gguf_quants().IQ2_XXS.ksigns, np.uint8)
    return (1 - 2 * ((ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1)).astype(np.int16)


def _seven_bit_signs(words: np.ndarray) -> np.ndarray:
    """+-1 [..., 4, 8] from uint32 words [...] holding four 7-bit indices into ksigns (bits 0,
    7, 14, 21): IQ2_XXS's and IQ3_XXS's signs."""
    index = (words[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(127)
    return _sign_table()[index]


def _iq2_xxs_integers(blocks: np.ndarray) -> np.ndarray:
    """IQ2_XXS's values over their scales [n, 8, 32]: each 8 bytes of qs, two uint32s, hold 4
    grid indices (bytes of the first) and 4 sign indices with the scale (the second)."""
    n = len(blocks)
    qs = blocks[:, 2:66].copy().view("<u4").reshape(n, 8, 2)
    index = np.ascontiguousarray(qs[..., 0]).view(np.uint8).reshape(n, 8, 4)
    grid = _grid("IQ2_XXS")[index]  # [n, 8, 4, 8]
    return (grid * _seven_bit_signs(qs[..., 1])).reshape(n, 8, 32)


def _iq3_xxs_integers(blocks: np.ndarray) -> np.ndarray:
    """IQ3_XXS's [n, 8, 32]: qs[64] grid indices (4 values each), then a uint32 a 32 weights
    of 4 sign indices and the scale."""
    n = len(blocks)
    grid = _grid("IQ3_XXS")[blocks[:, 2:66]].reshape(n, 8, 4, 8)
    signs = _seven_bit_signs(blocks[:, 66:98].copy().view("<u4"))
    return (grid * signs).reshape(n, 8, 32)


def _bits(x: np.ndarray) -> np.ndarray:
    """The bits of bytes x [..., m] as [..., m * 8], low first."""
    return np.unpackbits(x, axis=-1, bitorder="little")


def _iq3_s_integers(blocks: np.ndarray) -> np.ndarray:
    """IQ3_S's [n, 8, 32]: grid index i is qs[i] with bit i of qh as its ninth (4 values
    each), value j's sign bit j of signs[32]."""
    n = len(blocks)
    index = blocks[:, 2:66].astype(np.uint16) | _bits(blocks[:, 66:74]).astype(np.uint16) << 8
    grid = _grid("IQ3_S")[index].reshape(n, 256)
    signs = 1 - 2 * _bits(blocks[:, 74:106]).astype(np.int16)
    return (grid * signs).reshape(n, 8, 32)


def _iq1_s_integers(blocks: np.ndarray) -> np.ndarray:
    """IQ1_S's (grid + delta) * 8 [n, 8, 32]: grid index 4b + l is qs[4b + l] with bits 3l ..
    3l + 2 of qh[b] as its top three (8 values of -1, 0, 1 each), delta -1/8 where bit 15 of
    qh[b] is set, else +1/8."""
    n = len(blocks)
    qh = blocks[:, 34:50].copy().view("<u2")  # [n, 8]
    top = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)  # [n, 8, 4]
    index = blocks[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | top << 8
    delta = np.where(qh & np.uint16(0x8000), -1, 1).astype(np.int16)  # [n, 8]
    return (8 * _grid("IQ1_S")[index]).reshape(n, 8, 32) + delta[..., None]


def _signed_grid(
    integers_of: Callable[[np.ndarray], np.ndarray], scales_of: Callable[[np.ndarray], np.ndarray]
) -> _Kernel:
    """A grid i-quant whose values are one scale per 32 weights times a small signed integer
    (the grid value with its sign: IQ2_XXS <= 43, IQ3_XXS <= 62, IQ3_S <= 15, IQ1_S's odd <=
    9) as MLX's 8-bit affine codes: q = integer + 128, the scale, bias -128 scale. Exact:
    scale * q needs 24 bits at most (an 11-bit d times 5 bits of scale times 8 of code), so
    mx.dequantize gives scale times the integer, llama.cpp's value (the tests check every
    code and special scale against gguf-py's dequantization)."""

    def kernel(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q = (integers_of(blocks) + 128).astype(np.uint8).reshape(len(blocks), -1)
        scales = scales_of(blocks).astype(np.float32)
        return q, scales, scales * np.float32(-128)

    return kernel


_Kernel = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]

_REPACK_KERNELS: dict[int, _Kernel] = {
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    8: _q8_0,
    12: _q4_k,
    13: _q5_k,
    41: _q1_0,
    34: _tq1_0,
    35: _tq2_0,
    39: _mxfp4,
    40: _nvfp4,
    16: _signed_grid(_iq2_xxs_integers, _iq2_xxs_scales),
    18: _signed_grid(_iq3_xxs_integers, _iq3_xxs_scales),
    21: _signed_grid(_iq3_s_integers, _iq3_s_scales),
    19: _signed_grid(_iq1_s_integers, _iq1_s_scales),
}
# The affine repacks whose bias is a multiple of the scale, and the code that means zero:
# llama.cpp computes d * (q - zero), which `scale * q + bias` matches only for finite d.
_SYMMETRIC_ZERO = {2: 8, 6: 16, 8: 128, 34: 1, 35: 1, 16: 128, 18: 128, 21: 128, 19: 128}
# ... and Q1_0, whose +d is 2d - d: these repacks hold only where every scale is finite.
_FINITE_ONLY = {*_SYMMETRIC_ZERO, 41}


def repack(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> Repacked:
    """A tensor of a "repack" type in MLX's quantized layout, exact: mx.dequantize of it equals
    llama.cpp's float32 values. NotExact when its blocks hold a value that cannot be (see the
    module's docstring); ValueError for a type without a repack or the wrong number of bytes."""
    quant = REPACKS.get(ggml_type)
    if quant is None:
        raise ValueError(f"{type_name(ggml_type)} has no exact MLX repack")
    kernel = _REPACK_KERNELS[ggml_type]
    info = TYPES[ggml_type]
    blocks = _blocks(raw, ggml_type, shape)
    n = blocks.shape[0]
    packed_bytes = info.block_size * quant.bits // 8
    groups = info.block_size // quant.group_size
    affine = quant.mode == "affine"
    packed = np.empty((n, packed_bytes), np.uint8)
    scales = np.empty((n, groups), np.float32 if affine else np.uint8)
    biases = np.empty((n, groups), np.float32) if affine else None
    with np.errstate(all="ignore"):  # an infinite scale is a value here, not an accident
        for part in _chunks(n, info.block_size):
            p, s, b = kernel(blocks[part])
            packed[part] = p
            scales[part] = s
            if biases is not None:
                biases[part] = b
    if ggml_type in _FINITE_ONLY and not np.isfinite(scales).all():
        raise NotExact(f"a {info.name} block with an infinite or NaN scale")
    lead = tuple(shape[:-1])
    row = shape[-1] if shape else 1
    return Repacked(
        weight=packed.reshape(-1).view(np.uint32).reshape(*lead, row * quant.bits // 32),
        scales=scales.reshape(*lead, row // quant.group_size),
        biases=None if biases is None else biases.reshape(*lead, row // quant.group_size),
        group_size=quant.group_size,
        bits=quant.bits,
        mode=quant.mode,
    )


# --- dequantization: blocks [n, type_size] -> float32 [n, block_size] ------------------------


def _affine_values(ggml_type: int) -> Callable[[np.ndarray], np.ndarray]:
    """llama.cpp's values of a repacked affine type, from its repack kernel: d * (q - zero)
    where the offset is a multiple of the scale, scale * q + bias otherwise (both as llama.cpp
    rounds them)."""
    kernel = _REPACK_KERNELS[ggml_type]
    quant = REPACKS[ggml_type]
    zero = _SYMMETRIC_ZERO.get(ggml_type)

    def values(blocks: np.ndarray) -> np.ndarray:
        packed, scales, biases = kernel(blocks)
        assert biases is not None
        n = blocks.shape[0]
        q = _unpack_bits(packed, quant.bits).reshape(n, scales.shape[1], -1)
        if ggml_type == 41:  # Q1_0: bit ? d : -d
            d = -biases[:, :, None]
            return np.where(q == 1, d, -d).reshape(n, -1)
        if zero is not None:
            centred = q.astype(np.float32) - np.float32(zero)
            return (scales[:, :, None] * centred).reshape(n, -1)
        return (scales[:, :, None] * q.astype(np.float32) + biases[:, :, None]).reshape(n, -1)

    return values


def _q2_k_values(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    d = _f16(blocks, 80)
    dmin = _f16(blocks, 82)
    dl = (d * (sc & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((blocks[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16)
    return (dl * q.astype(np.float32) - ml).reshape(n, 256)


def _q3_k_values(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    hmask = blocks[:, 0:32]
    qs = blocks[:, 32:96]
    s = blocks[:, 96:108]
    d = _f16(blocks, 108)
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)  # scales 0-7, 8-15
    top = s[:, 8:12]
    high = np.concatenate([(top >> k) & 3 for k in (0, 2, 4, 6)], axis=1)
    scales = (low | (high << 4)).astype(np.int8) - np.int8(32)
    dl = (d * scales.astype(np.float32)).reshape(n, 16, 1)
    shifts2 = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> shifts2) & 3).reshape(n, 256)
    hbit = np.unpackbits(hmask[:, None, :], axis=1, bitorder="little").reshape(n, 256)
    q = ql.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _q6_k_values(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    # per 128-weight half: weights 0-63 low nibbles of ql[0:64], 64-127 the high nibbles;
    # bits 2k, 2k+1 of qh[l] are the top two bits of weight 32k + l
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    dl = (d * sc).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


# llama.cpp's kvalues_iq4nl: the values IQ4_NL's and IQ4_XS's 4-bit indices stand for
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)


def _iq4_nl_values(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0)
    return d * IQ4_NL_VALUES[_nibbles(blocks[:, 2:18])]


def _iq4_xs_values(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    sh = blocks[:, 2:4].view("<u2").astype(np.uint16)  # [n, 1]
    sl = blocks[:, 4:8]
    low = np.stack([sl & 0x0F, sl >> 4], axis=2).reshape(n, 8)
    high = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    dl = (d * ls.astype(np.float32)).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 8:136].reshape(n, 8, 16))
    return (dl * IQ4_NL_VALUES[q]).reshape(n, 256)


# ggml's e2m1 code book, doubled (kvalues_mxfp4); its scales carry the half.
_FP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2**(e-128) as float32 (subnormal for e < 2)."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - 1) << 23)
    return bits.astype(np.uint32).view(np.float32)


def _ue4m3_half(x: np.ndarray) -> np.ndarray:
    """ggml_ue4m3_to_fp32: half the unsigned e4m3 value (bit 7 ignored, 0 and 0x7F zero)."""
    table = np.zeros(256, np.float32)
    for b in range(256):
        exp, man = (b >> 3) & 0x0F, b & 7
        raw = math.ldexp(man, -9) if exp == 0 else math.ldexp(1 + man / 8, exp - 7)
        table[b] = 0.0 if b in (0, 0x7F) else raw * 0.5
    return table[x]


_UE4M3_HALF = _ue4m3_half(np.arange(256))


def _mxfp4_values(blocks: np.ndarray) -> np.ndarray:
    return _e8m0_half(blocks[:, 0:1]) * _FP4_VALUES[_nibbles(blocks[:, 1:17])]


def _nvfp4_values(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = _UE4M3_HALF[blocks[:, 0:4]].reshape(n, 4, 1)
    return (d * _FP4_VALUES[_nibbles(blocks[:, 4:36].reshape(n, 4, 8))]).reshape(n, 64)


_DEQUANT_KERNELS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    10: _q2_k_values,
    11: _q3_k_values,
    14: _q6_k_values,
    20: _iq4_nl_values,
    23: _iq4_xs_values,
    39: _mxfp4_values,
    40: _nvfp4_values,
    **{t: _affine_values(t) for t in REPACKS if REPACKS[t].mode == "affine"},
}
# The grid-based types, dequantized by the gguf package (llama.cpp's own numpy port).
_GGUF_DEQUANT = {16, 17, 18, 19, 21, 22, 29}


def plain(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """A "plain" tensor as a numpy array of its stored dtype (BF16: uint16 bits), a view of
    `raw` where it can be."""
    dtype = _PLAIN.get(ggml_type)
    if dtype is None:
        raise ValueError(f"{type_name(ggml_type)} is not a plain type")
    blocks = _blocks(raw, ggml_type, shape)
    return blocks.reshape(-1).view(dtype).reshape(shape)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Any supported tensor as float32 [shape], the values llama.cpp's dequantization (and
    gguf-py's) gives, bit for bit."""
    kind(ggml_type)  # refuses unknown and unstorable types
    if ggml_type in _PLAIN:
        values = plain(raw, ggml_type, shape)
        if ggml_type == 30:  # BF16: its bits are the top half of a float32's
            return (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32)
    info = TYPES[ggml_type]
    blocks = _blocks(raw, ggml_type, shape)
    n = blocks.shape[0]
    with np.errstate(all="ignore"):  # inf * 0 is NaN in llama.cpp too
        if ggml_type in _GGUF_DEQUANT:
            return _gguf_dequantize(blocks, ggml_type).reshape(shape)
        kernel = _DEQUANT_KERNELS[ggml_type]
        out = np.empty((n, info.block_size), np.float32)
        for part in _chunks(n, info.block_size):
            out[part] = kernel(blocks[part])
    return out.reshape(shape)


def _gguf_quants() -> Any:
    """The gguf package's quants module (its grids, its dequantization of the grid types)."""
    try:
        import gguf.quants
    except ImportError:
        raise ModelLoadError(
            "the grid-based IQ types need the gguf package (pip install gguf)"
        ) from None
    return gguf.quants


def _gguf_dequantize(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    gguf_dequantize = _gguf_quants().dequantize
    from gguf import GGMLQuantizationType

    # as one row: gguf-py decodes a row's blocks at once, but rows 16 at a time (blocks as rows
    # of one block each took 16 s for Qwen3-0.6B's IQ3_S file, 107,520 calls)
    n = blocks.shape[0]
    out = gguf_dequantize(
        np.ascontiguousarray(blocks).reshape(1, -1), GGMLQuantizationType(ggml_type)
    )
    return np.asarray(out, np.float32).reshape(n, -1)


def convert(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> Repacked | np.ndarray:
    """What `kind` says: the plain array, the exact repack (or float32 where this tensor's
    blocks cannot be repacked exactly), or float32 values."""
    how = kind(ggml_type)
    if how == "plain":
        return plain(raw, ggml_type, shape)
    if how == "repack":
        try:
            return repack(raw, ggml_type, shape)
        except NotExact:
            pass
    return dequantize(raw, ggml_type, shape)


def mlx_plain(values: np.ndarray, ggml_type: int) -> mx.array:
    """A plain tensor (from `plain`) as an MLX array of its own dtype: BF16 as bfloat16 from
    its bits, exactly."""
    import mlx.core as mx

    if ggml_type == 30:
        return mx.array(np.ascontiguousarray(values, np.uint16)).view(mx.bfloat16)
    return mx.array(np.ascontiguousarray(values))


def narrowed(repacked: Repacked) -> Repacked:
    """An affine repack with its float32 scales and biases as float16 where float16 holds
    every one exactly (Q4_0, Q5_0, Q8_0: d and a power of two times d, from a float16 d),
    else as it is: the same values in 2 bytes a group less each (9 bits a weight for Q8_0
    against 10, 5 for Q4_0 against 6), which a decode step, bound by the bytes it reads,
    gains."""
    if repacked.mode != "affine" or repacked.biases is None:
        return repacked
    narrow = [a.astype(np.float16) for a in (repacked.scales, repacked.biases)]
    for wide, half in zip((repacked.scales, repacked.biases), narrow, strict=True):
        back = half.astype(np.float32)
        if not (
            np.isfinite(back).all() and np.array_equal(back.view(np.uint32), wide.view(np.uint32))
        ):
            return repacked
    return repacked._replace(scales=narrow[0], biases=narrow[1])


def mlx_repacked(repacked: Repacked) -> tuple[mx.array, mx.array, mx.array | None]:
    """A repack as MLX arrays (weight, scales, biases), ready for mx.quantized_matmul and
    mx.dequantize with the repack's group_size, bits and mode."""
    import mlx.core as mx

    biases = repacked.biases
    return (
        mx.array(repacked.weight),
        mx.array(repacked.scales),
        None if biases is None else mx.array(biases),
    )
