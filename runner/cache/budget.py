"""One byte budget over every prefix cache of the runner (scoring's and generation's)."""

from __future__ import annotations

import os
from typing import Protocol

DEFAULT_BUDGET_BYTES = 8 << 30
BUDGET_ENV = "OLLAMA_MLX_RUNNER_CACHE_BYTES"


def budget_from_env(default: int = DEFAULT_BUDGET_BYTES) -> int:
    value = os.environ.get(BUDGET_ENV, "").strip()
    return int(value) if value else default


class Member(Protocol):
    @property
    def nbytes(self) -> int: ...


class ByteBudget:
    """One byte limit for every prefix cache of the runner; each member evicts only its own
    nodes when the total is over."""

    def __init__(self, limit: int = DEFAULT_BUDGET_BYTES):
        self.limit = limit
        self.members: list[Member] = []

    @property
    def used(self) -> int:
        return sum(c.nbytes for c in self.members)

    @property
    def over(self) -> bool:
        return self.used > self.limit
