"""Transcendental element-wise ops on MLX's CPU backend, computed by numpy.

MLX's CPU backend computes exp and sigmoid one scalar at a time; numpy's ufuncs are SIMD
(AVX-512 / AVX2 on x86, NEON on ARM). Measured on this project's 2-core AVX-512 machine, on
2.1M float32: MLX exp 11.6, sigmoid 15.9, power(2, x) 4.3 ns an element; numpy exp 0.45,
exp2 0.22 ns. Prefill and batched scoring spent about a fifth of each forward there
(Qwen3-0.6B shape, median of 5 interleaved runs: 16 rows x 16 tokens over a 512-token
prefix 2653 -> 2130 ms, a 512-token prefill 4681 -> 3913 ms, with softmax and SwiGLU here).

Invariants:
- Only on the CPU backend. SwiGLU crosses only for blocks of at least `MIN_ELEMENTS`:
  crossing to numpy evaluates the graph built so far, which decode steps must not pay (they
  overlap the next forward with host work). Attention crosses only on paths that already
  are CPU prefill or batched scoring (runner/models/attention.py).
- MLX CPU arrays are host memory: numpy reads them through the buffer protocol without a
  copy. SwiGLU's result is copied back once (~0.16 ns an element); attention scores are
  rewritten in place in the fresh matmul output that holds them (`host_views`), so the
  softmax makes no MLX copies, transposes or allocations at all.
- The numbers are float32 ufunc results (numpy's SIMD exp is within a few ulp), the same
  functions as MLX's, so logits agree with the reference within the usual float32 noise.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations, gemma3_text, llama, qwen3, qwen3_next

MIN_ELEMENTS = 1 << 15
_MLX_LM_SWIGLU = activations.swiglu
_MODULES = (llama, qwen3, qwen3_next)  # the families whose MLP calls `swiglu`
_GEMMA3_MLP_CALL = gemma3_text.MLP.__call__
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def on_host(*arrays: mx.array) -> bool:
    """Whether an element-wise op over these float32 arrays is worth computing in numpy (the
    CPU backend, a block of at least MIN_ELEMENTS)."""
    return (
        mx.default_device() == mx.cpu
        and arrays[0].size >= MIN_ELEMENTS
        and all(a.dtype == mx.float32 for a in arrays)
    )


def _numpy(*arrays: mx.array) -> list[np.ndarray]:
    mx.eval(*arrays)
    return [np.asarray(a) for a in arrays]


def host_views(*arrays: mx.array) -> list[np.ndarray]:
    """Evaluate `arrays` and return numpy views of their memory (no copy).

    Writing through a view changes the MLX array: callers may do so only for arrays they just
    computed and hold alone (a fresh matmul output), before anything else reads them.
    """
    mx.eval(*arrays)
    views = [np.asarray(a) for a in arrays]
    assert all(not v.flags.owndata and v.flags.writeable for v in views), "not a view"
    return views


def exp2_softmax_inplace(parts: list[np.ndarray], hidden: list[np.ndarray | None]) -> np.ndarray:
    """Softmax numerators in base 2, in place: every part becomes 2**(x - m) (0 where
    `hidden` is True), m being the row maximum over all parts' last axes, which together are
    one softmax row; returns the row sums ([..., 1]). Parts share their leading shape (empty
    parts are ignored); a `hidden` mask broadcasts against its part. Rows must keep at least
    one visible entry."""
    kept = [(p, m) for p, m in zip(parts, hidden, strict=True) if p.shape[-1]]  # drop empties
    parts = [p for p, _ in kept]
    for part, mask in kept:
        if mask is not None:
            np.copyto(part, -np.inf, where=mask)
    top = parts[0].max(axis=-1, keepdims=True)
    for part in parts[1:]:
        np.maximum(top, part.max(axis=-1, keepdims=True), out=top)
    total = np.zeros_like(top)
    for part in parts:
        part -= top
        np.exp2(part, out=part)
        total += part.sum(axis=-1, keepdims=True)
    return total


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's `swiglu`."""
    if not on_host(gate, x):
        return _MLX_LM_SWIGLU(gate, x)
    g, up = _numpy(gate, x)
    with np.errstate(over="ignore"):  # e^-g = inf for g < -88 gives silu = -0, as it should
        out = np.exp(-g)  # silu(g) = g / (1 + e^-g)
    out += 1.0
    np.divide(g, out, out=out)
    out *= up
    return mx.array(out)


def gelu_approx_glu(gate: mx.array, x: mx.array) -> mx.array:
    """nn.gelu_approx(gate) * x (Gemma's MLP), the tanh approximation term for term."""
    if not on_host(gate, x):
        return nn.gelu_approx(gate) * x
    g, up = _numpy(gate, x)
    out = g * g
    out *= 0.044715
    out *= g
    out += g
    out *= _SQRT_2_OVER_PI
    np.tanh(out, out=out)
    out += 1.0
    out *= 0.5
    out *= g
    out *= up
    return mx.array(out)


def _gemma3_mlp_call(self, x: mx.array) -> mx.array:
    return self.down_proj(gelu_approx_glu(self.gate_proj(x), self.up_proj(x)))


def install() -> None:
    """Route the families' gated MLP activations through this module (idempotent)."""
    for module in _MODULES:
        module.swiglu = swiglu
    gemma3_text.MLP.__call__ = _gemma3_mlp_call


@contextlib.contextmanager
def stock_activations() -> Iterator[None]:
    """mlx-lm's own activations for the duration (benchmarks of plain mlx-lm use this)."""
    saved = [module.swiglu for module in _MODULES], gemma3_text.MLP.__call__
    for module in _MODULES:
        module.swiglu = _MLX_LM_SWIGLU
    gemma3_text.MLP.__call__ = _GEMMA3_MLP_CALL
    try:
        yield
    finally:
        for module, function in zip(_MODULES, saved[0], strict=True):
            module.swiglu = function
        gemma3_text.MLP.__call__ = saved[1]
