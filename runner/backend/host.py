"""Transcendental element-wise ops on MLX's CPU backend, computed by numpy.

MLX's CPU backend computes exp and sigmoid one scalar at a time; numpy's ufuncs are SIMD
(AVX-512 / AVX2 on x86, NEON on ARM). Measured an element, float32: on a 2-core AVX-512
machine MLX exp 11.6, sigmoid 15.9, power(2, x) 4.3 ns, numpy exp 0.45 ns; on the 2-core
AVX2 CI machine MLX exp 27, sigmoid 27, power(2, x) 11 ns, numpy exp 2.5 ns (its exp2 is
not SIMD there: 5 ns). Prefill and batched scoring spent about a fifth of each forward there
(Qwen3-0.6B shape, median of 5 interleaved runs: 16 rows x 16 tokens over a 512-token
prefix 2653 -> 2130 ms, a 512-token prefill 4681 -> 3913 ms, with softmax and SwiGLU here).

Invariants:
- Used only where the model's `Backend` says so (runner/backend/__init__.py): crossing to
  numpy evaluates the graph built so far, which small forwards and decode steps must not
  pay (decode overlaps the next forward with host work).
- MLX CPU arrays are host memory: numpy reads them through the buffer protocol without a
  copy. SwiGLU's result is copied back once (~0.16 ns an element); attention scores are
  rewritten in place in the fresh matmul output that holds them (`host_views`), so the
  softmax makes no MLX copies, transposes or allocations at all.
- The numbers are float32 ufunc results (numpy's SIMD exp is within a few ulp), the same
  functions as MLX's, so logits agree with the reference within the usual float32 noise.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def host_views(*arrays: mx.array) -> list[np.ndarray]:
    """Evaluate `arrays` and return numpy views of their memory (no copy).

    Writing through a view changes the MLX array: callers may do so only for arrays they just
    computed and hold alone (a fresh matmul output), before anything else reads them.
    """
    mx.eval(*arrays)
    views = [np.asarray(a) for a in arrays]
    assert all(not v.flags.owndata and v.flags.writeable for v in views), "not a view"
    return views


def softmax_numerators_inplace(
    parts: list[np.ndarray], hidden: list[np.ndarray | None]
) -> np.ndarray:
    """Softmax numerators, in place: every part becomes e**(x - m) (0 where `hidden` is True),
    m being the row maximum over all parts' last axes, which together are one softmax row;
    returns the row sums ([..., 1]). Parts share their leading shape (empty parts are
    ignored); a `hidden` mask broadcasts against its part. Rows must keep at least one
    visible entry. (numpy's exp is SIMD on AVX2 and AVX-512; its exp2 only on AVX-512.)"""
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
        np.exp(part, out=part)
        total += part.sum(axis=-1, keepdims=True)
    return total


def _float32(*arrays: mx.array) -> bool:
    return all(a.dtype == mx.float32 for a in arrays)


def swiglu_host(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's `swiglu`, computed by numpy (float32 inputs)."""
    mx.eval(gate, x)
    g, up = np.asarray(gate), np.asarray(x)
    with np.errstate(over="ignore"):  # e^-g = inf for g < -88 gives silu = -0, as it should
        out = np.exp(-g)  # silu(g) = g / (1 + e^-g)
    out += 1.0
    np.divide(g, out, out=out)
    out *= up
    return mx.array(out)


def gelu_glu_host(gate: mx.array, x: mx.array) -> mx.array:
    """nn.gelu_approx(gate) * x (Gemma's MLP), the tanh approximation term for term, in numpy."""
    mx.eval(gate, x)
    g, up = np.asarray(gate), np.asarray(x)
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


class Activations:
    """The gated-MLP activations for one `Backend`: numpy for large float32 blocks, MLX's
    (mlx-lm's `swiglu`, `nn.gelu_approx`) otherwise."""

    def __init__(self, backend):
        self.backend = backend

    def _host(self, gate: mx.array, x: mx.array) -> bool:
        return self.backend.host_activation(gate.size) and _float32(gate, x)

    def swiglu(self, gate: mx.array, x: mx.array) -> mx.array:
        if self._host(gate, x):
            return swiglu_host(gate, x)
        return activations.swiglu(gate, x)

    def gelu_glu(self, gate: mx.array, x: mx.array) -> mx.array:
        if self._host(gate, x):
            return gelu_glu_host(gate, x)
        return nn.gelu_approx(gate) * x
