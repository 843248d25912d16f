"""Whole-state snapshots of mlx-lm caches, for restoring a shared prefix within a request.

mlx-lm caches write in place: `cache.keys[..., a:b, :] = k` rebinds the *Python array object*
they hold, so any other holder of that same object would see the write. A snapshot therefore
never shares array objects with a live cache: it keeps fresh views of the state arrays at
the moment it is taken, and a restore installs fresh views again (views are cheap; a later
in-place write into a shared buffer copies instead of overwriting it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def _fresh(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value[:] if value.ndim else value
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value


def take(caches: list[Any]) -> list[Any]:
    """A snapshot of every cache's full state (mlx-lm's `state` covers offsets too)."""
    return [_fresh(c.state) if c is not None else None for c in caches]


def restore(caches: list[Any], snapshot: list[Any]) -> None:
    """Put the caches back to `snapshot`; the snapshot stays valid for further restores."""
    for cache, state in zip(caches, snapshot, strict=True):
        if cache is not None:
            cache.state = _fresh(state)


def arrays(caches: list[Any]) -> list[mx.array]:
    """Every array the caches hold, to evaluate them after a chunk."""
    out: list[mx.array] = []

    def collect(value: Any) -> None:
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, list | tuple):
            for v in value:
                collect(v)

    for cache in caches:
        if cache is not None:
            collect(cache.state)
    return out
