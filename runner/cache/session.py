"""A cache session: the live caches one request computes into, and how it feeds a prompt.

This is the interface between the request pipelines (scoring, generation) and the prefix
cache. `begin(tokens)` on a cache provider returns a session whose caches already hold the
first `offset` prompt tokens (restored, not computed); the pipeline then calls `prefill` to
feed the rest, `append` for every token it feeds after the prompt (decode), and `close`
once (also after a failure or cancellation).

`FreshSession` is the provider with no memory: every session starts from empty caches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .live import live_arrays

PREFILL_CHUNK_TOKENS = 2048


class CacheSession:
    """Contract every provider's session keeps.

    - `caches` are the model's live caches (one per layer); they hold exactly the first
      `offset` tokens of `tokens` after `begin`, and every token fed since afterwards.
    - `offset` <= len(tokens) - 1 unless a stored hidden row covers the whole prompt
      (`hidden_row` is then set and nothing needs computing).
    - `prefill(end, check)` feeds tokens[offset:end] in chunks, calling `check()` before
      each chunk (it raises to cancel), evaluates the caches after each chunk, and returns
      the hidden row of the last fed position ([1, H]). Tokens crossed before a failure stay
      fed and recorded.
    - `append(token)` records a token the pipeline fed through `caches` itself (decode),
      after that forward was evaluated. If such a forward raises, call `fail()`: the caches
      may be half-written and must not be stored.
    - `close()` stores what the session computed (where a provider remembers anything).
    """

    tokens: list[int]
    caches: list[Any]
    offset: int
    hidden_row: mx.array | None = None

    def prefill(self, end: int, check: Callable[[], None]) -> mx.array:
        raise NotImplementedError

    def append(self, token: int) -> None:
        raise NotImplementedError

    def fail(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class FreshSession(CacheSession):
    """Empty caches, nothing remembered: the baseline every prefix cache must equal."""

    def __init__(self, model: Any, tokens: list[int], chunk_tokens: int = PREFILL_CHUNK_TOKENS):
        self.model = model
        self.tokens = list(tokens)
        self.caches = model.make_caches()
        self.offset = 0
        self.fed = 0
        self.chunk_tokens = chunk_tokens

    def prefill(self, end: int, check: Callable[[], None]) -> mx.array:
        last: mx.array | None = None
        while self.fed < end:
            check()
            n = min(self.chunk_tokens, end - self.fed)
            chunk = mx.array(self.tokens[self.fed : self.fed + n], dtype=mx.int32)[None]
            last = self.model.hidden(chunk, self.caches)[0, -1:, :]
            mx.eval(last, *live_arrays(self.caches))
            self.fed += n
        assert last is not None, "prefill needs at least one token"
        return last

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.fed += 1

    def fail(self) -> None:
        self.caches = []

    def close(self) -> None:
        self.caches = []


def fresh_sessions(model: Any) -> Callable[..., CacheSession]:
    """A provider with the PrefixCache.begin signature that remembers nothing."""
    return lambda tokens, schedule=(): FreshSession(model, tokens)
