"""The arrays live mlx-lm caches hold, to evaluate them together after a chunk."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def live_arrays(caches: list[Any]) -> list[mx.array]:
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
