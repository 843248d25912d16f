"""Short forwards of Llama-shaped models in one native call (the CPU backend).

A decode step or a few-token forward on MLX's CPU backend pays ~5 us for each of its
~3,000 primitive operations (SmolLM2: 100 a layer) on top of reading the weights once;
llama.cpp runs the same step as a few hundred fused operations. `NativeStep` runs all the
decoder layers of such a forward in one call into the runner's compiled library
(runner/native/decoder_step.c; its ABI runner/native/runner_native.h, bound and checked by
runner/native/abi.py), with the library's product tiles and thread pool, and MLX does the
rest (embedding rows, the head).

It also runs rows batched over one shared prefix (runner/cache/batch.py): every row's
tokens attend to the prefix's cached keys and to their own, as the runner's batched
attention computes them.

Half-precision copies: a checkpoint stored in float16 or bfloat16 (most are) is computed in
float32 on the CPU, so its float32 weights hold values that two bytes hold exactly. The step
keeps copies of its products' weights and of the head in that format when every value
survives the narrowing bit for bit (`runner_narrow_panels` checks), and products of up to
128 rows (and a decode step's head, `unembed`) read them, widening to float32 in registers:
half the bytes, where a decode step is bound by streaming the weights. The copies are stored
as panels (16 rows of a weight interleaved) that the products read as sums of outer
products, with no horizontal sums: a 15-token forward of SmolLM2 0.85x the time of the dot
products on row-major copies, a decode step 0.75x (docs/DESIGN.md §4). They cost half again
the weights' memory, so they are not made when that would be more than half of the memory
available.

Quantized weights: an `nn.QuantizedLinear` in MLX's affine mode (2, 3, 4, 5, 6 or 8 bits, groups of
32, 64 or 128, scales and biases in float32, float16 or bfloat16: what mlx-lm's conversions
and the runner's GGUF repacks hold), or in its mxfp4 mode (e2m1 codes, an e8m0 scale a group
of 32: gpt-oss's experts, a GGUF's MXFP4, `--q-mode mxfp4` conversions), is read as MLX
stores it, the codes unpacked in registers by the library's tiles (runner/native/quantized.c):
no float copy is made, and the numbers are the float32 sums of MLX's dequantized values. A
quantized head (an `lm_head`, or a tied quantized embedding) is computed there too, for any
number of rows (MLX's CPU `quantized_matmul` is ~40x slower); a quantized embedding's rows are
dequantized here too where MLX's are float32 values (`_Matrix.values`), else gathered by MLX.

It serves Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Ministral3, Gemma2, Gemma3, Phi3 and
gpt-oss as mlx-lm builds them (mlx-lm's llama, qwen2, qwen3, qwen3_moe, ministral3, gemma2,
gemma3_text, phi3 and gpt_oss classes, as the families adapt them): RMSNorm, optional
q/k/v/o biases (Phi3's fused q/k/v and gate/up projections read as row ranges:
`_attention_products`, `_mlp_products`), per-head q/k norms, rotate-half rotary embeddings
from the runner's tables (runner/backend/rope.py; a table per rotary embedding the layers
use), SwiGLU or Gemma's GELU MLP, full or sliding-window attention, Gemma2's soft-capped
scores, Qwen3-MoE's sparse mixtures of experts (Kernels' `sparse_moe`: the router, its
softmax and top-k, and the chosen experts' SwiGLU products from their stacked arrays in
place, float32, MLX's affine or GGML blocks: `_experts`), gpt-oss's attention sinks and its
mixture (`oai_experts`: the router's bias, the softmax of the top k, the experts' biases and
clamped SwiGLU; MXFP4 experts, MLX's mxfp4 mode, read in place: `_gpt_oss_experts`), and
what a family's `NativeShape` adds around the layers (Gemma's norms of 1 + weight, four a
layer, and its scaled embeddings; Ministral3's queries scaled by position). `build` returns
None for anything else (a weight it cannot read: non-float32 floats, other quantizations
(nvfp4, mxfp8, global scales); another module shape), and a call
returns None where MLX's path must run: more tokens than the backend's limit, a cache that
is none of a plain `KVCache` (one row), an empty-suffixed `SharedPrefixKV` (rows over a
prefix) or a `RotatingKVCache` without a `keep`, or cache buffers it cannot read in place.

Sliding windows: a layer whose cache is a `RotatingKVCache` is windowed by the ring's size
(the runner's layer_caches makes every windowed layer's ring the window's size, and mlx-lm's
masks are that window): the step reads the positions its queries see out of the ring in
order of position (`_window_view`: one view, or two where the ring has wrapped, read in
place as two runs), and the new keys go in through the ring's own `update_and_fetch`, as
MLX's path appends them.

Invariants:
- One row's `KVCache`s are written in place, into buffers this step allocated for them
  (`NativeStep._grow`: the only buffers known to be the cache's alone; `restore` copies a
  prefix paged in from the trie into them, too); rows batched over a prefix, and rotating
  caches, append through MLX's `update_and_fetch` (copy-on-write). Either way a cache
  holds exactly what mlx-lm's attention would have appended, so snapshots, rewinds and
  the prefix trie see the same caches on both paths.
- Numbers: float32 throughout, the same operations as MLX's path in another summation
  order; tests/test_native_step.py compares the two, and every golden test of the
  families runs through it. Half copies change no weight: the step's results with and
  without them agree to float32 rounding (the panels sum each value in order of k, the same
  bits for any number of rows; tested).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import SwigluOAI
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU, SwitchLinear

from runner.backend.install import Kernels
from runner.backend.rope import TableRoPE
from runner.cache.shared_prefix import SharedPrefixKV
from runner.native import abi
from runner.sources.gguf import quants

log = logging.getLogger(__name__)

_P = abi.F32
# The head through its half copy for at most this many rows (a decode step is one; scoring
# takes candidates' rows, prefill only its last position's).
HEAD_ROWS = 40
# Positions in a block of rotary rows the step computes once and keeps (`_RopeRows`).
ROPE_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class _Owned:
    """Buffers this step allocated for one `KVCache` (see `NativeStep._grow`): valid while
    the cache still holds exactly these arrays. Weak references, so a buffer the cache has
    dropped (MLX's path replaced it, the cache was reset) is freed as usual."""

    keys: weakref.ref
    values: weakref.ref
    keys_at: int  # the buffers' addresses
    values_at: int
    capacity: int  # positions

    def holds(self, cache: KVCache) -> bool:
        return self.keys() is cache.keys and self.values() is cache.values


def available_memory() -> int | None:
    """Bytes of memory the system could still give this process (Linux's MemAvailable), or
    None where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Half copies are made only while they take at most this share of the available memory: they
# add half again the weights' size, which must not be what pushes a large model out of memory.
HALF_COPIES_MEMORY_SHARE = 0.5


def _half_copies(
    functions: abi.Functions, weights: list[np.ndarray], formats: tuple[str, ...]
) -> tuple[str, list[np.ndarray]] | None:
    """Copies of every float32 weight [n, k] in the first of `formats` that holds all of
    their values exactly, with its name; None when none does. A checkpoint stored in float16
    or bfloat16 (most are) and computed in float32 on the CPU passes; one stored in float32
    fails at its first inexact value. The copies are the dispatch's panels (16 rows of W
    interleaved, runner/native/panels.c), which its products read as sums of outer
    products."""
    for name in formats:
        copies = []
        for w in weights:
            n, k = w.shape
            copy = np.empty(functions.panel_halves(n, k), np.uint16)
            if not functions.narrow_panels(
                _pointer(w), n, k, copy.ctypes.data, abi.HALF_FORMATS[name]
            ):
                break
            copies.append(copy)
        else:
            return name, copies
    return None


def _pointer(view: np.ndarray) -> Any:
    return ctypes.cast(view.ctypes.data, _P)


class _RopeRows:
    """A model's rotary tables' rows for a forward's positions, [tables, tokens, dims], from
    blocks of ROPE_BLOCK positions computed once (`TableRoPE.numpy_table`: a position's row is
    the same whichever positions are computed with it), the last few kept. A decode step's
    rows made afresh each step, in numpy and through MLX arrays, took ~70 us of SmolLM2's
    ~7 ms token."""

    KEPT = 4

    def __init__(self, ropes: list[TableRoPE]):
        self._ropes = ropes
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the newest last

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        block = self._blocks.pop(b, None)
        if block is None:
            parts = [r.numpy_table(b * ROPE_BLOCK, ROPE_BLOCK) for r in self._ropes]
            block = np.stack([c for c, _ in parts]), np.stack([s for _, s in parts])
            if len(self._blocks) >= self.KEPT:
                del self._blocks[next(iter(self._blocks))]
        self._blocks[b] = block
        return block

    def rows(self, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(C, S) of positions offset .. offset + length - 1: contiguous, not to be written."""
        first, last = offset // ROPE_BLOCK, (offset + length - 1) // ROPE_BLOCK
        blocks = [self._block(b) for b in range(first, last + 1)]
        start = offset - first * ROPE_BLOCK
        if len(blocks) == 1:
            c, s = blocks[0]
        else:
            c = np.concatenate([b[0] for b in blocks], axis=1)
            s = np.concatenate([b[1] for b in blocks], axis=1)
        c, s = c[:, start : start + length], s[:, start : start + length]
        return np.ascontiguousarray(c), np.ascontiguousarray(s)  # views when one table


class _Unsupported(Exception):
    pass


def _view(array: Any, what: str) -> np.ndarray:
    """A float32 array as a read-only view of MLX's memory (evaluated first)."""
    if not isinstance(array, mx.array) or array.dtype != mx.float32:
        raise _Unsupported(f"{what}: not a float32 array")
    mx.eval(array)
    view = np.asarray(array)
    if not view.flags.c_contiguous:
        raise _Unsupported(f"{what}: not contiguous")
    return view


# runner/models/quantized.py's parameter for nvfp4's global scale (a layer with one stays on
# MLX's path; backend sits below models, so the name is repeated here)
GLOBAL_SCALE = "global_scale"
# runner/models/quantized.py's layers of GGML blocks: their parameter (repeated here for the
# same reason), and per `ggml_type` the library's format, the bytes a block and its weights
# (the loader's table of GGML types, runner/sources/gguf/quants.py)
GGML_BLOCKS = "blocks"
GGML_FORMATS = {
    name: (form, quants.BY_NAME[name].type_size, quants.BY_NAME[name].block_size)
    for name, form in abi.BLOCK_FORMATS.items()
}
# `_Matrix.values`' dequantizing: the GGML type id of each format
GGML_TYPE_IDS = {form: quants.BY_NAME[name].id for name, form in abi.BLOCK_FORMATS.items()}
# MLX's affine quantizations the library's products read (runner/native/quantized.c): bits,
# group sizes, and the dtypes of scales and biases (abi.SCALE_FORMATS).
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
# the values of MLX's mxfp4 codes (e2m1: sign, 2-bit exponent, 1-bit mantissa)
E2M1 = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
AFFINE_GROUPS = (32, 64, 128)
SCALE_DTYPES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """One product's weight [n, k] as the step reads it, never copied: float32 (`f32`), or
    MLX's affine quantization (`codes`, `scales`, `biases`: views of MLX's memory)."""

    n: int
    k: int
    f32: np.ndarray | None = None
    codes: np.ndarray | None = None
    scales: np.ndarray | None = None
    biases: np.ndarray | None = None
    bits: int = 0
    group: int = 0
    scale_format: int = 0
    block_format: int = 0  # `codes` are GGML blocks in this format (GGML_FORMATS): no scales,
    # biases

    def weight(self, half: np.ndarray | None = None, half_format: int = 0) -> abi.Weight:
        """The struct step_weight: the codes, or the float32 weights, or (`half`) their exact
        half copy with the float32 weights beside it for the BLAS."""
        if self.block_format:
            assert self.codes is not None
            return abi.Weight(format=self.block_format, data=self.codes.ctypes.data)
        if self.codes is not None:
            assert self.scales is not None
            assert (self.biases is None) == (self.scale_format == abi.E8M0)
            return abi.Weight(
                format=abi.AFFINE, bits=self.bits, group=self.group,
                scale_format=self.scale_format, data=self.codes.ctypes.data,
                scales=self.scales.ctypes.data,
                biases=None if self.biases is None else self.biases.ctypes.data,
            )  # fmt: skip
        assert self.f32 is not None
        if half is not None:
            return abi.Weight(format=half_format, data=half.ctypes.data, f32=_pointer(self.f32))
        return abi.Weight(format=abi.F32_FORMAT, data=self.f32.ctypes.data, f32=_pointer(self.f32))

    def values(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of the weight as float32 [len(ids), k], in order: the values MLX's
        dequantize gives from float32 scales and biases (the product rounded, then the
        sum), or llama.cpp's from GGML blocks, bit for bit. In numpy: one row through MLX's
        graph costs a decode step ~0.25 ms (SmolLM2's Q8_0 embedding), 3% of the token."""
        if self.block_format:
            assert self.codes is not None
            kind = GGML_TYPE_IDS[self.block_format]
            return quants.dequantize(self.codes[ids].reshape(-1), kind, (len(ids), self.k))
        if self.codes is None:
            assert self.f32 is not None
            return np.ascontiguousarray(self.f32[ids], dtype=np.float32)
        assert self.scales is not None
        raw = self.codes[ids].view(np.uint8)  # each row one little-endian bit stream
        if self.scale_format == abi.E8M0:  # e2m1 codes times 2^(e - 127), exact
            codes = np.stack([raw & 15, raw >> 4], axis=-1).reshape(len(ids), -1, 32)
            scale = np.ldexp(np.float32(1), self.scales[ids].astype(np.int32) - 127)
            return (E2M1[codes] * scale[..., None]).reshape(len(ids), self.k)
        assert self.biases is not None
        if self.bits == 8:
            codes = raw
        elif self.bits == 4:
            codes = np.stack([raw & 15, raw >> 4], axis=-1)
        else:
            bits = np.unpackbits(raw, axis=-1, bitorder="little").reshape(len(ids), self.k, -1)
            codes = bits @ (1 << np.arange(self.bits, dtype=np.uint16))
        q = codes.reshape(len(ids), self.k // self.group, self.group).astype(np.float32)
        scales, biases = (
            _float32(x[ids], self.scale_format)[..., None] for x in (self.scales, self.biases)
        )
        return (scales * q + biases).reshape(len(ids), self.k)


def _is_float32(dtype: Any) -> bool:
    return isinstance(dtype, mx.Dtype) and dtype == mx.float32


def _float32(x: np.ndarray, scale_format: int) -> np.ndarray:
    """Scales or biases stored in `scale_format` (bfloat16 as the uint16 of its bits), widened
    exactly to float32."""
    if scale_format == abi.SCALE_FORMATS["bfloat16"]:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def raw_view(array: Any, what: str) -> np.ndarray:
    """An evaluated, contiguous MLX array as numpy's view of its memory (bfloat16 as the
    uint16 that hold its bits: numpy has no bfloat16)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    mx.eval(array)
    view = np.asarray(array)
    if not view.flags.c_contiguous:
        raise _Unsupported(f"{what}: not contiguous")
    return view


def _affine(layer: nn.Module, what: str, stacked: bool = False) -> _Matrix:
    """A quantized linear or embedding layer's weight, when it is an affine quantization the
    products read (AFFINE_BITS, AFFINE_GROUPS, scales and biases in float32, float16 or
    bfloat16), or MLX's mxfp4 mode (4-bit e2m1 codes, an e8m0 scale byte a group of 32, no
    biases: gpt-oss's experts, mlx-lm's `--q-mode mxfp4` conversions); nvfp4, other bits,
    global scales stay on MLX's path. `stacked`: a quantized switch layer's experts
    [E, n, .], whose views keep that leading axis."""
    mode, bits, group = getattr(layer, "mode", "affine"), int(layer.bits), int(layer.group_size)
    if mode == "mxfp4":
        return _mxfp4(layer, what, stacked)
    if mode != "affine" or bits not in AFFINE_BITS or group not in AFFINE_GROUPS:
        raise _Unsupported(f"{what}: {mode} quantization, {bits} bits, group {group}")
    if GLOBAL_SCALE in layer or "biases" not in layer:
        raise _Unsupported(f"{what}: a global scale, or no biases")
    codes, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    if codes.dtype != mx.uint32 or scales.dtype not in SCALE_DTYPES or biases.dtype != scales.dtype:
        raise _Unsupported(f"{what}: codes {codes.dtype}, scales {scales.dtype}")
    lead = tuple(codes.shape[:1]) if stacked else ()
    n, k = int(codes.shape[-2]), int(codes.shape[-1]) * 32 // bits
    if (
        codes.ndim != 2 + len(lead)
        or tuple(scales.shape) != (*lead, n, k // group)
        or biases.shape != scales.shape
    ):
        raise _Unsupported(f"{what}: shapes {codes.shape}, {scales.shape}")
    return _Matrix(
        n, k, codes=raw_view(codes, what), scales=raw_view(scales, what),
        biases=raw_view(biases, what), bits=bits, group=group,
        scale_format=abi.SCALE_FORMATS[SCALE_DTYPES[scales.dtype]],
    )  # fmt: skip


def _mxfp4(layer: nn.Module, what: str, stacked: bool) -> _Matrix:
    """A weight [n, .] (or `stacked` experts [E, n, .]) in MLX's mxfp4 mode (`_affine`)."""
    codes, scales = layer["weight"], layer["scales"]
    if GLOBAL_SCALE in layer or "biases" in layer or int(layer.bits) != 4:
        raise _Unsupported(f"{what}: mxfp4 with a global scale, biases, or not 4 bits")
    if int(layer.group_size) != 32 or codes.dtype != mx.uint32 or scales.dtype != mx.uint8:
        raise _Unsupported(f"{what}: mxfp4 group {layer.group_size}, scales {scales.dtype}")
    n, k = int(codes.shape[-2]), int(codes.shape[-1]) * 8
    lead = tuple(codes.shape[:1]) if stacked else ()
    if codes.ndim != 2 + len(lead) or tuple(scales.shape) != (*lead, n, k // 32):
        raise _Unsupported(f"{what}: shapes {codes.shape}, {scales.shape}")
    return _Matrix(
        n, k, codes=raw_view(codes, what), scales=raw_view(scales, what), bits=4, group=32,
        scale_format=abi.E8M0,
    )  # fmt: skip


def _ggml(layer: Any, what: str, stacked: bool = False) -> _Matrix | None:
    """A layer holding GGML blocks of a type the products read (GGML_FORMATS), [n, k / weights
    a block * bytes a block] (runner/models/quantized.py); None for any other layer.
    `stacked`: a switch layer's experts [E, n, .], whose view keeps that leading axis."""
    ggml_type = getattr(layer, "ggml_type", None) if isinstance(layer, nn.Module) else None
    if ggml_type is None:
        return None
    if ggml_type not in GGML_FORMATS:
        raise _Unsupported(f"{what}: GGML {ggml_type} blocks")
    form, size, weights = GGML_FORMATS[ggml_type]
    blocks = layer[GGML_BLOCKS]
    if blocks.dtype != mx.uint8 or blocks.ndim != 2 + stacked or blocks.shape[-1] % size:
        raise _Unsupported(f"{what}: {ggml_type} blocks {blocks.dtype} {blocks.shape}")
    n, k = int(blocks.shape[-2]), int(blocks.shape[-1]) // size * weights
    return _Matrix(n, k, codes=raw_view(blocks, what), block_format=form)


def _linear(parent: nn.Module, name: str) -> tuple[_Matrix, np.ndarray | None]:
    layer = getattr(parent, name, None)
    if not isinstance(layer, nn.Module):
        raise _Unsupported(f"{name}: {type(layer).__name__}")
    # float32, MLX's affine quantization or GGML blocks; gemv, global scales or another
    # subclass: MLX's
    blocks = _ggml(layer, name)
    if blocks is not None:
        matrix = blocks
    elif type(layer) is nn.Linear:
        weight = _view(layer.weight, f"{name}.weight")
        matrix = _Matrix(int(weight.shape[0]), int(weight.shape[1]), f32=weight)
    elif type(layer) is nn.QuantizedLinear:
        matrix = _affine(layer, name)
    else:
        raise _Unsupported(f"{name}: {type(layer).__name__}")
    bias = _view(layer.bias, f"{name}.bias") if "bias" in layer else None
    return matrix, bias


@dataclasses.dataclass(frozen=True)
class _Stack:
    """A switch layer's stacked experts [count, n, k] as the step reads them: expert 0's
    weight (views of the stack's memory), the bytes from one expert's arrays to the next's
    (its data; its scales and biases), and the experts' biases [count, n] (float32), if any."""

    first: _Matrix
    count: int
    strides: tuple[int, int]
    arrays: tuple[np.ndarray, ...]  # the whole stack's views (their lifetimes)
    bias: np.ndarray | None = None


def _switch(parent: nn.Module, name: str, biased: bool = False) -> _Stack:
    """A mixture of experts' switch layer: float32 (`SwitchLinear`), MLX's affine or mxfp4
    experts (`QuantizedSwitchLinear`, read as `_affine` reads a matrix) or GGML blocks
    (runner/models/quantized.py's GGMLSwitchLinear); with biases only where `biased`."""
    layer = getattr(parent, name, None)
    if not isinstance(layer, nn.Module) or ("bias" in layer and not biased):
        raise _Unsupported(f"{name}: {type(layer).__name__}, or experts with biases")
    bias = _view(layer["bias"], f"{name}.bias") if "bias" in layer else None
    stack = _ggml(layer, name, stacked=True)
    if stack is None and isinstance(layer, QuantizedSwitchLinear):
        stack = _affine(layer, name, stacked=True)
    if stack is not None:  # codes [E, n, .], and scales and biases [E, n, .] where affine
        assert stack.codes is not None
        arrays = tuple(a for a in (stack.codes, stack.scales, stack.biases) if a is not None)
        first = dataclasses.replace(
            stack, **{f: getattr(stack, f)[0] for f in ("codes", "scales", "biases")
                      if getattr(stack, f) is not None},
        )  # fmt: skip
        strides = (arrays[0].strides[0], arrays[1].strides[0] if len(arrays) > 1 else 0)
        return _Stack(first, int(arrays[0].shape[0]), strides, arrays, bias)
    if isinstance(layer, SwitchLinear) and layer.weight.ndim == 3:
        view = _view(layer.weight, f"{name}.weight")
        first = _Matrix(int(view.shape[1]), int(view.shape[2]), f32=view[0])
        return _Stack(first, int(view.shape[0]), (view.strides[0], 0), (view,), bias)
    raise _Unsupported(f"{name}: {type(layer).__name__}")


def _experts(moe: nn.Module, hidden: int) -> tuple[abi.Experts, list[Any]]:
    """The struct step_experts of a sparse MoE block shaped as mlx-lm's
    Qwen3MoeSparseMoeBlock (Kernels' `sparse_moe`), and the arrays it points into."""
    switch = getattr(moe, "switch_mlp", None)
    if not isinstance(switch, SwitchGLU) or type(switch.activation) is not SwiGLU:
        raise _Unsupported("experts that are not a SwiGLU switch layer")
    router, bias = _linear(moe, "gate")
    if bias is not None:
        raise _Unsupported("a router with a bias")
    norm_topk = int(bool(moe.norm_topk_prob))
    return _stacked_experts(
        switch, router, None, int(moe.num_experts), int(moe.top_k), norm_topk, hidden
    )


def oai_experts(moe: nn.Module) -> tuple[float, float] | None:
    """(alpha, limit) of a mixture of experts shaped as mlx-lm's gpt_oss MLPBlock (a `router`
    with its bias, top-k then softmax, `experts` a SwitchGLU of clamped SwiGLU with biases);
    None for any other module."""
    switch = getattr(moe, "experts", None)
    if not (isinstance(moe, nn.Module) and "router" in moe and isinstance(switch, SwitchGLU)):
        return None
    activation = switch.activation
    if type(activation) is not SwigluOAI or getattr(moe, "sharding_group", None) is not None:
        return None
    return float(activation._alpha), float(activation._limit)


def _gpt_oss_experts(moe: nn.Module, hidden: int) -> tuple[abi.Experts, list[Any]]:
    """The struct step_experts of a gpt-oss MLPBlock (`oai_experts`): the softmax of the top
    k logits is the softmax's top k renormalised (norm_topk)."""
    router, bias = _linear(moe, "router")
    count, top_k = int(moe.num_local_experts), int(moe.num_experts_per_tok)
    return _stacked_experts(moe.experts, router, bias, count, top_k, 1, hidden, biased=True)


def _stacked_experts(
    switch: nn.Module,
    router: _Matrix,
    router_bias: np.ndarray | None,
    count: int,
    top_k: int,
    norm_topk: int,
    hidden: int,
    biased: bool = False,
) -> tuple[abi.Experts, list[Any]]:
    stacks = {proj: _switch(switch, f"{proj}_proj", biased) for proj in ("gate", "up", "down")}
    inner = stacks["gate"].first.n
    shapes = {proj: (st.count, st.first.n, st.first.k) for proj, st in stacks.items()}
    if (router.n, router.k) != (count, hidden) or shapes != {
        "gate": (count, inner, hidden),
        "up": (count, inner, hidden),
        "down": (count, hidden, inner),
    }:
        raise _Unsupported(f"experts of shapes {shapes}, a router {(router.n, router.k)}")
    if stacks["gate"].strides != stacks["up"].strides or not 0 < top_k <= count:
        raise _Unsupported("gate and up experts stored differently, or top_k")
    widths = {"gate": inner, "up": inner, "down": hidden}
    biases = {p: st.bias for p, st in stacks.items()}
    for proj, b in biases.items():
        if b is not None and b.shape != (count, widths[proj]):
            raise _Unsupported(f"{proj} biases of shape {b.shape}")
    if router_bias is not None and router_bias.shape != (count,):
        raise _Unsupported(f"a router bias of shape {router_bias.shape}")
    experts = abi.Experts(
        count=count, top_k=top_k, norm_topk=norm_topk, intermediate=inner,
        router=router.weight(), gate=stacks["gate"].first.weight(),
        up=stacks["up"].first.weight(), down=stacks["down"].first.weight(),
    )  # fmt: skip
    experts.gate_up_stride[:] = stacks["gate"].strides
    experts.down_stride[:] = stacks["down"].strides
    keep: list[Any] = [router, *(a for st in stacks.values() for a in st.arrays)]
    keep += [st.first for st in stacks.values()]
    for name, b in (("router_bias", router_bias), *((f"{p}_bias", b) for p, b in biases.items())):
        if b is not None:
            setattr(experts, name, _pointer(b))
            keep.append(b)
    return experts, keep


def _attention_shape(attn: nn.Module) -> tuple[int, int, float]:
    """(heads, KV heads, scale) of an attention: mlx-lm's Llama-shaped attributes, or
    gpt-oss's AttentionBlock's."""
    if hasattr(attn, "sm_scale"):
        return int(attn.num_attention_heads), int(attn.num_key_value_heads), float(attn.sm_scale)
    return int(attn.n_heads), int(attn.n_kv_heads), float(attn.scale)


def _rows(matrix: _Matrix, start: int, stop: int) -> _Matrix:
    """Rows [start, stop) of a weight: views of the same memory (a fused projection's
    parts), contiguous as the rows of a row-major weight are."""

    def part(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[start:stop]

    return dataclasses.replace(
        matrix, n=stop - start, f32=part(matrix.f32), codes=part(matrix.codes),
        scales=part(matrix.scales), biases=part(matrix.biases),
    )  # fmt: skip


def _attention_products(
    attn: nn.Module, heads: int, kv_heads: int
) -> tuple[dict[str, _Matrix], dict[str, np.ndarray | None]]:
    """The q, k, v, o weights of an attention and their biases: its own projections, or the
    row ranges of a fused `qkv_proj` (Phi3: q's rows, then k's, then v's)."""
    products: dict[str, _Matrix] = {}
    biases: dict[str, np.ndarray | None] = {}
    if "qkv_proj" in attn:
        fused, bias = _linear(attn, "qkv_proj")
        if bias is not None:
            raise _Unsupported("a fused projection's bias")
        if fused.n % (heads + 2 * kv_heads):
            raise _Unsupported(f"qkv_proj of {fused.n} rows")
        head_dim = fused.n // (heads + 2 * kv_heads)
        q, kv = heads * head_dim, kv_heads * head_dim
        products |= {"q": _rows(fused, 0, q), "k": _rows(fused, q, q + kv)}
        products["v"] = _rows(fused, q + kv, q + 2 * kv)
        biases |= dict.fromkeys(("q", "k", "v"))
    else:
        for proj in ("q", "k", "v"):
            products[proj], biases[proj] = _linear(attn, f"{proj}_proj")
    products["o"], biases["o"] = _linear(attn, "o_proj")
    return products, biases


def _mlp_products(mlp: nn.Module) -> dict[str, _Matrix]:
    """The gate, up and down weights of a gated MLP (no biases): its own projections, or
    the halves of a fused `gate_up_proj` (Phi3: the gate's rows, then up's)."""
    products: dict[str, _Matrix] = {}
    if "gate_up_proj" in mlp:
        fused, bias = _linear(mlp, "gate_up_proj")
        if bias is not None or fused.n % 2:
            raise _Unsupported("gate_up_proj")
        half = fused.n // 2
        products |= {"gate": _rows(fused, 0, half), "up": _rows(fused, half, fused.n)}
        names: tuple[str, ...] = ("down",)
    else:
        names = ("gate", "up", "down")
    for proj in names:
        products[proj], bias = _linear(mlp, f"{proj}_proj")
        if bias is not None:
            raise _Unsupported("MLP biases")
    return products


def _norm(
    parent: nn.Module, name: str, plus_one: tuple[type, ...] = ()
) -> tuple[np.ndarray, float]:
    """An RMSNorm's weights as the step multiplies by them, and its eps: `nn.RMSNorm`'s own,
    or for the classes of `plus_one` (Gemma's, `rms_norm(x, 1 + weight)`) 1 + weight as MLX
    computes it (a float32 array of the step's own)."""
    layer = getattr(parent, name, None)
    if type(layer) is nn.RMSNorm:
        return _view(layer.weight, f"{name}.weight"), float(layer.eps)
    if layer is not None and type(layer) in plus_one:
        weight = layer.weight
        if not isinstance(weight, mx.array) or weight.dtype != mx.float32:
            raise _Unsupported(f"{name}.weight: not a float32 array")
        return _view(1.0 + weight, f"{name}.weight"), float(layer.eps)
    raise _Unsupported(f"{name}: {type(layer).__name__}")


@dataclasses.dataclass(frozen=True)
class NativeShape:
    """What a family's model does around its layers that its mlx-lm classes do not say, for
    the step to do the same (runner/models/decoder.py's `DecoderModel.native_shape`)."""

    # RMSNorm classes that scale by 1 + weight (Gemma's), beside nn.RMSNorm
    plus_one_norms: tuple[type, ...] = ()
    # the embeddings multiplied by this float32 number before the layers (Gemma's
    # sqrt(hidden)), or None
    embedding_scale: float | None = None
    # (offset, tokens) -> each token's float32 scale of its queries after their rotation
    # (Ministral3's by position), or None where every one is 1
    query_scale: Callable[[int, int], np.ndarray | None] | None = None


class NativeStep:
    """Runs a Llama-shaped module's decoder layers for a few tokens in one native call."""

    def __init__(
        self,
        module: nn.Module,
        kernels: Kernels,
        max_tokens: int,
        functions: abi.Functions,
        half_formats: tuple[str, ...] = (),
        shape: NativeShape | None = None,
    ):
        """`kernels`: the family's declared mlx-lm classes (runner/backend/install.py); every
        layer's attention and gated MLP (SwiGLU, or Gemma's GELU one) must be of them.
        `half_formats`: the formats tried for exact half-precision copies of the weights
        (`_half_copies`); none: float32 only. `shape`: what the family's model does around
        the layers that the module's classes do not say (NativeShape)."""
        shape = shape or NativeShape()
        plus_one = shape.plus_one_norms
        self._step, self._scratch = functions.step, functions.scratch
        self._weight_product = functions.weight_product
        self._limb_products = functions.limb_products
        self._affine_limbs = functions.affine_limbs
        self.max_tokens = max_tokens
        inner = module.model
        embed = inner.embed_tokens
        # A float32 embedding's rows are gathered here, a quantized one's dequantized here
        # where they are float32 values (`_Matrix.values`), else by MLX (its module, as MLX's
        # path calls it); either also serves as a tied head.
        self._embed_module: nn.Module | None = None
        self._embed_rows: _Matrix | None = None
        embed_matrix: _Matrix | None = None
        if type(embed) is nn.Embedding:
            table_view = _view(embed.weight, "embed_tokens.weight")
            rows, width = table_view.shape
            embed_matrix = _Matrix(int(rows), int(width), f32=table_view)
        elif isinstance(embed, nn.QuantizedEmbedding) and GLOBAL_SCALE not in embed:
            self._embed_module = embed
            with contextlib.suppress(_Unsupported):  # the head may still be MLX's
                embed_matrix = _affine(embed, "embed_tokens")
        elif getattr(embed, "ggml_type", None) is not None:
            self._embed_module = embed
            embed_matrix = _ggml(embed, "embed_tokens")
        else:
            raise _Unsupported(f"the embedding is a {type(embed).__name__}")
        if embed_matrix is not None and (
            embed_matrix.codes is None  # float32
            or embed_matrix.block_format
            or _is_float32(getattr(embed, "dtype", None))
        ):  # rows MLX makes float32 (GGML blocks'; affine ones asked for in float32)
            self._embed_rows = embed_matrix
        table = GGML_BLOCKS if embed_matrix is not None and embed_matrix.block_format else "weight"
        self.vocab = int(embed[table].shape[0])
        self._final_norm, eps = _norm(inner, "norm", plus_one)
        self._embed_scale = shape.embedding_scale
        self._query_scale = shape.query_scale
        layers = list(inner.layers)
        self._keep: list[Any] = [self._final_norm]  # the views' lifetimes
        structs = (abi.Layer * len(layers))()
        layer_products: list[dict[str, _Matrix]] = []  # each layer's weights by abi.PRODUCTS
        first = layers[0].self_attn
        self.heads, self.kv_heads, self.scale = _attention_shape(first)
        if not self.scale > 0:  # the attention takes maxima of unscaled scores
            raise _Unsupported(f"attention scale {self.scale}")
        rope = first.rope
        if not isinstance(rope, TableRoPE):
            raise _Unsupported("rotary embedding without a table")
        # the layers' rotary embeddings, one table each a forward (Gemma3: local and global)
        self._ropes: list[TableRoPE] = []
        cap = getattr(first, "softcap", None)  # Gemma2's attention soft-cap, or none
        self.softcap = float(cap) if cap else 0.0
        self.activation = ""
        self.act_params = (0.0, 0.0)  # gpt-oss's clamped SwiGLU: (alpha, limit)
        q_weight = _attention_products(first, self.heads, self.kv_heads)[0]["q"]
        self.head_dim = q_weight.n // self.heads
        self.hidden = q_weight.k
        # per layer: its struct step_experts (a sparse MoE block), or None (a gated MLP)
        self._experts: list[abi.Experts | None] = []
        checked: list[_Matrix] = []  # the experts' weights, for the check below
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            oai = oai_experts(mlp)
            sparse = isinstance(mlp, kernels.sparse_moe)
            activation = (
                "swiglu_oai"
                if oai is not None
                else "silu"
                if sparse or isinstance(mlp, kernels.swiglu)
                else "gelu_tanh"
                if isinstance(mlp, kernels.gelu_glu)
                else None
            )
            if not isinstance(attn, kernels.attention) or activation is None:
                raise _Unsupported("a layer of other classes than the family declares")
            if self.activation not in ("", activation) or (
                oai is not None and i and oai != self.act_params
            ):
                raise _Unsupported("layers of different activations")
            self.activation = activation
            self.act_params = oai or self.act_params
            sinks = _view(attn.sinks, "sinks") if "sinks" in attn else None  # gpt-oss's
            if sinks is not None and sinks.shape != (self.heads,):
                raise _Unsupported(f"sinks of shape {sinks.shape}")
            if not (isinstance(attn.rope, TableRoPE) and attn.rope.dims == rope.dims):
                raise _Unsupported("layers rotate differently")
            cap = getattr(attn, "softcap", None)
            if (float(cap) if cap else 0.0) != self.softcap:
                raise _Unsupported("layers soft-cap differently")
            keys = [r.key for r in self._ropes]
            if attn.rope.key not in keys:
                self._ropes.append(attn.rope)
                keys.append(attn.rope.key)
            structs[i].rope_table = keys.index(attn.rope.key)
            fields: dict[str, np.ndarray | None] = {"sinks": sinks}
            products: dict[str, _Matrix] = {}
            fields["input_norm"], e1 = _norm(layer, "input_layernorm", plus_one)
            if "pre_feedforward_layernorm" in layer:  # Gemma's four norms a layer
                fields["post_norm"], e2 = _norm(layer, "pre_feedforward_layernorm", plus_one)
                fields["attn_out_norm"], e3 = _norm(layer, "post_attention_layernorm", plus_one)
                fields["mlp_out_norm"], e4 = _norm(layer, "post_feedforward_layernorm", plus_one)
                if e3 != e2 or e4 != e2:
                    raise _Unsupported("norms with different eps")
            else:
                fields["post_norm"], e2 = _norm(layer, "post_attention_layernorm", plus_one)
            attention, biases = _attention_products(attn, self.heads, self.kv_heads)
            products |= attention
            fields |= {f"{proj}_bias": bias for proj, bias in biases.items()}
            q_rows, kv_rows = self.heads * self.head_dim, self.kv_heads * self.head_dim
            shapes = {p: (m.n, m.k) for p, m in products.items()}
            if shapes != {
                "q": (q_rows, self.hidden),
                "k": (kv_rows, self.hidden),
                "v": (kv_rows, self.hidden),
                "o": (self.hidden, q_rows),
            }:
                raise _Unsupported(f"attention projections {shapes}")
            if sparse or oai is not None:
                experts, held = (_gpt_oss_experts if oai else _experts)(mlp, self.hidden)
                self._keep += held
                checked += [m for m in held if isinstance(m, _Matrix)]
                structs[i].experts = ctypes.pointer(experts)
                self._experts.append(experts)
            else:
                self._experts.append(None)
                products |= _mlp_products(mlp)
                intermediate = products["gate"].n
                if {(m.n, m.k) for p, m in products.items() if p in ("gate", "up")} != {
                    (intermediate, self.hidden)
                } or (products["down"].n, products["down"].k) != (self.hidden, intermediate):
                    raise _Unsupported("MLP projections")
            eps_all = {e1, e2, eps}
            for name in ("q_norm", "k_norm"):
                if hasattr(attn, name):
                    fields[name], e = _norm(attn, name, plus_one)
                    eps_all.add(e)
            if len(eps_all) != 1:
                raise _Unsupported("norms with different eps")
            if _attention_shape(attn) != (self.heads, self.kv_heads, self.scale):
                raise _Unsupported("layers of different shapes")
            for name, view in fields.items():
                if view is not None:
                    self._keep.append(view)
                    setattr(structs[i], name, _pointer(view))
            layer_products.append(products)
        matrices = [m for products in layer_products for m in products.values()]
        self._keep += matrices
        for matrix in [*matrices, *checked]:
            if matrix.codes is not None and not functions.weight_supported(
                ctypes.byref(matrix.weight()), matrix.n, matrix.k
            ):
                raise _Unsupported(f"a weight the library cannot read: {matrix.bits} bits")
        # The head: the embedding's weight when tied, else lm_head's (float32 or affine); None
        # where MLX computes it (e.g. a quantization the products do not read).
        self._head_bias: np.ndarray | None = None
        head: _Matrix | None = embed_matrix
        if "lm_head" in module:
            try:
                head, self._head_bias = _linear(module, "lm_head")
            except _Unsupported:
                head = None
        if head is not None:
            self._keep.append(head)
        # Exact half-precision copies of the float32 products' weights and head, when the
        # checkpoint's values allow: decode steps and short forwards read half the bytes.
        floats = [
            m for m in [*matrices, *([head] if head is not None else [])] if m.f32 is not None
        ]
        self.half_format: str | None = None
        self.half_copies: list[np.ndarray] = []  # of `floats`, in order
        copies_bytes = sum(m.n * m.k for m in floats) * 2
        if functions.half_weights and half_formats and floats:
            room = available_memory()
            if room is not None and copies_bytes > room * HALF_COPIES_MEMORY_SHARE:
                log.info(
                    "no half-precision copies of the weights: %d MB would be more than half "
                    "of the %d MB available", copies_bytes >> 20, room >> 20,
                )  # fmt: skip
            else:
                arrays = [m.f32 for m in floats if m.f32 is not None]
                half = _half_copies(functions, arrays, half_formats)
                if half is not None:
                    self.half_format, self.half_copies = half
                    log.info(
                        "short forwards read %s copies of the weights (%d MB more memory)",
                        self.half_format, copies_bytes >> 20,
                    )  # fmt: skip
        copy_of = {id(m): c for m, c in zip(floats, self.half_copies, strict=False)}
        half_code = abi.HALF_FORMATS.get(self.half_format or "", 0)

        def weight(matrix: _Matrix) -> abi.Weight:
            return matrix.weight(copy_of.get(id(matrix)), half_code)

        for struct, products in zip(structs, layer_products, strict=True):
            for name, matrix in products.items():
                setattr(struct, name, weight(matrix))
        # products read as codes (a layer's experts count their router and three stacks)
        self.quantized = sum(m.codes is not None for m in [*matrices, *checked])
        # The head's product here: from its codes (any number of rows: MLX's CPU
        # quantized_matmul is ~40x slower than these tiles), or its half copy (up to
        # HEAD_ROWS rows, MLX's float32 product past them); None: MLX's.
        self._head: abi.Weight | None = None
        self._head_rows = 0
        self._head_vocab = head.n if head is not None else 0
        if head is not None and head.codes is not None:
            self._head, self._head_rows = weight(head), 1 << 30
        elif head is not None and id(head) in copy_of:
            self._head, self._head_rows = weight(head), HEAD_ROWS
        # the gated MLPs' width (of the dense layers; else the experts')
        widest = max((e.intermediate for e in self._experts if e is not None), default=0)
        self.intermediate = next((int(p["gate"].n) for p in layer_products if "gate" in p), widest)
        self.eps = eps
        self.layers = len(layers)
        self._structs = structs
        self._rope_rows = _RopeRows(self._ropes)
        # The struct step_args, its fields that stay set once; and a one-row step's per-layer
        # caches, kept with the buffers (`_Owned`) each layer's entry was filled from: a
        # decode step set ~30 fields of each afresh (~0.1 ms of SmolLM2's token).
        self._args = abi.Args(
            hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, intermediate=self.intermediate, layers=self.layers,
            rope_dims=self._ropes[0].dims, activation=abi.ACTIVATIONS[self.activation],
            act_alpha=self.act_params[0], act_limit=self.act_params[1], eps=self.eps,
            scale=self.scale, softcap=self.softcap, layer=self._structs,
            final_norm=_pointer(self._final_norm),
        )  # fmt: skip
        self._row_caches = (abi.Cache * self.layers)()
        self._row_filled: list[_Owned | None] = [None] * self.layers
        # the entries as uint64 words, for writing every layer's append addresses at once
        words = np.frombuffer(memoryview(self._row_caches).cast("B"), np.uint64).reshape(
            self.layers, -1
        )
        self._row_appends = (
            words[:, abi.Cache.append_keys.offset // 8],
            words[:, abi.Cache.append_values.offset // 8],
        )
        self._row_bases = (np.zeros(self.layers, np.uint64), np.zeros(self.layers, np.uint64))
        # single-row caches -> the buffers this step allocated for them (`_grow`)
        self._owned: weakref.WeakKeyDictionary[KVCache, _Owned] = weakref.WeakKeyDictionary()
        self._decoding = False  # inside `decoding()`
        self._buffers: dict[str, np.ndarray] = {}  # `_workspace`
        if self.heads % self.kv_heads or rope.dims > min(self.head_dim, 1024):
            raise _Unsupported("head layout")

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Forwards of one token a row inside are decode steps: their GGML block products
        and 5-bit affine ones take A's values as integer limbs where the library has them
        (runner/native/quantized.c; `limb_products`, `affine_limbs`), their head's too
        (`host_logits`)."""
        outer, self._decoding = self._decoding, True
        try:
            yield
        finally:
            self._decoding = outer

    @property
    def limb_products(self) -> bool:
        """Whether this library's decode steps take limbs for GGML blocks (AVX512-VNNI or AVX2)."""
        return self._limb_products

    @property
    def affine_limbs(self) -> bool:
        """Whether they take limbs for 5-bit affine codes too (AVX512-VNNI and VBMI, AVX2)."""
        return self._affine_limbs

    def __call__(self, tokens: mx.array, caches: list[Any]) -> mx.array | None:
        """The final hidden states [B, T, H] of `tokens` [B, T] after the caches, appending
        to them; None when MLX's path must run this forward (nothing changed then). One row
        continues plain `KVCache`s; several rows continue one shared prefix each
        (`SharedPrefixKV`, runner/cache/shared_prefix.py, before their suffixes are written)."""
        if tokens.ndim != 2 or not 0 < tokens.shape[1] <= self.max_tokens:
            return None
        if not caches or len(caches) != self.layers:
            return None
        batch, t = int(tokens.shape[0]), int(tokens.shape[1])
        # sliding-window layers: mlx-lm's rotating caches (runner/models/decoder.py's
        # layer_caches: the window is the ring's size), read here and appended by MLX
        windowed = [type(c) is RotatingKVCache for c in caches]
        # one row continues plain KV caches; rows over a shared prefix (any batch, one row
        # included) continue SharedPrefixKVs
        shared = batch > 1 or any(type(c) is SharedPrefixKV for c in caches)
        plain = SharedPrefixKV if shared else KVCache
        if not all(w or type(c) is plain for c, w in zip(caches, windowed, strict=True)):
            return None
        one_row = not shared
        if one_row:
            offset = caches[0].offset
            # per cache: the buffers this step allocated for it, when they have room for these
            # tokens; None: grown below, once its cached positions pass the checks here
            owned = [
                None if w else self._room(c, offset + t)
                for c, w in zip(caches, windowed, strict=True)
            ]
            buffers = {
                i: (c.keys, c.values)
                for i, (c, o) in enumerate(zip(caches, owned, strict=True))
                if o is None and offset and not windowed[i]
            }
        elif all(
            c.batch == batch and c.suffix.keys is None
            for c in caches
            if isinstance(c, SharedPrefixKV)
        ):
            offset = caches[0].offset
            buffers = {
                i: (c.prefix_keys, c.prefix_values) for i, c in enumerate(caches) if not windowed[i]
            }
        else:
            return None
        if any(c.offset != offset for c in caches):
            return None
        kept_structs = one_row and not any(windowed)  # the caches' entries kept between steps
        cache_structs = self._row_caches if kept_structs else (abi.Cache * self.layers)()
        keep: list[np.ndarray] = []  # the views' lifetimes: until the call returns
        if buffers:
            mx.eval(*(a for pair in buffers.values() for a in pair))
            for i, (keys, values) in buffers.items():
                k_view, v_view = self._cache_view(keys, offset), self._cache_view(values, offset)
                if k_view is None or v_view is None or k_view.strides != v_view.strides:
                    return None
                if one_row:
                    continue  # checked for `_grow`'s copy; read from the step's buffers below
                keep += (k_view, v_view)
                cache_structs[i].keys = k_view.ctypes.data
                cache_structs[i].values = v_view.ctypes.data
                cache_structs[i].head_stride = k_view.strides[1] // 4
        rings = [c for c, w in zip(caches, windowed, strict=True) if w and c.keys is not None]
        if rings:  # last forward's appends, evaluated together (not one graph a layer)
            mx.eval(*(a for c in rings for a in (c.keys, c.values)))
        for i, c in enumerate(caches):
            if windowed[i]:
                window = self._window_view(c, offset, batch)
                if window is None:
                    return None
                start, (k_view, v_view), wrapped = window
                keep += (k_view, v_view)
                entry = cache_structs[i]
                entry.keys, entry.values = k_view.ctypes.data, v_view.ctypes.data
                entry.head_stride = k_view.strides[0] // 4
                entry.start, entry.window = start, c.max_size
                if wrapped is not None:  # the ring's positions in two runs, read in place
                    k_rest, v_rest = wrapped
                    keep += (k_rest, v_rest)
                    entry.wrap = k_view.shape[1]
                    entry.keys2, entry.values2 = k_rest.ctypes.data, v_rest.ctypes.data
        ids = np.asarray(tokens).reshape(-1)
        if ids.min() < 0 or ids.max() >= self.vocab:
            return None  # MLX's path decides what an id past the table means
        x = self._embedded(ids)
        if one_row:  # every check passed: the caches move to buffers this step writes
            row = offset * self.head_dim * 4
            for i, (c, o) in enumerate(zip(caches, owned, strict=True)):
                if windowed[i] or (kept_structs and o is not None and self._row_filled[i] is o):
                    continue  # windowed: set above; kept: the entry holds these buffers
                o = o or self._grow(c, offset + t)
                entry = cache_structs[i]
                entry.keys, entry.values = o.keys_at, o.values_at
                entry.head_stride = o.capacity * self.head_dim
                if kept_structs:
                    self._row_filled[i] = o
                    self._row_bases[0][i], self._row_bases[1][i] = o.keys_at, o.values_at
                else:
                    entry.append_keys = o.keys_at + row
                    entry.append_values = o.values_at + row
            if kept_structs:  # the rows move: every layer's append addresses at once
                for appends, bases in zip(self._row_appends, self._row_bases, strict=True):
                    np.add(bases, np.uint64(row), out=appends)
        cos_view, sin_view = self._rope_rows.rows(offset, t)
        shape = (self.layers, batch, self.kv_heads, t, self.head_dim)
        size = math.prod(shape)
        new_keys = self._workspace("keys", size).reshape(shape)
        new_values = self._workspace("values", size).reshape(shape)
        args = self._args
        args.batch, args.tokens, args.offset = batch, t, offset
        args.decode = int(self._decoding and t == 1)
        args.cos, args.sin, args.cache = _pointer(cos_view), _pointer(sin_view), cache_structs
        args.x, args.new_keys = _pointer(x), _pointer(new_keys)
        args.new_values, args.query_scale = _pointer(new_values), None
        if self._query_scale is not None:
            scales = self._query_scale(offset, t)
            if scales is not None:
                scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(t)
                keep.append(scales)
                args.query_scale = _pointer(scales)
        args.scratch = _pointer(self._workspace("scratch", self._scratch(ctypes.byref(args))))
        if self._step(ctypes.byref(args)) != 0:
            return None
        del keep
        for i, c in enumerate(caches):
            if one_row and not windowed[i]:  # the step wrote them into the buffers
                c.offset = offset + t
            else:
                c.update_and_fetch(mx.array(new_keys[i]), mx.array(new_values[i]))
        return mx.array(x.reshape(batch, t, self.hidden))  # evaluated: nothing left to schedule

    def _embedded(self, ids: np.ndarray) -> np.ndarray:
        """The embedding rows of `ids` (scaled where the family scales them), float32,
        contiguous and this step's to write."""
        if self._embed_rows is not None:
            rows = self._embed_rows.values(ids)
        else:
            assert self._embed_module is not None
            embedded = self._embed_module(mx.array(ids)).astype(mx.float32)  # as MLX's path
            rows = np.array(embedded, dtype=np.float32)
        if self._embed_scale is not None:
            rows *= np.float32(self._embed_scale)
        return rows

    def unembed(self, hidden: mx.array) -> mx.array | None:
        """The head's logits of `hidden` [..., H] from its codes (any number of rows) or its
        half copy (up to `HEAD_ROWS` rows): MLX's product up to float32 rounding. None where
        MLX computes them (another format, or more rows than a half copy takes)."""
        out = self.host_logits(hidden)
        if out is None:
            return None
        return mx.array(out.reshape(*hidden.shape[:-1], out.shape[-1]))

    def host_logits(self, hidden: mx.array) -> np.ndarray | None:
        """`unembed`'s logits as numpy's [rows, vocab] float32, never through MLX's stream (a
        greedy decode step takes its argmax there: runner/generate/pipeline.py). None where
        `unembed` gives None."""
        if self._head is None or hidden.dtype != mx.float32 or hidden.shape[-1] != self.hidden:
            return None
        rows = hidden.size // self.hidden
        if not 0 < rows <= self._head_rows:
            return None
        x = np.ascontiguousarray(np.asarray(hidden), dtype=np.float32).reshape(rows, self.hidden)
        vocab = self._head_vocab
        out = np.empty((rows, vocab), np.float32)
        code = self._weight_product(
            rows,
            vocab,
            self.hidden,
            _pointer(x),
            ctypes.byref(self._head),
            _pointer(out),
            # A decode step's head takes limbs too where the library has them for its
            # format: 1.7x the float tile on AVX2, the same on AVX512-VNNI, where both read
            # the head at the memory's rate (bench/RESULTS.md, "The head by limbs, and
            # llama.cpp's AVX2 build")
            int(self._decoding),
        )
        if code != 0:
            return None
        if self._head_bias is not None:
            out += self._head_bias
        return out

    def restore(self, cache: Any, segments: list[Any], target: int, kept: int = 0) -> bool:
        """Make `cache` (a plain `KVCache`) hold [0, target) from the trie's KV segments
        (`Snap`s of (keys, values) [1, Hkv, n, D], in order from 0), copied into the buffers
        this step allocated for it, when it still holds them with room for `target`
        positions; False (nothing changed) otherwise. The prefix cache's install would
        concatenate the segments into a new buffer, which the next forward copies again
        into a buffer of its own (`_grow`): SmolLM2, 498 positions, 30 layers, ~34 ms of
        fresh memory and MLX's copies, against ~5 ms copied here. Safe as `_grow`'s
        buffers are: nothing else holds them (see there), and no forward is in flight
        (the prefix cache settles the live state before it switches).

        Positions [0, kept) already hold the prefix (the live state shares them with it):
        only [kept, target) is copied. Decision requests over one system prompt land one
        token past the live state's when a question starts like an earlier one's; copying
        the whole prefix for it cost 3-4 ms."""
        if type(cache) is not KVCache or target <= 0:
            return False
        owned = self._room(cache, target)
        if owned is None:
            return False
        parts = [s for s in segments if s.start < target]
        if not parts or parts[0].start != 0 or parts[-1].end < target:
            return False
        kept = max(0, min(kept, cache.offset, target))
        copies = []  # (destination, source) views, all checked before anything is written
        keys, values = np.asarray(cache.keys), np.asarray(cache.values)
        at = 0
        for snap in parts:
            if snap.start != at:
                return False
            at = snap.end
            start, end = max(snap.start, kept), min(snap.end, target)
            for into, array in zip((keys, values), snap.arrays[:2], strict=True):
                source = np.asarray(array)
                if source.dtype != np.float32 or source.shape != (
                    1, self.kv_heads, snap.end - snap.start, self.head_dim
                ):  # fmt: skip
                    return False
                if start < end:
                    kept_part = source[:, :, start - snap.start : end - snap.start, :]
                    copies.append((into[:, :, start:end, :], kept_part))
        for into, source in copies:
            np.copyto(into, source)
        cache.offset = target
        return True

    def _workspace(self, name: str, floats: int) -> np.ndarray:
        """`floats` floats of the step's buffer `name`, kept between calls (grown when too
        small): a decode step's ~1 MB of scratch allocated afresh was mapped and zeroed by
        the kernel at every call (~3% of a SmolLM2 step). Its contents last until the next
        call: MLX copies what it takes from them (`mx.array`)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < floats:
            buffer = self._buffers[name] = np.empty(floats, np.float32)
        return buffer[:floats]

    def _room(self, cache: KVCache, positions: int) -> _Owned | None:
        """The buffers this step allocated for `cache` when it still holds them and they
        have room for `positions`; else None (`_grow` makes new ones)."""
        owned = self._owned.get(cache)
        if owned is not None and owned.holds(cache) and owned.capacity >= positions:
            return owned
        return None

    def _grow(self, cache: KVCache, positions: int) -> _Owned:
        """New buffers for `cache`, this step's own, holding its cached positions with room
        for `positions` (mlx-lm's growth: whole steps of `cache.step` positions).

        Writing into a cache buffer in place is safe only when nothing else holds its memory:
        a restored cache can be a view of a trie snapshot (a concatenation of one array is
        that array), and MLX's own in-place updates check who holds a buffer, which numpy's
        writes cannot. Buffers allocated here are known to be the cache's alone: snapshots,
        row segments and captures copy what they take (docs/DESIGN.md §3.1), and the views
        MLX's path and batched rows take of a live cache only read positions below their
        offset and are evaluated before the next forward (sessions evaluate each forward)."""
        step = int(getattr(cache, "step", 256))
        capacity = (positions + step - 1) // step * step
        kept, shape = cache.offset, (1, self.kv_heads, capacity, self.head_dim)

        def fresh(old: mx.array | None) -> mx.array:
            # One pass in MLX, as mlx-lm grows a cache: the cached positions, then zeros. A
            # concatenation of two arrays is a new buffer (of one it would be the array).
            rest = mx.zeros((1, self.kv_heads, capacity - kept, self.head_dim), mx.float32)
            if not kept:
                return rest
            assert old is not None  # checked by the caller: offset > 0 has buffers
            return mx.concatenate([old[..., :kept, :], rest], axis=2)

        # The old arrays stay alive until the check: a new buffer at one of their addresses
        # is then an alias, not a freed buffer MLX handed out again.
        old = [a for a in (cache.keys, cache.values) if kept and a is not None]
        before = {np.asarray(a).ctypes.data for a in old}
        cache.keys, cache.values = fresh(cache.keys), fresh(cache.values)
        mx.eval(cache.keys, cache.values)
        k_view, v_view = np.asarray(cache.keys), np.asarray(cache.values)
        for view in (k_view, v_view):  # a real buffer of its own, rows where the step writes
            plain = view.shape == shape and view.flags.c_contiguous and view.flags.writeable
            if not plain or view.ctypes.data in before:
                raise AssertionError(f"a fresh KV buffer is not a new plain array: {view.strides}")
        del old
        owned = _Owned(
            weakref.ref(cache.keys),
            weakref.ref(cache.values),
            k_view.ctypes.data,
            v_view.ctypes.data,
            capacity,
        )
        self._owned[cache] = owned
        return owned

    def _window_view(
        self, cache: RotatingKVCache, offset: int, batch: int
    ) -> tuple[int, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None] | None:
        """The positions of a rotating cache that this step's queries see, [start, offset),
        as (start, (keys, values), rest): views of the ring [kv_heads, n, head_dim] in order
        of position, the first run of them, and `rest` None where they lie in one run, else
        the second run (the ring has wrapped: the step reads both in place, struct
        step_cache's `wrap`). None when the cache cannot serve (`keep`, a buffer of another
        shape, positions it no longer holds).

        mlx-lm's ring (`RotatingKVCache`): `_idx` is the slot after the newest position
        (offset - 1), and the slots before it, cyclically, hold the positions before that,
        `min(offset, slots)` of them; every query of a forward sees the `max_size` positions
        up to its own (a forward of several tokens first keeps the last max_size - 1), so
        the first query, at `offset`, sees [offset - max_size + 1, offset)."""
        if cache.keep:
            return None
        start = max(0, offset - cache.max_size + 1)
        if offset == 0 or start == offset:
            empty = np.zeros((self.kv_heads, 0, self.head_dim), np.float32)
            return offset, (empty, empty), None
        if cache.keys is None:
            return None
        views = []  # of evaluated arrays (the caller evaluates every ring at once)
        for array in (cache.keys, cache.values):
            view = np.asarray(array)
            if (
                view.dtype != np.float32
                or view.ndim != 4
                or view.shape[0] not in (1, batch)
                or view.shape[1] != self.kv_heads
                or view.shape[3] != self.head_dim
                or view.strides[3] != 4
                or view.strides[2] != 4 * self.head_dim
            ):
                return None
            views.append(view[0])
        slots, idx = views[0].shape[1], int(cache._idx)
        if offset - min(offset, slots) > start or not 0 < idx <= slots:
            return None  # the window reaches back past what the ring holds
        first, n = (idx - offset + start) % slots, offset - start
        if first + n <= slots:
            return start, (views[0][:, first : first + n], views[1][:, first : first + n]), None
        rest = first + n - slots
        k, v = views
        return start, (k[:, first:], v[:, first:]), (k[:, :rest], v[:, :rest])

    def _cache_view(self, array: mx.array, offset: int) -> np.ndarray | None:
        """`array` ([1, Hkv, >= offset, D] float32, positions' rows contiguous) as numpy's
        view of MLX's memory, or None when the step cannot read it in place."""
        view = np.asarray(array)
        if (
            view.dtype != np.float32
            or view.ndim != 4
            or view.shape[:2] != (1, self.kv_heads)
            or view.shape[2] < offset
            or view.shape[3] != self.head_dim
            or view.strides[3] != 4
            or view.strides[2] != 4 * self.head_dim
            or view.strides[1] % 4
        ):
            return None
        return view


def build(
    module: nn.Module,
    kernels: Kernels,
    max_tokens: int | None,
    half_formats: tuple[str, ...] = (),
    functions: abi.Functions | None = None,
    shape: NativeShape | None = None,
) -> NativeStep | None:
    """The native step for `module`, or None (not a module it serves, no library, or off);
    `half_formats`, `shape`: see `NativeStep`; `functions`: a library's (default: the one
    preloaded into this process, if its ABI is the runner's)."""
    if not max_tokens:
        return None
    functions = abi.load() if functions is None else functions
    if functions is None:
        return None
    try:
        return NativeStep(module, kernels, max_tokens, functions, half_formats, shape)
    except _Unsupported as e:
        log.debug("no native step: %s", e)
        return None
