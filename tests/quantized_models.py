"""Tiny models quantized as mlx_lm.convert quantizes them, and MLX's affine quantization as the
native library reads it, with the sums its tiles define (tests/test_native_step.py,
tests/test_native_abi.py)."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from runner.native import abi
from tests.tiny import tiny_config, write_tiny_model

# The tiny configs' dimensions, widened to whole groups of 128 (hidden size, the query rows
# the output projection reads, the MLP's width).
QUANTIZED_DIMS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def write_quantized_model(
    arch: str,
    path: Path,
    bits: int,
    group: int,
    dtype: str = "float32",
    mode: str = "affine",
    recipe: str | None = None,
    **kwargs: Any,
) -> Path:
    """A tiny model (`write_tiny_model` with QUANTIZED_DIMS, and `kwargs`) quantized as
    `mlx_lm.convert(..., quantize=True, q_bits=bits, q_group_size=group, dtype=dtype)`
    quantizes it: its weights cast to `dtype` (so scales and biases come out in it), every
    linear layer and the embedding quantized (affine) by mlx-lm's `quantize_model`, and
    written as mlx-lm writes a converted model; returns `path`. `mode`: mlx-lm's `q_mode`
    (affine, or e.g. mxfp4 with 4 bits in groups of 32); `recipe`: mlx-lm's `quant_predicate`
    (a mixed recipe, e.g. mixed_3_6: 3 bits, 6 for the head and some layers' v and down
    projections; `bits` then unused)."""
    from mlx.utils import tree_map
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    config = kwargs.pop("config", None) or tiny_config(arch) | QUANTIZED_DIMS
    source = write_tiny_model(arch, path.with_name(path.name + "-float"), config=config, **kwargs)
    module, config = load_model(source)
    target = getattr(mx, dtype)
    module.update(
        tree_map(
            lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a,
            module.parameters(),
        )
    )
    predicate = mixed_quant_predicate_builder(recipe, module, group) if recipe else None
    module, config = quantize_model(
        module, config, group, bits, mode=mode, quant_predicate=predicate
    )
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, module)
    save_config(config, path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


def load_quantized_model(
    arch: str,
    path: Path,
    bits: int,
    group: int,
    dtype: str = "float32",
    *,
    backend: Any = None,
    mode: str = "affine",
    recipe: str | None = None,
) -> Any:
    """`write_quantized_model`, loaded by the runner (`backend`, default the device's)."""
    from runner.models import build_model
    from runner.sources.loader import load_local_dir

    written = write_quantized_model(arch, path, bits, group, dtype, mode, recipe)
    return build_model(load_local_dir(written), backend)


SCALE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@contextlib.contextmanager
def amx_turned_off(functions: abi.Functions) -> Iterator[None]:
    """Products without AMX's tiles (runner_amx_products) inside the block: a forward's rows
    of Q4_K, Q5_K and 2- to 5-bit affine codes take them where the build has them and the
    machine runs them (runner/native/amx.c), with their own bits."""
    was = functions.amx_products(-1)
    functions.amx_products(0)
    try:
        yield
    finally:
        functions.amx_products(was)


# The lanes of the affine tiles' vectors on each instruction-set path (runner/native/quantized.c)
# and whether their sums are fused multiply-adds (no FMA on the SSE and AVX-only paths).
AFFINE_LANES = {"avx512": (16, True), "avx2": (8, True), "avx": (8, False), "sse": (4, False)}


class Affine:
    """w [n, k] quantized by mx.quantize (affine, `bits`, `group`; scales and biases cast to
    `scales`): MLX's arrays, the struct step_weight over them, and the values the library
    multiplies with: mx.dequantize's from float32 scales and biases (what MLX's
    quantized_matmul multiplies a float32 input with)."""

    def __init__(self, w: np.ndarray, bits: int, group: int, scales: str = "float32"):
        q, s, b = mx.quantize(mx.array(w), group, bits)
        s, b = s.astype(SCALE_DTYPES[scales]), b.astype(SCALE_DTYPES[scales])
        mx.eval(q, s, b)
        self.values = np.array(
            mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group, bits)
        )
        # each weight's bias, and its scale times its code (the values less the biases)
        self.biases = np.repeat(np.array(b.astype(mx.float32)), group, axis=-1)
        self.scaled_codes = self.values - self.biases
        self.arrays = [
            np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x) for x in (q, s, b)
        ]
        self.bits, self.shape = bits, w.shape
        self.weight = abi.Weight(
            format=abi.AFFINE, bits=bits, group=group, scale_format=abi.SCALE_FORMATS[scales],
            data=self.arrays[0].ctypes.data, scales=self.arrays[1].ctypes.data,
            biases=self.arrays[2].ctypes.data,
        )  # fmt: skip

    def times(self, functions: abi.Functions, a: np.ndarray, decode: bool = False) -> np.ndarray:
        """a W^T through runner_weight_product (`decode`: as a decode step's rows)."""
        return weight_times(functions, self.weight, self.shape, a, decode)


class Mxfp4:
    """w [n, k] quantized by mx.quantize in MLX's mxfp4 mode (4-bit e2m1 codes, a uint8 e8m0
    scale a group of 32, no biases), each row's scales then moved by `shift` (scales stay in
    [0, 253], so every value is finite, from subnormal to large): MLX's arrays, the struct
    step_weight over them (scale format E8M0) and mx.dequantize's values, exact in float32."""

    def __init__(self, w: np.ndarray, shift: np.ndarray | None = None):
        q, s = mx.quantize(mx.array(w), 32, 4, mode="mxfp4")
        scales = np.array(s).astype(np.int64)
        if shift is not None:
            scales = np.clip(scales + shift[:, None], 0, 253)
        s = mx.array(scales.astype(np.uint8))
        self.values = np.array(
            mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
        )
        self.arrays = [np.asarray(q), np.asarray(s)]
        self.shape = w.shape
        self.weight = abi.Weight(
            format=abi.AFFINE, bits=4, group=32, scale_format=abi.E8M0,
            data=self.arrays[0].ctypes.data, scales=self.arrays[1].ctypes.data, biases=None,
        )  # fmt: skip

    def times(self, functions: abi.Functions, a: np.ndarray, decode: bool = False) -> np.ndarray:
        """a W^T through runner_weight_product (`decode`: as a decode step's rows)."""
        return weight_times(functions, self.weight, self.shape, a, decode)


def weight_times(
    functions: abi.Functions,
    weight: abi.Weight,
    shape: tuple[int, ...],
    a: np.ndarray,
    decode: bool = False,
) -> np.ndarray:
    """a W^T through runner_weight_product, W [n, k] = `shape` as the struct step_weight
    `weight` holds it; `decode`: as a decode step's rows (GGML blocks and 5-bit codes by
    limbs where the library has them)."""
    c = np.full((a.shape[0], shape[0]), np.nan, np.float32)
    a = np.ascontiguousarray(a, dtype=np.float32)
    code = functions.weight_product(
        a.shape[0], shape[0], shape[1], a.ctypes.data_as(abi.F32), ctypes.byref(weight),
        c.ctypes.data_as(abi.F32), int(decode),
    )  # fmt: skip
    assert code == 0
    return c


def affine_in_order(a: np.ndarray, w: np.ndarray, bits: int, lanes: int, fused: bool) -> np.ndarray:
    """The sums the affine tiles define (runner/native/quantized.c): lane l of `lanes` takes,
    in order of k, the products at the positions the units put in it (4 bits: a unit of 2
    `lanes` positions, its even ones in the first vector, its odd ones in the second; else
    position t0 + l), each added by one fused multiply-add (`fused`; else the product
    rounded first), then the lanes summed by halving. Fused steps are emulated in float64,
    which holds a product of two float32s exactly (so each step rounds twice: the fused
    result except in ties past float32's precision, which random values do not meet)."""
    m, k = a.shape
    unit = 2 * lanes if bits == 4 else lanes
    acc = np.zeros((m, w.shape[0], lanes), np.float32)
    for t0 in range(0, k, unit):
        for v in range(unit // lanes):
            at = t0 + (2 * np.arange(lanes) + v if bits == 4 else np.arange(lanes))
            product = a[:, None, at].astype(np.float64) * w[None, :, at].astype(np.float64)
            if not fused:
                product = product.astype(np.float32)
            acc = (acc.astype(np.float64) + product).astype(np.float32)
    half = lanes // 2
    while half:
        acc[..., :half] = acc[..., :half] + acc[..., half : 2 * half]
        half //= 2
    return acc[..., 0]
