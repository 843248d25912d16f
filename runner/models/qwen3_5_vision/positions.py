"""The text model's 3-channel rotary positions once a prompt has images (mrope): a prompt's
layout (`MropeLayout`, `mrope_layout`), which channel turns each rotary pair
(`mrope_channels`, `mrope_section`), the cos/sin tables of a forward (`rotary_table`), and
the rotary module that applies them in the full-attention layers (`LayoutRoPE`).

transformers' `get_rope_index` gives each token three positions (t, h, w): text advances
all three by one; an image's tokens take (start, start + row, start + column) on its merged
grid, and the text after it continues at start + max(rows, columns). The text model's
rotary angles take pair j from channel h (j % 3 == 1, j < 3 * mrope_section[1]), w
(j % 3 == 2, j < 3 * mrope_section[2]) or t (the rest): interleaved mrope. A layout is made
for a prepared prompt and every forward of the request passes it, so a token's rotary
position is a function of its absolute index (cache offset + i), and tokens past the
prompt (decode) sit at index + delta (docs/DESIGN.md §3.5). Without a layout (a text-only
prompt), t = h = w = index: the text path, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.models.qwen3_5_vision.processor import Grid
from runner.models.vision_blocks import rotate_half
from runner.sources.source import ModelLoadError, show

MROPE_SECTION = (11, 11, 10)  # transformers' default when rope_parameters has none


@dataclass(frozen=True)
class MropeLayout:
    """A prompt's 3-channel rotary positions: `table` [3, L] for its L tokens, and `delta`,
    what a token past the prompt adds to its index (transformers' `rope_deltas`)."""

    table: np.ndarray
    delta: int

    def positions(self, start: int, n: int) -> np.ndarray:
        """[3, n] positions of the tokens at absolute indices start .. start + n - 1."""
        index = np.arange(start, start + n)
        out = np.repeat((index + self.delta)[None], 3, axis=0)
        inside = index < self.table.shape[1]
        out[:, inside] = self.table[:, index[inside]]
        return out


def mrope_layout(length: int, items: list[tuple[int, int, Grid]], merge: int) -> MropeLayout:
    """transformers' `get_rope_index` for one prompt of `length` tokens whose image tokens
    are `items` ([start, end) and grid in patches, in order); the rest is text."""
    table = np.empty((3, length), np.int64)
    current = at = 0
    for start, end, (t, h, w) in items:
        table[:, at:start] = np.arange(start - at) + current
        current += start - at
        gh, gw = h // merge, w // merge
        if t * gh * gw != end - start:
            raise ValueError(f"an image of grid {(t, h, w)} cannot fill [{start}, {end})")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        table[:, start:end] = np.stack([tt, hh, ww]).reshape(3, -1) + current
        current += max(gh, gw)
        at = end
    table[:, at:] = np.arange(length - at) + current
    delta = int(table.max()) + 1 - length if length else 0
    return MropeLayout(table, delta)


class MropeTable:
    """The cos/sin of the forward being built, shared by the full-attention layers' rotary
    modules; None outside a forward with a layout."""

    def __init__(self) -> None:
        self.table: tuple[mx.array, mx.array] | None = None


class LayoutRoPE(nn.Module):
    """A full-attention layer's rotary embedding: mlx-lm's (offset-based) without a layout;
    with one, the forward's 3-channel table over the leading `dims` of each head."""

    def __init__(self, original: nn.Module, shared: MropeTable):
        super().__init__()
        self.original = original  # a child: the backend may swap in its table rope
        object.__setattr__(self, "_shared", shared)
        self.dims = int(original.dims)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        table = self._shared.table
        if table is None:
            return self.original(x, offset=offset)
        cos, sin = table
        rotated = x[..., : self.dims]
        rotated = rotated * cos.astype(x.dtype) + rotate_half(rotated) * sin.astype(x.dtype)
        if x.shape[-1] == self.dims:
            return rotated
        return mx.concatenate([rotated, x[..., self.dims :]], axis=-1)


def mrope_channels(pairs: int, section: tuple[int, ...]) -> np.ndarray:
    """Which position channel (0 t, 1 h, 2 w) rotates each pair: transformers' interleaved
    `recomposition_frequencies`."""
    channels = np.zeros(pairs, np.int64)
    for channel in (1, 2):
        channels[channel : min(section[channel] * 3, pairs) : 3] = channel
    return channels


def mrope_section(text_config: dict[str, Any]) -> tuple[int, int, int]:
    """The text config's `rope_parameters.mrope_section` (transformers' default without
    one), checked; sections must be interleaved."""
    rope = text_config.get("rope_parameters") or {}
    section = rope.get("mrope_section", list(MROPE_SECTION)) if isinstance(rope, dict) else None
    if not (
        isinstance(section, list | tuple)
        and len(section) == 3
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
    ):
        raise ModelLoadError(
            f"config.json: text_config.rope_parameters.mrope_section {show(section)} is not "
            "three non-negative integers"
        )
    if rope.get("mrope_interleaved", True) is not True:
        raise ModelLoadError(
            "config.json: text_config.rope_parameters.mrope_interleaved must be true "
            "(transformers' Qwen3.5 interleaves its sections)"
        )
    return section[0], section[1], section[2]


def rotary_table(
    positions: np.ndarray, channels: np.ndarray, inv_freq: np.ndarray
) -> tuple[mx.array, mx.array]:
    """cos, sin [n, rotary dims] for positions [3, n]: pair j turns by its channel's
    position (float64 angles, float32 tables)."""
    chosen = positions[channels, :].T  # [n, pairs]
    angles = chosen * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return mx.array(cos), mx.array(sin)
