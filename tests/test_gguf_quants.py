"""runner/sources/gguf/quants.py: every repack, bit for bit: mx.dequantize of the repacked
tensor equals gguf.quants.dequantize of the raw blocks (llama.cpp's values) as float32, for
random blocks with extreme, subnormal and zero float16 scales and every code, and for blocks
gguf quantized from floats; every dequantized type equal to gguf's; the checks themselves
shown to catch a wrong repack (MLX's own GGUF reader's Q4_K sub-block bug among them)."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runner.sources.gguf import quants
from runner.sources.gguf.quants import NotExact, Repacked
from runner.sources.source import ModelLoadError
from tests.gguf_files import (
    ANY_SCALE,
    F16_FIELDS,
    SIGNED_ZERO_DIFFERS,
    assert_bits_equal,
    make_blocks,
    mlx_values,
    reference,
)

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType


def check_repack(r: Repacked, blocks: np.ndarray, t: int, rows: int) -> None:
    assert_bits_equal(
        mlx_values(r), reference(blocks, t, rows), zero_sign=t not in SIGNED_ZERO_DIFFERS
    )


REPACK_TYPES = sorted(quants.REPACKS)


def test_block_table_matches_gguf_constants():
    theirs = {int(t): size for t, size in gguf.constants.GGML_QUANT_SIZES.items()}
    assert set(quants.TYPES) == set(theirs)
    for t, info in quants.TYPES.items():
        assert info.name == QT(t).name
        if t == 9:  # Q8_1: ggml's block_q8_1 is 2 float16s + 32 int8s; gguf-py says 40
            assert (info.block_size, info.type_size) == (32, 36) and theirs[t] == (32, 40)
        else:
            assert (info.block_size, info.type_size) == theirs[t], info.name


def test_every_type_has_a_treatment():
    kinds = {
        quants.TYPES[t].name: quants.kind(t) for t in quants.TYPES if t not in quants.NOT_STORED
    }
    assert {n for n, k in kinds.items() if k == "plain"} == {
        "F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"
    }  # fmt: skip
    assert {n for n, k in kinds.items() if k == "repack"} == {
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q1_0", "TQ1_0", "TQ2_0",
        "MXFP4", "NVFP4", "IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ1_S",
    }  # fmt: skip
    assert {n for n, k in kinds.items() if k == "dequantize"} == {
        "Q2_K", "Q3_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XS", "IQ2_S", "IQ1_M",
    }  # fmt: skip
    for t in (9, 15):
        with pytest.raises(ModelLoadError, match="activations"):
            quants.kind(t)
    with pytest.raises(ModelLoadError, match="unknown GGML tensor type 42"):
        quants.kind(42)
    with pytest.raises(ModelLoadError, match="not whole Q4_K blocks of 256"):
        quants.tensor_nbytes(12, (4, 128))


@pytest.mark.parametrize("t", REPACK_TYPES, ids=lambda t: quants.TYPES[t].name)
def test_repack_is_exact_for_random_blocks(t):
    rng = np.random.default_rng(t)
    info = quants.TYPES[t]
    rows, cols = 24, max(info.block_size * 4, 512)
    blocks = make_blocks(rng, t, rows * cols // info.block_size)
    r = quants.repack(blocks, t, (rows, cols))
    group, bits, mode = quants.REPACKS[t]
    assert (r.group_size, r.bits, r.mode) == (group, bits, mode)
    assert r.weight.dtype == np.uint32 and r.weight.shape == (rows, cols * bits // 32)
    assert r.scales.shape == (rows, cols // group)
    assert r.scales.dtype == (np.float32 if mode == "affine" else np.uint8)
    assert (r.biases is None) == (mode != "affine")
    check_repack(r, blocks, t, rows)
    # and the numpy dequantization of the same type is llama.cpp's, sign of zero included
    assert_bits_equal(quants.dequantize(blocks, t, (rows, cols)), reference(blocks, t, rows))


@pytest.mark.parametrize("t", sorted(ANY_SCALE), ids=lambda t: quants.TYPES[t].name)
def test_asymmetric_repacks_hold_for_infinite_and_nan_scales(t):
    rng = np.random.default_rng(100 + t)
    rows, cols = 32, 512
    blocks = make_blocks(rng, t, rows * cols // quants.TYPES[t].block_size, finite=False)
    for at in F16_FIELDS[t]:  # make sure some are there
        blocks[10:20, at : at + 2].view("<u2")[:, 0] = [0x7C00, 0xFC00, 0x7E00, 0xFE01] * 2 + [
            0
        ] * 2
    check_repack(quants.repack(blocks, t, (rows, cols)), blocks, t, rows)


def floats(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    scale = np.exp(rng.uniform(-12, 6, size=(rows, 1))).astype(np.float32)
    values = rng.standard_normal((rows, cols)).astype(np.float32) * scale
    values[0, :40] = 0.0  # an all-zero block
    values[1, :32] = np.float32(1e-7)
    return values


@pytest.mark.parametrize(
    "t",
    [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.TQ1_0, QT.TQ2_0, QT.MXFP4],
    ids=lambda t: t.name,
)
def test_repack_of_blocks_gguf_quantized_from_floats(t):
    rng = np.random.default_rng(int(t))
    rows, cols = 16, 512
    raw = gguf.quants.quantize(floats(rng, rows, cols), t)
    blocks = raw.reshape(-1, quants.TYPES[int(t)].type_size)
    check_repack(quants.repack(raw, int(t), (rows, cols)), blocks, int(t), rows)


def _odd_sub_blocks_reuse_even_scales(r: Repacked) -> Repacked:
    """MLX's own GGUF loader's Q4_K bug: weights 32-63 of each 64 get the scale and min of
    weights 0-31."""
    scales, biases = r.scales.copy(), r.biases.copy()
    scales[:, 1::2], biases[:, 1::2] = scales[:, 0::2], biases[:, 0::2]
    return r._replace(scales=scales, biases=biases)


def _ggml_nibble_order(r: Repacked, blocks: np.ndarray) -> Repacked:
    """Q4_K's codes left in ggml's order (low nibbles: weights 0-31, high: 32-63)."""
    return r._replace(
        weight=np.ascontiguousarray(blocks[:, 16:]).view(np.uint32).reshape(r.weight.shape)
    )


def _fifth_bit_dropped(r: Repacked) -> Repacked:
    codes = quants._unpack_bits(r.weight.view(np.uint8).reshape(r.weight.shape[0], -1), 5)
    return r._replace(
        weight=quants._pack_bits(codes & 0x0F, 5).view(np.uint32).reshape(r.weight.shape)
    )


@pytest.mark.parametrize(
    ("t", "mutate"),
    [
        (12, lambda r, b: _odd_sub_blocks_reuse_even_scales(r)),
        (12, _ggml_nibble_order),
        (13, lambda r, b: _fifth_bit_dropped(r)),
        (13, lambda r, b: _odd_sub_blocks_reuse_even_scales(r)),
        (2, lambda r, b: r._replace(biases=r.scales * np.float32(-7))),
    ],
    ids=[
        "q4_k-mlx-sub-block-bug",
        "q4_k-nibble-order",
        "q5_k-fifth-bit",
        "q5_k-sub-block",
        "q4_0-bias",
    ],
)
def test_the_check_catches_a_wrong_repack(t, mutate):
    rng = np.random.default_rng(7)
    rows, cols = 8, 256 if t != 2 else 64
    blocks = make_blocks(rng, t, rows * cols // quants.TYPES[t].block_size)
    r = quants.repack(blocks, t, (rows, cols))
    check_repack(r, blocks, t, rows)
    with pytest.raises(AssertionError, match="differ"):
        check_repack(mutate(r, blocks), blocks, t, rows)


@pytest.mark.parametrize(
    ("t", "spoil"),
    [
        (2, lambda b: b[3, 0:2].view("<u2").__setitem__(0, 0x7C00)),  # Q4_0, d = inf
        (6, lambda b: b[0, 0:2].view("<u2").__setitem__(0, 0xFE00)),  # Q5_0, d = NaN
        (8, lambda b: b[5, 0:2].view("<u2").__setitem__(0, 0xFC00)),  # Q8_0, d = -inf
        (41, lambda b: b[1, 0:2].view("<u2").__setitem__(0, 0x7C00)),  # Q1_0, d = inf
        (35, lambda b: b[0, 64:66].view("<u2").__setitem__(0, 0x7C00)),  # TQ2_0
        (39, lambda b: b[2].__setitem__(0, 0xFF)),  # MXFP4, exponent 255
        (40, lambda b: b[1].__setitem__(2, 0xFF)),  # NVFP4, scale byte 0xFF
        (16, lambda b: b[2, 0:2].view("<u2").__setitem__(0, 0x7C00)),  # IQ2_XXS, d = inf
        (18, lambda b: b[1, 0:2].view("<u2").__setitem__(0, 0xFE00)),  # IQ3_XXS, d = NaN
        (21, lambda b: b[0, 0:2].view("<u2").__setitem__(0, 0xFC00)),  # IQ3_S, d = -inf
        (19, lambda b: b[3, 0:2].view("<u2").__setitem__(0, 0x7C00)),  # IQ1_S, d = inf
    ],
    ids=[
        "q4_0-inf", "q5_0-nan", "q8_0-inf", "q1_0-inf", "tq2_0-inf", "mxfp4-e255", "nvfp4-0xff",
        "iq2_xxs-inf", "iq3_xxs-nan", "iq3_s-inf", "iq1_s-inf",
    ],
)  # fmt: skip
def test_blocks_no_repack_can_express_are_dequantized(t, spoil):
    rng = np.random.default_rng(5)
    info = quants.TYPES[t]
    rows, cols = 4, max(256, info.block_size * 2)
    blocks = make_blocks(rng, t, rows * cols // info.block_size)
    spoil(blocks)
    with pytest.raises(NotExact):
        quants.repack(blocks, t, (rows, cols))
    out = quants.convert(blocks, t, (rows, cols))
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert_bits_equal(out, reference(blocks, t, rows))


DEQUANT_TYPES = sorted(
    t for t in quants.TYPES if t not in quants.NOT_STORED and quants.kind(t) != "plain"
)


@pytest.mark.parametrize("t", DEQUANT_TYPES, ids=lambda t: quants.TYPES[t].name)
def test_dequantize_equals_gguf_for_any_blocks(t):
    """Every quantized type, fully random blocks (infinite and NaN scales too)."""
    rng = np.random.default_rng(200 + t)
    info = quants.TYPES[t]
    rows, cols = 12, info.block_size * 4
    blocks = make_blocks(rng, t, rows * cols // info.block_size, finite=False)
    out = quants.dequantize(blocks.reshape(-1), t, (rows, cols))
    assert out.shape == (rows, cols)
    assert_bits_equal(out, reference(blocks, t, rows))
    converted = quants.convert(blocks, t, (rows, cols))
    values = mlx_values(converted) if isinstance(converted, Repacked) else converted
    assert_bits_equal(values, reference(blocks, t, rows), zero_sign=t not in SIGNED_ZERO_DIFFERS)


@pytest.mark.parametrize("t", REPACK_TYPES, ids=lambda t: quants.TYPES[t].name)
def test_quantized_matmul_reads_the_same_layout(t):
    rng = np.random.default_rng(300 + t)
    info = quants.TYPES[t]
    rows, cols = 48, 512
    blocks = make_blocks(rng, t, rows * cols // info.block_size)
    for at in F16_FIELDS.get(t, []):  # magnitudes around one, so the sums are well scaled
        h = blocks[:, at : at + 2].view("<u2")
        h[:] = (h & 0x83FF) | 0x3800
    if t == 39:
        blocks[:, 0] = rng.integers(120, 130, size=len(blocks))
    if t == 40:
        blocks[:, 0:4] = rng.integers(0x30, 0x40, size=(len(blocks), 4))
    r = quants.repack(blocks, t, (rows, cols))
    weight, scales, biases = quants.mlx_repacked(r)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    y = mx.quantized_matmul(
        mx.array(x), weight, scales, biases, transpose=True, group_size=r.group_size,
        bits=r.bits, mode=r.mode,
    )  # fmt: skip
    expected = x.astype(np.float64) @ quants.dequantize(blocks, t, (rows, cols)).T
    np.testing.assert_allclose(np.array(y), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("t", [12, 39, 8], ids=["Q4_K", "MXFP4", "Q8_0"])
def test_expert_stacks_keep_their_leading_axes(t):
    rng = np.random.default_rng(9)
    info = quants.TYPES[t]
    shape = (3, 5, 256)
    blocks = make_blocks(rng, t, 3 * 5 * 256 // info.block_size)
    r = quants.repack(blocks, t, shape)
    assert r.weight.shape == (3, 5, 256 * r.bits // 32)
    assert r.scales.shape == (3, 5, 256 // r.group_size)
    expected = reference(blocks, t, 15).reshape(shape)
    assert_bits_equal(mlx_values(r), expected, zero_sign=t not in SIGNED_ZERO_DIFFERS)


def test_plain_types_and_bf16_kept_exactly():
    rng = np.random.default_rng(4)
    values = np.concatenate(
        [rng.standard_normal(60).astype(np.float32), [1e38, -3e-38, 1e-40, np.inf]]
    ).astype(np.float32)
    bf16 = gguf.quants.quantize(values, QT.BF16)  # bits, round to nearest even as ggml does
    raw = bf16.view(np.uint8)
    assert quants.kind(30) == "plain"
    bits = quants.plain(raw, 30, (64,))
    assert bits.dtype == np.uint16 and np.array_equal(bits, bf16.view(np.uint16))
    arr = quants.mlx_plain(bits, 30)
    assert arr.dtype == mx.bfloat16
    as_float = np.array(arr.astype(mx.float32))
    expected = gguf.quants.dequantize(bf16.view(np.uint8).reshape(1, -1), QT.BF16).reshape(-1)
    assert_bits_equal(as_float, expected)
    assert_bits_equal(quants.dequantize(raw, 30, (64,)), expected)
    assert as_float[-2] != 0 and as_float[-3] < -1e-38  # beyond float16's range, kept
    for t, dtype in [(0, np.float32), (1, np.float16), (26, np.int32), (28, np.float64)]:
        data = rng.standard_normal((2, 8)).astype(dtype)
        got = quants.plain(data.view(np.uint8), t, (2, 8))
        assert got.dtype == dtype and np.array_equal(got, data)
        assert quants.mlx_plain(got, t).shape == (2, 8)


def _speed(fn: Any, weights: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return weights / best / 1e6


def test_whole_tensors_go_fast():
    """1024x3072: ~650 M weights/s for the Q4_K repack and ~450 for Q6_K's dequantization on
    a 2-core VM; the bound only catches a per-block Python loop."""
    rng = np.random.default_rng(13)
    shape = (1024, 3072)
    q4k = make_blocks(rng, 12, 1024 * 3072 // 256)
    q6k = make_blocks(rng, 14, 1024 * 3072 // 256)
    repack = _speed(lambda: quants.repack(q4k, 12, shape), 1024 * 3072)
    dequant = _speed(lambda: quants.dequantize(q6k, 14, shape), 1024 * 3072)
    print(f"Q4_K repack {repack:.0f} M weights/s, Q6_K dequantize {dequant:.0f} M weights/s")
    assert repack > 40 and dequant > 40


def test_wrong_sizes_and_types_are_refused():
    with pytest.raises(ValueError, match="needs 144 bytes, got 143"):
        quants.repack(np.zeros(143, np.uint8), 12, (1, 256))
    with pytest.raises(ValueError, match="Q6_K has no exact MLX repack"):
        quants.repack(np.zeros(210, np.uint8), 14, (1, 256))
    with pytest.raises(ValueError, match="Q4_0 is not a plain type"):
        quants.plain(np.zeros(18, np.uint8), 2, (1, 32))
    with pytest.raises(ModelLoadError, match="activations"):
        quants.convert(np.zeros(292, np.uint8), 15, (1, 256))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_mlx_affine_codes_are_one_little_endian_bit_stream_per_row(bits, group_size):
    """What `_pack_bits` assumes of MLX: code i of a row at bits [i*b, (i+1)*b) of the row's
    uint32 words, for every width (3-, 5- and 6-bit codes straddle words)."""
    rng = np.random.default_rng(bits * group_size)
    codes = rng.integers(0, 2**bits, size=(3, 256), dtype=np.uint8)
    weight = quants._pack_bits(codes, bits).view(np.uint32)
    assert np.array_equal(quants._unpack_bits(weight.view(np.uint8), bits), codes)
    ones = mx.ones((3, 256 // group_size), dtype=mx.float32)
    out = mx.dequantize(
        mx.array(weight), ones, mx.zeros_like(ones), group_size=group_size, bits=bits
    )
    assert np.array_equal(np.array(out), codes.astype(np.float32))
