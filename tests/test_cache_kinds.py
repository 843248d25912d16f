"""Cache kinds on real mlx-lm caches: snapshots restore exactly what was captured."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from runner.cache.kinds import HIDDEN, KV, RECURRENT, ROTATING, HiddenRows


def kv_with(n: int, seed: int = 0) -> KVCache:
    cache = KVCache()
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, 2, n, 4)).astype(np.float32))
    cache.update_and_fetch(k, k * 2)
    return cache


def test_kv_segments_split_merge_and_install_round_trip():
    live = kv_with(10)
    whole = KV.capture(live, 0, 10)
    head, tail = KV.split(whole, 4)
    assert (head.start, head.end, tail.start, tail.end) == (0, 4, 4, 10)
    merged = KV.merge(head, tail)
    assert np.array_equal(np.array(merged.arrays[0]), np.array(whole.arrays[0]))
    target = KVCache()
    KV.install(target, [head, tail], 7)
    assert target.offset == 7
    assert np.array_equal(np.array(target.keys), np.array(live.keys[..., :7, :]))


def test_kv_snapshot_survives_later_in_place_writes():
    live = kv_with(6)
    snap = KV.capture(live, 0, 6)
    mx.eval(*snap.evaluate())
    before = np.array(snap.arrays[0])
    KV.rewind(live, 6, 2)
    live.update_and_fetch(mx.zeros((1, 2, 4, 4)), mx.zeros((1, 2, 4, 4)))
    mx.eval(live.keys)
    assert np.array_equal(np.array(snap.arrays[0]), before)


def test_hidden_rows_split_merge_and_row_lookup():
    rows = HiddenRows()
    rows.append(mx.arange(12, dtype=mx.float32).reshape(1, 6, 2))
    snap = HIDDEN.capture(rows, 0, 6)
    head, tail = HIDDEN.split(snap, 2)
    assert HIDDEN.row(tail, 3).tolist() == [[6.0, 7.0]]
    assert np.array_equal(np.array(HIDDEN.merge(head, tail).arrays[0]), np.array(snap.arrays[0]))


def test_rotating_window_restores_only_at_its_end_and_rewinds_only_before_wrapping():
    live = RotatingKVCache(max_size=4)
    live.update_and_fetch(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    assert ROTATING.can_rewind(live, 3, 1)
    snap = ROTATING.capture(live, 3, 3)
    live.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))  # wraps past 4
    assert not ROTATING.can_rewind(live, 6, 4) and ROTATING.can_rewind(live, 6, 6)
    ROTATING.install(live, [snap], 3)
    assert live.offset == 3
    assert np.array_equal(np.array(live.keys[..., :3, :]), np.ones((1, 1, 3, 2)))
    assert ROTATING.split(snap, 1) == (None, snap)


def test_recurrent_state_restores_exactly():
    live = ArraysCache(size=2)
    live[0], live[1] = mx.ones((1, 3)), mx.full((1, 2), 5.0)
    snap = RECURRENT.capture(live, 7, 7)
    live[1] = mx.zeros((1, 2))
    assert RECURRENT.can_rewind(live, 7, 7) and not RECURRENT.can_rewind(live, 7, 6)
    RECURRENT.install(live, [snap], 7)
    assert live[1].tolist() == [[5.0, 5.0]]
    assert RECURRENT.merge(None, snap) is snap
