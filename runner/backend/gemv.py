"""One-row matmuls on MLX's CPU backend through numpy's BLAS: decode steps.

A decode step multiplies one row by every weight matrix, so it is bound by reading the
weights. MLX's CPU matmul hands it to `cblas_sgemm` with M = 1, which packs the weights
before using them: the 622 MB vocabulary projection of Qwen3-0.6B reads at 9.6 GB/s here
(Debian's OpenBLAS 0.3.21, preloaded), where numpy's `x @ W.T` (its own OpenBLAS, a gemv)
streams 35 GB/s. A whole Qwen3-0.6B decode step went from 3.7 to 7.2 tokens/s.

Invariants:
- Installed only where the `Backend` asks for it (the CPU backend); only float32 weights
  (quantized layers are other classes) and only inputs of exactly one row; everything else
  is MLX's matmul unchanged. Several rows (16-token suffixes, prefill) gain nothing here:
  they are not bound by the weight reads alone, and MLX's BLAS does them as well (measured
  318 vs 338 ms for a 16-token step).
- Weights are read in place (numpy views of the evaluated MLX parameters, no copy); the
  one-row input is evaluated first, so a step using this runs synchronously.
- numpy's BLAS has its own thread pool: runner/native/preload.py makes idle OpenBLAS threads
  sleep at once (`OPENBLAS_THREAD_TIMEOUT`) so the two pools do not spin against each other.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def one_row(x: mx.array, weight: mx.array) -> bool:
    """Whether `x @ weight.T` is a one-row float32 product."""
    return x.size == x.shape[-1] and x.dtype == mx.float32 and weight.dtype == mx.float32


def matvec(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """`x @ weight.T (+ bias)` for a one-row `x` (see `one_row`), computed by numpy."""
    mx.eval(x, weight, *([] if bias is None else [bias]))
    out = np.asarray(weight) @ np.asarray(x).reshape(-1)
    if bias is not None:
        out += np.asarray(bias)
    return mx.array(out).reshape(*x.shape[:-1], weight.shape[0])


class GemvLinear(nn.Linear):
    """nn.Linear whose one-row calls go through `matvec`."""

    def __call__(self, x: mx.array) -> mx.array:
        if one_row(x, self.weight):
            return matvec(x, self.weight, self.get("bias"))
        return super().__call__(x)


def install(module: nn.Module) -> int:
    """Make every plain nn.Linear in `module` a GemvLinear (same parameters, same object);
    returns how many. For the CPU backend, after the weights are loaded."""
    layers = [m for _, m in module.named_modules() if type(m) is nn.Linear]
    for layer in layers:
        layer.__class__ = GemvLinear
    return len(layers)
