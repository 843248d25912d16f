"""Cache kinds: how each kind of per-layer cache is snapshotted, restored, split and merged.

The live caches are mlx-lm's own objects (`KVCache`, `RotatingKVCache`, `ArraysCache`), so
mlx-lm's model code writes into them unchanged; a `Kind` knows how to move one of them
between states. Plus `HiddenRows`, our cache of the final hidden rows (scoring keeps them
so a full prefix hit can score without recomputing).

| kind      | snapshot covers             | live rewind to t        | restore from snapshots  |
|-----------|-----------------------------|-------------------------|-------------------------|
| KV        | its node's edge [start,end) | any t <= offset         | segments [0, t), any t  |
| rotating  | whole window at `end`       | t == offset, or unwrapped | exactly at `end`      |
| recurrent | whole state at `end`        | t == offset only        | exactly at `end`        |
| hidden    | its node's edge [start,end) | any                     | never paged in          |

Snapshots own their arrays (`mx.array(x)` copies): a snapshot that shared a live buffer
would make every later in-place cache write copy the whole buffer (measured: 25x slower
per decode write), and would be clobbered by it when not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from runner.cache.shared_prefix import SharedPrefixKV


@dataclass
class Snap:
    """One slot's snapshot on one trie node: an edge segment, or a state at `end`."""

    start: int
    end: int
    arrays: tuple[Any, ...]
    extra: tuple[Any, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if isinstance(a, mx.array))

    def evaluate(self) -> list[mx.array]:
        return [a for a in self.arrays if isinstance(a, mx.array)]


def _own(x: mx.array | None) -> mx.array | None:
    return None if x is None else mx.array(x)


def _own_positions(x: mx.array, start: int, end: int) -> mx.array:
    """x[..., start:end, :] (positions on the second axis from the end) as an array of its
    own (`_own_slice`; a live state is settled, so evaluated, before it is captured)."""
    return _own_slice(x, x.ndim - 2, slice(start, end))


def _own_slice(x: mx.array, axis: int, which: slice) -> mx.array:
    """x sliced along `axis` as an array of its own. A float32 or float16 array is copied
    through numpy's view of it (evaluating it if it is not): ~8 us an array against ~15 for
    MLX's lazy copy evaluated with the others (SmolLM2 stores 61 a request: 0.48 against
    0.92 ms), and a trie split's snapshots no longer take an MLX evaluation each (~6 ms a
    node). Other dtypes (numpy has no bfloat16) take MLX's copy."""
    index = [slice(None)] * x.ndim
    index[axis] = which
    if x.dtype in (mx.float32, mx.float16):
        return mx.array(np.ascontiguousarray(np.asarray(x)[tuple(index)]))
    return mx.array(x[tuple(index)])


class Kind:
    """Per-kind operations; `cache` is the live object, `offset` the tokens it holds."""

    name = "kind"
    point = False  # True: snapshots are whole states at one offset
    batches = False  # True: `broadcast` makes a batched cache (runner/cache/batch.py)

    def capture(self, cache: Any, start: int, end: int) -> Snap | None:
        raise NotImplementedError

    def can_rewind(self, cache: Any, offset: int, target: int) -> bool:
        raise NotImplementedError

    def rewind(self, cache: Any, offset: int, target: int) -> None:
        raise NotImplementedError

    def install(self, cache: Any, snaps: list[Snap], target: int) -> None:
        """Make `cache` hold exactly [0, target) from `snaps` (segments in order, or the one
        point snapshot ending at target); target 0 empties it."""
        raise NotImplementedError

    def split(self, snap: Snap, at: int) -> tuple[Snap | None, Snap | None]:
        """Split at absolute offset `at`: point kinds keep the whole state on the tail."""
        return None, snap

    def merge(self, parent: Snap | None, child: Snap | None) -> Snap | None:
        """Join adjacent snapshots: point kinds keep the child's state."""
        return child

    def close(self, snap: Snap) -> None:
        """A snapshot leaves the trie (dropped, or consumed by split/merge). Arrays are freed
        by reference counting; fakes in the tests track that every snapshot is closed once."""

    def broadcast(self, cache: Any, batch: int) -> Any:
        """A new cache of the same kind whose state is `cache`'s repeated over `batch` rows
        (a lazy broadcast: rows are materialised only when the batch writes)."""
        raise NotImplementedError(f"{self.name} caches cannot be batched")

    def row_segment(self, cache: Any, row: int, start: int, end: int) -> Snap | None:
        """Row `row` of a batched cache as this kind's snapshot of [start, end), or None when
        the kind keeps no such snapshot (point kinds: a padded batch ran past the row's end)."""
        return None

    def bytes_per_token(self, cache: Any) -> int:
        """Bytes one more token costs a batched row of this cache (only KV grows)."""
        return 0


class KVKind(Kind):
    name = "kv"
    batches = True

    def capture(self, cache: KVCache, start: int, end: int) -> Snap | None:
        if end <= start or cache.keys is None:
            return None
        keys = _own_positions(cache.keys, start, end)
        values = _own_positions(cache.values, start, end)
        return Snap(start, end, (keys, values))

    def can_rewind(self, cache: KVCache, offset: int, target: int) -> bool:
        return target <= offset

    def rewind(self, cache: KVCache, offset: int, target: int) -> None:
        cache.offset = target

    def install(self, cache: KVCache, snaps: list[Snap], target: int) -> None:
        if target == 0:
            cache.keys = cache.values = None
            cache.offset = 0
            return
        parts = [s for s in snaps if s.start < target]
        assert (
            parts
            and parts[0].start == 0
            and all(a.end == b.start for a, b in itertools.pairwise(parts))
        ), "KV segments must cover [0, target) without gaps"
        keys = mx.concatenate([s.arrays[0] for s in parts], axis=2)[..., :target, :]
        values = mx.concatenate([s.arrays[1] for s in parts], axis=2)[..., :target, :]
        cache.keys, cache.values, cache.offset = keys, values, target

    def broadcast(self, cache: KVCache, batch: int) -> KVCache:
        if cache.keys is None:
            return KVCache()
        # The prefix stays one copy; attention reads it once for every row.
        keys = cache.keys[..., : cache.offset, :]
        values = cache.values[..., : cache.offset, :]
        return SharedPrefixKV(keys, values, batch)

    def bytes_per_token(self, cache: KVCache) -> int:
        if cache.keys is None or not cache.keys.shape[2]:
            return 0
        return 2 * cache.keys.nbytes // (cache.keys.shape[0] * cache.keys.shape[2])

    def row_segment(self, cache: KVCache, row: int, start: int, end: int) -> Snap | None:
        if isinstance(cache, SharedPrefixKV):
            keys, values = cache.segment(row, start, end)
        else:
            keys = cache.keys[row : row + 1, :, start:end, :]
            values = cache.values[row : row + 1, :, start:end, :]
        return Snap(start, end, (mx.array(keys), mx.array(values)))

    def split(self, snap: Snap, at: int) -> tuple[Snap | None, Snap | None]:
        return _split_along(snap, at, axis=2)

    def merge(self, parent: Snap | None, child: Snap | None) -> Snap | None:
        return _merge_along(parent, child, axis=2)


class RotatingKind(Kind):
    """Sliding-window attention: a wrapped ring cannot be rewound or cut."""

    name = "rotating"
    point = True
    batches = True

    def capture(self, cache: RotatingKVCache, start: int, end: int) -> Snap | None:
        if cache.keys is None:
            return None
        return Snap(end, end, (_own(cache.keys), _own(cache.values)), (cache.offset, cache._idx))

    def broadcast(self, cache: RotatingKVCache, batch: int) -> RotatingKVCache:
        out = RotatingKVCache(cache.max_size, cache.keep)
        if cache.keys is not None:
            out.keys = mx.broadcast_to(cache.keys, (batch, *cache.keys.shape[1:]))
            out.values = mx.broadcast_to(cache.values, (batch, *cache.values.shape[1:]))
            out.offset, out._idx = cache.offset, cache._idx
        return out

    def can_rewind(self, cache: RotatingKVCache, offset: int, target: int) -> bool:
        return target == offset or (target < offset and cache.offset < cache.max_size)

    def rewind(self, cache: RotatingKVCache, offset: int, target: int) -> None:
        if target != offset:
            cache.trim(offset - target)

    def install(self, cache: RotatingKVCache, snaps: list[Snap], target: int) -> None:
        if target == 0:
            cache.keys = cache.values = None
            cache.offset = cache._idx = 0
            return
        (snap,) = snaps
        assert snap.end == target, "a window restores only where it was taken"
        # Fresh views: the ring writes in place into the object it holds, and must not
        # write into the snapshot's (MLX copies the shared buffer on that first write).
        keys, values = snap.arrays
        cache.keys, cache.values = keys[:], values[:]
        cache.offset, cache._idx = snap.extra


class RecurrentKind(Kind):
    """Gated-delta / SSM state: intermediate states cannot be recovered."""

    name = "recurrent"
    point = True
    batches = True

    def capture(self, cache: ArraysCache, start: int, end: int) -> Snap | None:
        if cache.cache[0] is None:
            return None
        # mlx-lm's recurrent layers rebind their state arrays instead of writing into them,
        # so holding references is safe and free.
        return Snap(end, end, tuple(cache.cache))

    def broadcast(self, cache: ArraysCache, batch: int) -> ArraysCache:
        out = ArraysCache(len(cache.cache))
        out.cache = [
            None if a is None else mx.broadcast_to(a, (batch, *a.shape[1:])) for a in cache.cache
        ]
        return out

    def can_rewind(self, cache: ArraysCache, offset: int, target: int) -> bool:
        return target == offset

    def rewind(self, cache: ArraysCache, offset: int, target: int) -> None:
        assert target == offset

    def install(self, cache: ArraysCache, snaps: list[Snap], target: int) -> None:
        if target == 0:
            cache.cache = [None] * len(cache.cache)
            return
        (snap,) = snaps
        assert snap.end == target, "a recurrent state restores only where it was taken"
        cache.cache = list(snap.arrays)


class HiddenRows:
    """The final hidden rows of the positions fed since `base` ([1, n, H])."""

    def __init__(self) -> None:
        self.base = 0
        self.rows: mx.array | None = None

    def append(self, hidden: mx.array) -> None:
        self.rows = hidden if self.rows is None else mx.concatenate([self.rows, hidden], axis=1)

    def reset(self, base: int) -> None:
        self.base, self.rows = base, None

    @property
    def offset(self) -> int:
        return self.base + (0 if self.rows is None else self.rows.shape[1])


class HiddenKind(Kind):
    name = "hidden"

    def capture(self, cache: HiddenRows, start: int, end: int) -> Snap | None:
        if end <= start or cache.rows is None or start < cache.base:
            return None
        rows = _own_positions(cache.rows, start - cache.base, end - cache.base)
        return Snap(start, end, (rows,))

    def can_rewind(self, cache: HiddenRows, offset: int, target: int) -> bool:
        return True

    def rewind(self, cache: HiddenRows, offset: int, target: int) -> None:
        # The rows before `target` are dropped, not kept: the prefix cache rewinds only to a
        # restore point, whose tokens are all in the trie, so its captures start at or past
        # it (and keeping them cost a copy of every kept row at the next append: ~0.3 ms a
        # decision request over a 483-token prompt).
        cache.reset(target)

    def install(self, cache: HiddenRows, snaps: list[Snap], target: int) -> None:
        cache.reset(target)  # rows before the restore point are read from the trie, not paged in

    def split(self, snap: Snap, at: int) -> tuple[Snap | None, Snap | None]:
        return _split_along(snap, at, axis=1)

    def merge(self, parent: Snap | None, child: Snap | None) -> Snap | None:
        return _merge_along(parent, child, axis=1)

    @staticmethod
    def row(snap: Snap, position: int) -> mx.array:
        return snap.arrays[0][0, position - snap.start : position - snap.start + 1, :]


def _split_along(snap: Snap, at: int, axis: int) -> tuple[Snap | None, Snap | None]:
    """Cut an edge snapshot at absolute offset `at`; its arrays run along `axis`."""
    if at <= snap.start:
        return None, snap
    if at >= snap.end:
        return snap, None
    cut = at - snap.start
    head = tuple(_own_slice(a, axis, slice(None, cut)) for a in snap.arrays)
    tail = tuple(_own_slice(a, axis, slice(cut, None)) for a in snap.arrays)
    return Snap(snap.start, at, head), Snap(at, snap.end, tail)


def _merge_along(parent: Snap | None, child: Snap | None, axis: int) -> Snap | None:
    """Join adjacent edge snapshots (nothing when either side is missing)."""
    if parent is None or child is None:
        return None
    joined = tuple(
        mx.concatenate([a, b], axis=axis) for a, b in zip(parent.arrays, child.arrays, strict=True)
    )
    return Snap(parent.start, child.end, joined)


KV = KVKind()
ROTATING = RotatingKind()
RECURRENT = RecurrentKind()
HIDDEN = HiddenKind()


@runtime_checkable
class OwnKind(Protocol):
    """A cache object that names its own kind (GLM's latent caches, the test fakes)."""

    prefix_kind: Kind


def kind_of(cache: Any) -> Kind:
    """The kind of an mlx-lm cache object (checked most specific first): its own, where it
    names one (`OwnKind`)."""
    if isinstance(cache, OwnKind) and isinstance(cache.prefix_kind, Kind):
        return cache.prefix_kind
    if isinstance(cache, SharedPrefixKV):
        raise TypeError("a batched cache is never a prefix cache's live cache")
    if isinstance(cache, RotatingKVCache):
        return ROTATING
    if isinstance(cache, KVCache):
        return KV
    if isinstance(cache, ArraysCache):
        return RECURRENT
    if isinstance(cache, HiddenRows):
        return HIDDEN
    raise TypeError(f"no prefix-cache kind for {type(cache).__name__}")
