"""Rotary embeddings from tables shared by every layer of a forward (the CPU backend).

MLX has no CPU kernel for `mx.fast.rope`; its fallback composes ~30 primitive operations for
every call, recomputing the frequencies (`arange`, `exp`, `cos`, `sin`) for the queries and
again for the keys of every layer. A decode step of SmolLM2 (30 layers) spends ~1,800 of its
~4,000 operations there, and on MLX's CPU each operation costs ~5.5 us whatever its size
(docs/DESIGN.md §4). `TableRoPE` computes the cos/sin table of a forward's positions once, in
numpy, and every layer then applies it in 6 operations: `x * C + rotate_half(x) * S`.

It replaces, on the instances of a loaded model only (runner/backend/install.py), the rotary
modules whose rule is plain: `nn.RoPE`, mlx-lm's `Llama3RoPE`, `YarnRoPE` and `SuScaledRoPE`
(Phi3's longrope; the last two's input scale folded into the table), not traditional (pairs
interleaved), the rotated part the leading `dims` of each head. Others keep mlx-lm's.

Invariants:
- The result equals `mx.fast.rope`'s within float32 rounding of the angles (the table is
  computed in float64); tests/test_backend_kernels.py compares them.
- A table depends only on (frequencies, scale, offset, length); a model's layers share one
  `RopeTables`, which keeps the last table per frequency vector, so the layers of one forward
  evaluate it once.
- An offset that is not a Python int (per-row offsets of mlx-lm's batch caches) goes to the
  original module.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE


def table_values(
    inv_freq: np.ndarray, offset: int, length: int, amplitude: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """C = [cos, cos], S = [-sin, sin] (float32 [length, dims], computed in float64) for
    positions offset .. offset + length - 1, both times `amplitude`. A position's row is the
    same whichever positions are computed with it."""
    positions = np.arange(offset, offset + length, dtype=np.float64)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles) * amplitude, np.sin(angles) * amplitude
    return (
        np.concatenate([cos, cos], axis=-1).astype(np.float32),
        np.concatenate([-sin, sin], axis=-1).astype(np.float32),
    )


class RopeTables:
    """The last (C, S) table per frequency vector, shared by a model's rotary modules."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[tuple[int, int], tuple[mx.array, mx.array]]] = {}

    def get(self, key: int, inv_freq: np.ndarray, offset: int, length: int, amplitude: float = 1.0):
        """C = [cos, cos], S = [-sin, sin] for positions offset .. offset + length - 1, both
        times `amplitude` (YaRN's input scale)."""
        last = self._last.get(key)
        if last is not None and last[0] == (offset, length):
            return last[1]
        cos, sin = table_values(inv_freq, offset, length, amplitude)
        table = (mx.array(cos), mx.array(sin))
        self._last[key] = ((offset, length), table)
        return table


class TableRoPE(nn.Module):
    """Non-traditional rotary embedding of the leading `dims` of each head, from a table."""

    def __init__(
        self,
        original: nn.Module,
        inv_freq: np.ndarray,
        tables: RopeTables,
        amplitude: float = 1.0,
    ):
        super().__init__()
        # Plain attributes (not the module's dict): no child modules, no parameters.
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_tables", tables)
        half = rotated_dims(original) // 2
        rotate = mx.array(np.r_[np.arange(half, 2 * half), np.arange(half)], mx.uint32)
        object.__setattr__(self, "_rotate", rotate)
        self._inv_freq = inv_freq  # float64, already multiplied by the position scale
        self._amplitude = float(amplitude)  # what the rotated part is multiplied by (YaRN)
        self.key = hash((inv_freq.tobytes(), self._amplitude))  # equal keys: the same rotation
        self.dims = rotated_dims(original)

    def table(self, offset: int, length: int) -> tuple[mx.array, mx.array]:
        """(C, S) [length, dims] for positions offset .. offset + length - 1."""
        return self._tables.get(self.key, self._inv_freq, offset, length, self._amplitude)

    def numpy_table(self, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """`table`'s values in numpy (for the native step, runner/backend/native_step.py)."""
        return table_values(self._inv_freq, offset, length, self._amplitude)

    def __call__(self, x: mx.array, offset: Any = 0, **options: Any) -> mx.array:
        if not isinstance(offset, int) or options:  # e.g. YaRN's inverse rotation
            return self._original(x, offset=offset, **options)
        cos, sin = self.table(offset, x.shape[-2])
        if x.shape[-1] == self.dims:
            return self._apply(x, cos, sin)
        rotated = self._apply(x[..., : self.dims], cos, sin)
        return mx.concatenate([rotated, x[..., self.dims :]], axis=-1)

    def _apply(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        if x.dtype != cos.dtype:
            cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        return x * cos + mx.take(x, self._rotate, axis=-1) * sin


def inverse_frequencies(module: nn.Module) -> np.ndarray | None:
    """The angle per position of each rotated pair, scale included, or None when the module's
    rule is not one `TableRoPE` computes."""
    if type(module) is SuScaledRoPE:  # never traditional; its rotated part is `dim`
        return 1.0 / np.array(module._freqs, dtype=np.float64) if module.dim % 2 == 0 else None
    if getattr(module, "traditional", True) or int(module.dims) % 2:
        return None
    dims = int(module.dims)
    if type(module) is nn.RoPE:
        exponents = np.arange(0, dims, 2, dtype=np.float64) / dims
        return float(module.scale) / (float(module.base) ** exponents)
    if type(module) in (Llama3RoPE, YarnRoPE):
        return 1.0 / np.array(module._freqs, dtype=np.float64)  # scale 1, as mlx-lm calls it
    return None


def amplitude(module: nn.Module) -> float:
    """What a rotary module multiplies the rotated part by before rotating it: YaRN's
    `mscale`, longrope's `_scale`, else 1."""
    if type(module) is YarnRoPE:
        return float(module.mscale)
    if type(module) is SuScaledRoPE:
        return float(module._scale)
    return 1.0


def rotated_dims(module: nn.Module) -> int:
    """The leading dims of each head a rotary module rotates."""
    return int(module.dim if type(module) is SuScaledRoPE else module.dims)


def install(model: nn.Module) -> int:
    """Replace the plain rotary modules inside `model` by `TableRoPE`s sharing one set of
    tables; returns how many were replaced."""
    tables = RopeTables()
    replaced = 0
    for _, parent in model.named_modules():
        for name, child in list(parent.children().items()):
            if not isinstance(child, nn.Module) or isinstance(child, TableRoPE):
                continue
            inv_freq = inverse_frequencies(child)
            if inv_freq is not None:
                setattr(parent, name, TableRoPE(child, inv_freq, tables, amplitude(child)))
                replaced += 1
    return replaced
