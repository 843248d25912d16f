"""`/v1/score`: validate a decision request, then compute candidate logits (CONTRACT.md §3).

Two halves with different homes:
- `prepare_rows` tokenizes and validates, off the MLX thread. Rules and messages are the Go
  handler's (shared/seed/score.go), checked in its order; the first failure is the answer.
- `Scorer.score` runs on the MLX thread. Each row opens a session of the scoring prefix
  cache, which restores the longest stored prefix and prefills the rest in chunks through
  `RunnerModel.hidden` (no vocabulary logits at prompt positions); then only the candidate
  rows of the output projection are computed at the last position (`unembed_candidates`,
  float32). The rows' shared prefix is scheduled as a snapshot point, so rows after the
  first restore it exactly (recurrent layers need that exact offset); a row whose whole
  prompt is stored reuses its stored hidden row and computes nothing.

`cached_tokens` counts, per row, the tokens restored instead of computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from .cache.session import CacheSession
from .errors import BadRequest, go_quote
from .models import RunnerModel
from .tokenizer import Tokenizer
from .wire import ScoreRequest

log = logging.getLogger(__name__)

MAX_ROWS = 64
MAX_CANDIDATES = 26


@dataclass(frozen=True)
class Row:
    tokens: list[int]
    candidates: list[int]


def prepare_rows(
    request: ScoreRequest, tokenizer: Tokenizer, context_length: int, vocab_size: int
) -> list[Row]:
    """Tokenize and validate every row; raises BadRequest with the Go handler's text."""
    if not 1 <= len(request.rows) <= MAX_ROWS:
        raise BadRequest(f"scoring requires 1–{MAX_ROWS} prompts")
    max_tokens = request.maxtokens
    if not 1 <= max_tokens <= context_length:
        raise BadRequest(f"max_tokens must be between 1 and {context_length}")
    # An id must index both the tokenizer's table and the model's output rows.
    id_limit = min(tokenizer.vocab_size, vocab_size)
    rows: list[Row] = []
    for i, row in enumerate(request.rows):
        tokens = tokenizer.encode(row.prompt)
        if not 1 <= len(tokens) <= max_tokens:
            raise BadRequest(
                f"prompt {i} has {len(tokens)} tokens; expected 1–{max_tokens} "
                "(input is never truncated)"
            )
        if not 1 <= len(row.candidates) <= MAX_CANDIDATES:
            raise BadRequest(f"prompt {i} requires 1–{MAX_CANDIDATES} candidates")
        candidates: list[int] = []
        for candidate in row.candidates:
            joined = tokenizer.encode(row.prompt + candidate)
            if (
                tokenizer.is_special(candidate)
                or len(joined) != len(tokens) + 1
                or joined[: len(tokens)] != tokens
            ):
                raise BadRequest(
                    f"candidate {go_quote(candidate)} must append exactly one ordinary token "
                    f"to prompt {i}"
                )
            token = joined[-1]
            if not 0 <= token < id_limit or token in candidates:
                raise BadRequest(f"prompt {i} has invalid or duplicate candidate tokens")
            candidates.append(token)
        rows.append(Row(tokens, candidates))
    return rows


def shared_prefix_length(rows: Sequence[Row]) -> int:
    """Tokens every row starts with (0 for a single row: there is nothing to share)."""
    if len(rows) < 2:
        return 0
    n = len(rows[0].tokens)
    first = rows[0].tokens
    for row in rows[1:]:
        n = min(n, len(row.tokens))
        for j in range(n):
            if row.tokens[j] != first[j]:
                n = j
                break
    return n


@dataclass
class ScoreResult:
    logits: list[list[float]]
    cached_tokens: int


class Scorer:
    """Computes candidate logits for validated rows; call only on the MLX thread.

    `begin(tokens, schedule)` opens a cache session per row (a PrefixCache's `begin`, or
    fresh caches); the rows' shared prefix is scheduled as a snapshot point, so every row
    after the first restores it instead of computing it.
    """

    def __init__(self, model: RunnerModel, begin: Callable[..., CacheSession]):
        self.model = model
        self.begin = begin

    def score(self, rows: Sequence[Row], check: Callable[[], None]) -> ScoreResult:
        """`check` raises to stop (cancellation); it is called before every chunk."""
        start = time.perf_counter()
        prefix = shared_prefix_length(rows)
        logits: list[list[float]] = []
        cached = 0
        for row in rows:
            check()
            session = self.begin(row.tokens, [prefix] if prefix else [])
            try:
                cached += session.offset
                hidden = session.hidden_row
                if hidden is None:
                    hidden = session.prefill(len(row.tokens), check)
                ids = mx.array(row.candidates, dtype=mx.int32)
                selected = self.model.unembed_candidates(hidden, ids)
                logits.append(selected.astype(mx.float32).reshape(-1).tolist())
            finally:
                session.close()
        log.info(
            "scored rows=%d shared_prefix=%d cached=%d seconds=%.3f",
            len(rows),
            prefix,
            cached,
            time.perf_counter() - start,
        )
        return ScoreResult(logits, cached)
