"""Rows batched over one shared prefix: the batched caches and the batched forward.

Scoring rows that share a prefix computes the prefix once into the live caches, then runs
every row's own suffix as one padded batch over it (`forward_suffixes`). Each cache kind
makes its batched cache (`Kind.broadcast`); full attention uses `SharedPrefixKV`
(runner/cache/shared_prefix.py), which keeps the prefix K/V once and only the suffixes per
row.

Invariant: right padding is harmless: every layer is causal, so a row's last real position
never sees the padding after it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from runner.cache.kinds import kind_of


def unbatched_kinds(model: Any) -> list[str]:
    """The names of the model's cache kinds that cannot be batched (`Kind.batches` false):
    rows over a shared prefix are then computed one by one."""
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
