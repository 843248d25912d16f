"""Fake caches that store the real token lists they were fed, so prefix-cache tests check
*what* was restored, plus a tracker that fails on leaked or double-closed snapshots.

Layouts mirror the Go runner's test environments: KV only; KV + sliding window (size 4);
KV + recurrent; recurrent + KV + recurrent. The fake model's hidden row for a position is
the token id there, so a stored hidden row can be checked too.
"""

from __future__ import annotations

import mlx.core as mx

from runner.cache.kinds import Kind, Snap


def _bytes(n: int) -> tuple[mx.array, ...]:
    """Fake payload: 4 bytes a token, so the byte budget sees realistic sizes."""
    return (mx.zeros((n,), dtype=mx.float32),)


class Tracker:
    def __init__(self) -> None:
        self.live: dict[int, Snap] = {}
        self.closed: set[int] = set()

    def made(self, snap: Snap) -> Snap:
        self.live[id(snap)] = snap
        return snap

    def close(self, snap: Snap) -> None:
        assert id(snap) in self.live, "closed a snapshot twice (or one never made)"
        del self.live[id(snap)]
        self.closed.add(id(snap))

    def check(self, stored: list[Snap]) -> None:
        """Every snapshot made is stored in the trie exactly once, or was closed."""
        ids = [id(s) for s in stored]
        assert len(ids) == len(set(ids)), "a snapshot is stored twice"
        assert set(ids) == set(self.live), (
            f"leaked={len(set(self.live) - set(ids))} unknown={len(set(ids) - set(self.live))}"
        )


class FakeCache:
    """Holds the tokens fed; a window keeps only whether it wrapped past its size."""

    def __init__(self, kind: Kind):
        self.prefix_kind = kind
        self.tokens: list[int] = []

    @property
    def state(self) -> list:
        return []


class FakeKV(Kind):
    name = "fake-kv"

    def __init__(self, tracker: Tracker):
        self.tracker = tracker

    def capture(self, cache, start, end):
        if end <= start:
            return None
        return self.tracker.made(
            Snap(start, end, _bytes(end - start), (tuple(cache.tokens[start:end]),))
        )

    def can_rewind(self, cache, offset, target):
        return target <= offset

    def rewind(self, cache, offset, target):
        del cache.tokens[target:]

    def install(self, cache, snaps, target):
        tokens: list[int] = []
        for s in snaps:
            assert s.start == len(tokens), "segments must be contiguous from 0"
            tokens.extend(s.extra[0])
        cache.tokens = tokens[:target]
        assert len(cache.tokens) == target

    def split(self, snap, at):
        if at <= snap.start:
            return None, snap
        if at >= snap.end:
            return snap, None
        cut = at - snap.start
        t = snap.extra[0]
        return (
            self.tracker.made(Snap(snap.start, at, _bytes(cut), (t[:cut],))),
            self.tracker.made(Snap(at, snap.end, _bytes(len(t) - cut), (t[cut:],))),
        )

    def merge(self, parent, child):
        if parent is None or child is None:
            return None
        tokens = parent.extra[0] + child.extra[0]
        return self.tracker.made(Snap(parent.start, child.end, _bytes(len(tokens)), (tokens,)))

    def close(self, snap):
        self.tracker.close(snap)


class FakePoint(Kind):
    """A whole-state kind: recurrent (exact rewind only) or a window of `size` tokens."""

    point = True

    def __init__(self, tracker: Tracker, window: int | None = None):
        self.tracker = tracker
        self.window = window
        self.name = "fake-window" if window else "fake-recurrent"

    def capture(self, cache, start, end):
        if not cache.tokens:
            return None
        assert len(cache.tokens) == end
        return self.tracker.made(Snap(end, end, _bytes(self.window or 8), (tuple(cache.tokens),)))

    def can_rewind(self, cache, offset, target):
        if target == offset:
            return True
        return self.window is not None and offset < self.window and target < offset

    def rewind(self, cache, offset, target):
        del cache.tokens[target:]

    def install(self, cache, snaps, target):
        if target == 0:
            cache.tokens = []
            return
        (snap,) = snaps
        assert snap.end == target
        cache.tokens = list(snap.extra[0])

    def close(self, snap):
        self.tracker.close(snap)


LAYOUTS = {
    "kv": ("kv",),
    "window": ("kv", "window"),
    "recurrent": ("kv", "recurrent"),
    "hybrid": ("recurrent", "kv", "recurrent"),
}


class FakeModel:
    """make_caches() builds the layout's fake caches; hidden() feeds every cache."""

    def __init__(self, layout: str, tracker: Tracker):
        self.layout = LAYOUTS[layout]
        self.tracker = tracker
        self.kinds = {
            "kv": FakeKV(tracker),
            "window": FakePoint(tracker, window=4),
            "recurrent": FakePoint(tracker),
        }
        self.forwards: list[list[int]] = []
        self.fail_next = False

    def make_caches(self) -> list[FakeCache]:
        return [FakeCache(self.kinds[k]) for k in self.layout]

    def hidden(self, tokens: mx.array, caches: list[FakeCache]) -> mx.array:
        ids = tokens[0].tolist()
        self.forwards.append(ids)
        for i, cache in enumerate(caches):
            if self.fail_next and i == len(caches) // 2:
                self.fail_next = False
                raise RuntimeError("forward failed half way")
            cache.tokens.extend(ids)
        return mx.array(ids, dtype=mx.float32).reshape(1, len(ids), 1)
