"""The batched full-attention cache of rows over one shared prefix: the prefix K/V once
([1, Hkv, P, D]) and only the rows' own suffixes per row.

Invariant: `SharedPrefixKV.update_and_fetch` returns the suffix K/V only, so a batch is
right only while the runner's attention call (runner/backend/attention.py) is installed on
every attention layer of the model; runner/models/build.py checks that at load.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ConcatenateKVCache, KVCache


class SharedPrefixKV(KVCache):
    """A full-attention cache for B rows: one shared prefix, then each row's own tokens.

    `offset` counts the prefix and the suffix tokens written so far (RoPE positions and
    masks see one sequence per row); `update_and_fetch` stores and returns suffix K/V only.
    """

    def __init__(self, keys: mx.array, values: mx.array, batch: int):
        super().__init__()
        self.prefix_keys, self.prefix_values = keys, values
        self.prefix_len = keys.shape[2]
        self.batch = batch
        # Suffixes are written once per batch; KVCache would zero-fill 256-token steps
        # for every row of every layer first.
        self.suffix = ConcatenateKVCache()
        self.offset = self.prefix_len

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = self.suffix.update_and_fetch(keys, values)
        self.offset = self.prefix_len + self.suffix.offset
        return k, v

    @property  # type: ignore[misc]  # the batch's state is its suffixes; never set
    def state(self) -> tuple[Any, ...]:
        return self.suffix.state

    def segment(self, row: int, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Row `row`'s keys and values for absolute positions [start, end) past the prefix."""
        a, b = start - self.prefix_len, end - self.prefix_len
        assert a >= 0, "the shared prefix is not a row's own"
        return (
            self.suffix.keys[row : row + 1, :, a:b, :],
            self.suffix.values[row : row + 1, :, a:b, :],
        )

    def materialise(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Every row's full keys and values (the prefix copied per row) for suffix `keys`,
        `values`: for attention calls that need them whole (explicit masks)."""

        def full(prefix: mx.array, suffix: mx.array) -> mx.array:
            shared = mx.broadcast_to(prefix, (self.batch, *prefix.shape[1:]))
            return mx.concatenate([shared, suffix], axis=2)

        return full(self.prefix_keys, keys), full(self.prefix_values, values)
