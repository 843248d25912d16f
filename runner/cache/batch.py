"""Rows batched over one shared prefix: the batched cache, the batched forward, its check.

Scoring rows that share a prefix computes the prefix once into the live caches, then runs
every row's own suffix as one padded batch over it (`forward_suffixes`). Each cache kind
makes its batched cache (`Kind.broadcast`); full attention uses `SharedPrefixKV`, which
keeps the prefix K/V once ([1, Hkv, P, D]) and only the suffixes per row.

Invariants:
- `SharedPrefixKV.update_and_fetch` returns the suffix K/V only: a batch is right only while
  the runner's attention call (runner/backend/attention.py) is installed on every attention
  layer of the model. `verify_batched_rows` checks that at load, on the model itself, so an
  mlx-lm whose layers no longer reach that call fails the load instead of scoring wrongly.
- Right padding is harmless: every layer is causal, so a row's last real position never
  sees the padding after it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ConcatenateKVCache, KVCache

from runner.source import ModelLoadError


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


def unbatched_kinds(model: Any) -> list[str]:
    """The names of the model's cache kinds that cannot be batched (`Kind.batches` false):
    rows over a shared prefix are then computed one by one."""
    from runner.cache.kinds import kind_of  # kinds builds SharedPrefixKV: imported late

    return sorted({k.name for k in map(kind_of, model.make_caches()) if not k.batches})


def broadcast(kinds: list[Any], caches: list[Any], batch: int) -> list[Any]:
    """Batched caches for `batch` rows over the state in `caches` (one kind per cache)."""
    return [kind.broadcast(c, batch) for kind, c in zip(kinds, caches, strict=True)]


def forward_suffixes(
    model: Any, batch_caches: list[Any], suffixes: list[list[int]], layout: Any = None
) -> mx.array:
    """The final hidden states [B, W, H] of the suffixes, right-padded to the longest (W),
    computed over the batched caches (lazily); `layout`: the prefix's position layout, if
    its prompt has one (runner/media/prepare.py), shared by every row."""
    width = max(len(s) for s in suffixes)
    padded = mx.array([s + [0] * (width - len(s)) for s in suffixes], dtype=mx.int32)
    if layout is not None:
        return model.hidden(padded, batch_caches, None, layout=layout)
    return model.hidden(padded, batch_caches)


# Tolerances for `verify_batched_rows`, relative to the largest hidden value: float32 rounding
# differs between the two paths by ~1e-6; half precision by ~1e-2. A batch that lost its
# prefix is off by the whole prefix's attention (tens of percent).
_TOLERANCE = {mx.float32: 1e-3, mx.float16: 5e-2, mx.bfloat16: 5e-2}


def verify_batched_rows(model: Any) -> None:
    """Raise ModelLoadError unless rows batched over a shared prefix give the hidden states
    the same rows give alone, on `model` itself (a few tokens; run on the MLX thread): on
    every path its forwards may take, MLX's included where a native step usually runs them
    (runner/backend/native_step.py declines some forwards)."""
    _verify_batched_rows(model)
    mlx_only = getattr(model, "mlx_only", None)
    if mlx_only is not None:
        with mlx_only():
            _verify_batched_rows(model)


def _verify_batched_rows(model: Any) -> None:
    from runner.cache.kinds import kind_of  # kinds builds SharedPrefixKV: imported late

    vocab = model.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(11)]
    prefix, suffixes = ids[:6], [ids[6:9], ids[9:11]]
    caches = model.make_caches()
    kinds = [kind_of(c) for c in caches]
    model.hidden(mx.array([prefix], dtype=mx.int32), caches)
    if not all(kind.batches for kind in kinds):  # scoring runs rows one by one
        return
    batched = forward_suffixes(model, broadcast(kinds, caches, len(suffixes)), suffixes)
    worst, largest = 0.0, 0.0
    for i, suffix in enumerate(suffixes):
        alone = model.hidden(mx.array([prefix + suffix], dtype=mx.int32), model.make_caches())
        expected = np.array(alone[0, len(prefix) :].astype(mx.float32))
        got = np.array(batched[i, : len(suffix)].astype(mx.float32))
        worst = max(worst, float(np.abs(got - expected).max()))
        largest = max(largest, float(np.abs(expected).max()))
    tolerance = _TOLERANCE.get(batched.dtype, 5e-2)
    if not worst <= tolerance * max(largest, 1.0):
        import mlx_lm

        raise ModelLoadError(
            f"rows batched over a shared prefix differ from the same rows alone by {worst:.3g} "
            f"(largest value {largest:.3g}) on {model.architecture}: the runner's attention is "
            f"not in effect on every attention layer with mlx-lm {mlx_lm.__version__}; "
            "refusing to load rather than score wrongly"
        )
