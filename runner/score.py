"""`/v1/score`: validate a decision request, then compute candidate logits (CONTRACT.md §3).

Two halves with different homes:
- `prepare_rows` tokenizes and validates, off the MLX thread. Rules and messages are the Go
  handler's (shared/seed/score.go), checked in its order; the first failure is the answer.
- `Scorer.score` runs on the MLX thread. A row whose whole prompt is stored reuses its
  stored hidden row and computes nothing. Rows that share a prefix are computed together:
  the prefix once (restored from the scoring prefix cache where possible), then all the
  unshared suffixes as one batch over it. Other rows open one prefix-cache session each,
  prefilled in chunks. Everything goes through `RunnerModel.hidden` (no vocabulary logits
  at prompt positions); only the candidate rows of the output projection are computed at
  the last position (`unembed_candidates`, float32).

`cached_tokens` counts, per row, the tokens restored instead of computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from .cache.prefix_cache import PrefixCache
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


BATCH_BYTES = 1 << 30  # the batched caches of one chunk of rows
BATCH_MAX_SUFFIX = 256  # rows with longer unshared parts are prefilled one by one
# Suffix tokens per batched forward. On a CPU very wide batches fall out of the caches:
# 64 rows of 16 tokens over a 512-token prefix (Qwen3-0.6B shape) took 15.0 s in one batch
# and 9.9 s in batches of 16 with MLX's softmax; with numpy's (runner/models/cpu_ufuncs.py)
# the batches' forwards take 6.5 s in batches of 16 and 5.9 s in batches of 32. GPUs want
# them wide.
BATCH_TOKENS_CPU = 512
BATCH_TOKENS_GPU = 8192


class Scorer:
    """Computes candidate logits for validated rows; call only on the MLX thread.

    `sessions` is the scoring PrefixCache (or any `begin(tokens, schedule)` provider, such as
    fresh caches). With a PrefixCache, rows that share a prefix and are not already stored
    are scored together: the prefix is restored or computed once, then the rows' unshared
    suffixes run as one padded batch over the prefix state (broadcast, not copied), which
    turns many thin forwards into one wide one; the rows are then stored for later requests.
    Otherwise each row opens its own session, and the rows' shared prefix is scheduled as a
    snapshot point so later rows restore it.
    """

    def __init__(self, model: RunnerModel, sessions: PrefixCache | Callable[..., CacheSession]):
        self.model = model
        self.cache = sessions if isinstance(sessions, PrefixCache) else None
        self.begin = sessions.begin if isinstance(sessions, PrefixCache) else sessions

    def score(self, rows: Sequence[Row], check: Callable[[], None]) -> ScoreResult:
        """`check` raises to stop (cancellation); it is called before every chunk."""
        start = time.perf_counter()
        prefix = shared_prefix_length(rows)
        hidden: list[mx.array | None] = [None] * len(rows)
        cached = 0
        pending = list(range(len(rows)))
        if self.cache is not None and prefix:
            for i, row in enumerate(rows):
                hidden[i] = self.cache.stored_hidden_row(row.tokens)
            pending = [i for i in pending if hidden[i] is None]
            cached += sum(len(rows[i].tokens) for i in range(len(rows)) if hidden[i] is not None)
            batchable = [i for i in pending if len(rows[i].tokens) - prefix <= BATCH_MAX_SUFFIX]
            if len(batchable) > 1:
                cached += self._score_batched(rows, batchable, prefix, hidden, check)
                pending = [i for i in pending if hidden[i] is None]
        for i in pending:
            check()
            session = self.begin(rows[i].tokens, [prefix] if prefix else [])
            try:
                cached += session.offset
                row_hidden = session.hidden_row
                if row_hidden is None:
                    row_hidden = session.prefill(len(rows[i].tokens), check)
                hidden[i] = row_hidden
            finally:
                session.close()
        logits = []
        for row, row_hidden in zip(rows, hidden, strict=True):
            assert row_hidden is not None
            ids = mx.array(row.candidates, dtype=mx.int32)
            selected = self.model.unembed_candidates(row_hidden, ids)
            logits.append(selected.astype(mx.float32).reshape(-1).tolist())
        log.info(
            "scored rows=%d shared_prefix=%d cached=%d seconds=%.3f",
            len(rows),
            prefix,
            cached,
            time.perf_counter() - start,
        )
        return ScoreResult(logits, cached)

    def _score_batched(
        self,
        rows: Sequence[Row],
        which: list[int],
        prefix: int,
        hidden: list[mx.array | None],
        check: Callable[[], None],
    ) -> int:
        """Fill `hidden` for rows `which` from one prefix state and batched suffixes; returns
        the tokens restored instead of computed."""
        cache = self.cache
        assert cache is not None
        check()
        session = cache.begin(rows[which[0]].tokens[:prefix], need_state=True)
        try:
            restored = session.offset
            prefix_hidden = session.hidden_row
            if prefix_hidden is None:
                prefix_hidden = session.prefill(prefix, check)
        finally:
            session.close()
        cached = restored + prefix * (len(which) - 1)
        suffixed = []
        for i in which:
            if len(rows[i].tokens) == prefix:
                hidden[i] = prefix_hidden  # the row is the prefix itself
            else:
                suffixed.append(i)
        suffixed.sort(key=lambda i: len(rows[i].tokens))  # similar lengths pad little
        per_token = sum(_bytes_per_token(c) for c in cache.caches)
        begin = 0
        while begin < len(suffixed):
            check()
            width = len(rows[suffixed[-1]].tokens) - prefix
            # Per row: its own K/V (the prefix is shared) and the attention scores over the
            # prefix, for a generous 32 query heads.
            per_row = per_token * width + 12 * 32 * width * prefix
            tokens = BATCH_TOKENS_CPU if mx.default_device() == mx.cpu else BATCH_TOKENS_GPU
            size = max(1, min(BATCH_BYTES // max(1, per_row), tokens // width))
            chunk = suffixed[begin : begin + size]
            self._forward_batch(rows, chunk, prefix, hidden)
            begin += size
        return cached

    def _forward_batch(
        self, rows: Sequence[Row], chunk: list[int], prefix: int, hidden: list[mx.array | None]
    ) -> None:
        cache = self.cache
        assert cache is not None
        lengths = [len(rows[i].tokens) - prefix for i in chunk]
        width = max(lengths)
        padded = [
            rows[i].tokens[prefix:] + [0] * (width - n) for i, n in zip(chunk, lengths, strict=True)
        ]
        batch = [
            kind.broadcast(c, len(chunk))
            for kind, c in zip(cache.kinds, cache.caches, strict=False)
        ]
        out = self.model.hidden(mx.array(padded, dtype=mx.int32), batch)
        # Right padding is harmless: every layer is causal, so a row's last real position
        # never sees the padding after it.
        for j, (i, n) in enumerate(zip(chunk, lengths, strict=True)):
            hidden[i] = out[j, n - 1 : n, :]
        mx.eval(*(hidden[i] for i in chunk))
        cache.store_rows([rows[i].tokens for i in chunk], prefix, batch, out)


def _bytes_per_token(cache) -> int:
    """Bytes one more token costs a batched row of this cache (KV only grows with length)."""
    keys = getattr(cache, "keys", None)
    if keys is None or not keys.shape[2]:
        return 0
    return 2 * keys.nbytes // (keys.shape[0] * keys.shape[2])
