"""GGUF files and blocks for the GGUF tests: files written by hand (`gguf_bytes`) for what the
gguf package's GGUFWriter will not write (empty arrays, other versions, a 150k-entry vocabulary
in well under a second, corrupt files); random blocks of every GGML type with the scales that
matter (`make_blocks`); llama.cpp's values for them (`reference`, gguf-py's dequantization);
float32 comparisons bit for bit (`assert_bits_equal`)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from runner.sources.gguf import quants
from runner.sources.gguf.quants import Repacked

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12
_FORMATS = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}


def string(text: str | bytes) -> bytes:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def value(vtype: int, val: Any, item_type: int | None = None) -> bytes:
    """A value's bytes, without its type (an array: item type, count, items). `item_type`
    of an array of arrays is (ARRAY, inner item type) nested as a tuple."""
    if vtype in _FORMATS:
        return struct.pack(_FORMATS[vtype], val)
    if vtype == STRING:
        return string(val)
    assert vtype == ARRAY and item_type is not None
    inner: int | None = None
    if isinstance(item_type, tuple):
        item_type, inner = item_type
    out = [struct.pack("<IQ", item_type, len(val))]
    if item_type == STRING:
        out.extend(string(s) for s in val)
    else:
        out.extend(value(item_type, v, inner) for v in val)
    return b"".join(out)


def strings_array(items: Sequence[str]) -> bytes:
    """An array of strings, fast (a vocabulary's worth)."""
    pack = struct.Struct("<Q").pack
    encoded = (s.encode("utf-8") for s in items)
    return struct.pack("<IQ", STRING, len(items)) + b"".join(pack(len(e)) + e for e in encoded)


def gguf_bytes(
    kvs: Sequence[tuple[str, int, bytes]],
    tensors: Sequence[tuple[str, Sequence[int], int, bytes]] = (),
    *,
    version: int = 3,
    alignment: int = 32,
    offsets: Sequence[int] | None = None,
) -> bytes:
    """A whole file: `kvs` as (key, value type, value bytes from `value`); `tensors` as
    (name, dims in GGUF order, GGML type, data), laid out in order at `alignment`, their
    infos saying where (or the `offsets` given, true or not)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for key, vtype, data in kvs:
        out += string(key) + struct.pack("<I", vtype) + data
    offset = 0
    laid: list[int] = []
    for _, _, _, data in tensors:
        laid.append(offset)
        offset += -(-len(data) // alignment) * alignment
    for (name, dims, ggml_type, _), at in zip(tensors, offsets if offsets else laid, strict=True):
        out += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, at)
    out += bytes(-len(out) % alignment)
    for _, _, _, data in tensors:
        out += data + bytes(-len(data) % alignment)
    return bytes(out)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# Byte offsets of each type's float16 scale fields in its block.
F16_FIELDS = {
    2: [0],  # Q4_0
    3: [0, 2],  # Q4_1
    6: [0],  # Q5_0
    7: [0, 2],  # Q5_1
    8: [0],  # Q8_0
    10: [80, 82],  # Q2_K
    11: [108],  # Q3_K
    12: [0, 2],  # Q4_K
    13: [0, 2],  # Q5_K
    14: [208],  # Q6_K
    16: [0],  # IQ2_XXS
    18: [0],  # IQ3_XXS
    19: [0],  # IQ1_S
    20: [0],  # IQ4_NL
    21: [0],  # IQ3_S
    23: [0],  # IQ4_XS
    34: [52],  # TQ1_0
    35: [64],  # TQ2_0
    41: [0],  # Q1_0
}
# float16 bit patterns every scale field takes in some block: the largest finite magnitudes,
# the smallest and largest subnormals, the smallest normal, zeros of both signs, one.
SPECIAL_F16 = [0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x0000, 0x8000, 0x3C00]
SPECIAL_E8M0 = [0, 1, 2, 126, 127, 128, 253, 254]
SPECIAL_UE4M3 = [0x00, 0x01, 0x07, 0x08, 0x7E, 0x7F, 0x80, 0x81, 0xFE, 0x38]
# The repacks whose values are d * (q - zero): llama.cpp's -0.0 for a negative d and the zero
# code is MLX's +0.0 (scale * q + bias); everything else matches to the bit. The grid i-quants'
# (IQ2_XXS, IQ3_XXS, IQ1_S, IQ3_S) the same way: a zero scale times a negative grid value.
SIGNED_ZERO_DIFFERS = {2, 6, 8, 34, 35, 41, 16, 18, 19, 21}
# The repacks that hold for any float16 scale, infinities and NaNs included.
ANY_SCALE = {3, 7, 12, 13}


def make_blocks(rng: np.random.Generator, t: int, n: int, *, finite: bool = True) -> np.ndarray:
    """Random blocks of type `t`: [n, type_size] uint8, every code value; the scale fields
    take each special pattern in the first blocks (offset per field, so d and dmin differ);
    with `finite`, no infinite or NaN scale (nor MXFP4 exponent 255, NVFP4 scale 0xFF)."""
    blocks = rng.integers(0, 256, size=(n, quants.TYPES[t].type_size), dtype=np.uint8)
    for k, at in enumerate(F16_FIELDS.get(t, [])):
        h = blocks[:, at : at + 2].view("<u2")
        if finite:
            h[(h & 0x7C00) == 0x7C00] &= 0xBBFF
        for i, pattern in enumerate(SPECIAL_F16[k:] + SPECIAL_F16[:k]):
            if i < n:
                h[i] = pattern
    if t == 39:  # MXFP4: the exponent byte
        if finite:
            blocks[blocks[:, 0] == 0xFF, 0] = 0xFE
        k = min(n, len(SPECIAL_E8M0))
        blocks[:k, 0] = SPECIAL_E8M0[:k]
    if t == 40:  # NVFP4: four ue4m3 scale bytes
        scales = blocks[:, 0:4]
        if finite:
            scales[scales == 0xFF] = 0xFE
        for i, byte in enumerate(SPECIAL_UE4M3[: 4 * n]):
            scales[i // 4, i % 4] = byte
    return blocks


def reference(blocks: np.ndarray, t: int, rows: int) -> np.ndarray:
    """llama.cpp's float32 values: gguf-py's dequantization (a transcription of ggml's
    dequantize_row_q1_0 for Q1_0, which gguf-py lacks)."""
    if t == 41:
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        bits = np.unpackbits(blocks[:, 2:18], axis=1, bitorder="little")
        return np.where(bits == 1, d, -d).reshape(rows, -1)
    import gguf

    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType(t))


def mlx_values(r: Repacked) -> np.ndarray:
    weight, scales, biases = quants.mlx_repacked(r)
    out = mx.dequantize(
        weight,
        scales,
        biases,
        group_size=r.group_size,
        bits=r.bits,
        mode=r.mode,
        dtype=mx.float32,
    )
    return np.array(out)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, *, zero_sign: bool = True):
    """Equal as float32 bit patterns (any NaN matching any NaN); with zero_sign=False, -0.0
    and +0.0 count as the same."""
    assert actual.dtype == expected.dtype == np.float32
    assert actual.shape == expected.shape
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan), "NaNs differ"
    a, e = actual[~nan], expected[~nan]
    if not zero_sign:
        a, e = a + np.float32(0), e + np.float32(0)
    bad = a.view(np.uint32) != e.view(np.uint32)
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ, first: {a[bad][:4]} != {e[bad][:4]}"
