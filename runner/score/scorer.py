"""`/v1/score` on the MLX thread: candidate logits of validated rows (docs/PROTOCOL.md §4).

`Scorer.score` takes the `Row`s runner/score/validate.py made. A row whose whole prompt is
stored reuses its stored hidden row and computes nothing. Rows that share a prefix are
computed together: the prefix once (restored from the scoring prefix cache where possible),
then all the unshared suffixes as batches over it; where a cache kind cannot batch (said once
in the log), each row restores the stored prefix in turn. Other rows open one prefix-cache
session each. Nothing computes vocabulary logits at prompt positions; at the last position a
`CandidateUnembedder` model computes only the candidates' rows of the output projection
(float32), any other model unembeds fully and the candidates are gathered, as Go does.

`cached_tokens` counts, per row, the tokens restored instead of computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from runner.cache.batch import unbatched_kinds
from runner.cache.prefix_cache import PrefixCache
from runner.media.request import RequestMedia
from runner.models import CandidateUnembedder, Model
from runner.score.validate import Row

log = logging.getLogger(__name__)


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


def _images_end_by(row: Row, prefix: int) -> bool:
    """Whether every image of the row lies inside its first `prefix` tokens."""
    return row.prompt is None or all(item.end <= prefix for item in row.prompt.items)


@dataclass
class ScoreResult:
    logits: list[list[float]]
    cached_tokens: int


BATCH_MAX_SUFFIX = 256  # rows with longer unshared parts are prefilled one by one


class Scorer:
    """Computes candidate logits for validated rows through the scoring prefix cache; call
    only on the MLX thread.

    Rows that share a prefix and are not already stored are scored together: the prefix is
    restored or computed once, then the rows' unshared suffixes run as batches over the
    prefix state (one copy of it), and the rows are stored for later requests. Other rows
    open one session each, with the rows' shared prefix scheduled as a snapshot point so
    later rows restore it.
    """

    def __init__(self, model: Model, cache: PrefixCache):
        self.model = model
        self.cache = cache
        unbatched = unbatched_kinds(model)
        self.batches = not unbatched
        if unbatched:
            log.info(
                "rows over a shared prefix are scored one by one: %s caches cannot be batched",
                ", ".join(unbatched),
            )

    def score(self, rows: Sequence[Row], check: Callable[[], None]) -> ScoreResult:
        """`check` raises to stop (cancellation); it is called before every forward."""
        start = time.perf_counter()
        cache = self.cache
        prefix = shared_prefix_length(rows)
        hidden: list[mx.array | None] = [None] * len(rows)
        cached = 0
        pending = list(range(len(rows)))
        if prefix:
            for i, row in enumerate(rows):
                hidden[i] = cache.stored_hidden_row(row.tokens)
                if hidden[i] is not None:
                    cached += len(row.tokens)
            pending = [i for i in pending if hidden[i] is None]
            batchable = [
                i
                for i in pending
                if len(rows[i].tokens) - prefix <= BATCH_MAX_SUFFIX
                and _images_end_by(rows[i], prefix)  # batched suffixes are text
            ]
            if len(batchable) > 1 and self.batches:
                cached += self._score_batched(rows, batchable, prefix, hidden, check)
                pending = [i for i in pending if hidden[i] is None]
        for i in pending:
            check()
            schedule = [prefix] if prefix else []
            media = self._media(rows[i])
            hidden[i], restored = cache.last_hidden(rows[i].tokens, check, schedule, media)
            cached += restored
        logits = [self._candidates(h, row.candidates) for h, row in zip(hidden, rows, strict=True)]
        log.info(
            "scored rows=%d shared_prefix=%d cached=%d seconds=%.3f",
            len(rows),
            prefix,
            cached,
            time.perf_counter() - start,
        )
        return ScoreResult(logits, cached)

    def _media(self, row: Row) -> RequestMedia | None:
        if not row.has_images:
            return None
        assert row.prompt is not None
        return RequestMedia(self.model, row.prompt)

    def _candidates(self, hidden: mx.array | None, candidates: list[int]) -> list[float]:
        assert hidden is not None
        ids = mx.array(candidates, dtype=mx.int32)
        if isinstance(self.model, CandidateUnembedder):
            selected = self.model.unembed_candidates(hidden, ids)
        else:
            selected = self.model.unembed(hidden)[..., ids]
        return selected.astype(mx.float32).reshape(-1).tolist()  # type: ignore[return-value]

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
        check()
        first = rows[which[0]]
        media = self._media(first)  # the images of the shared prefix, the same in every row
        with self.cache.begin(first.tokens[:prefix], need_state=True, media=media) as session:
            restored = session.offset
            prefix_hidden = session.last_hidden(check)
            suffixed = [i for i in which if len(rows[i].tokens) > prefix]
            for i in which:
                if len(rows[i].tokens) == prefix:
                    hidden[i] = prefix_hidden  # the row is the prefix itself
            suffixes = [rows[i].tokens[prefix:] for i in suffixed]
            if suffixes:
                computed = session.forward_rows(suffixes, check)
                for i, row_hidden in zip(suffixed, computed, strict=True):
                    hidden[i] = row_hidden
        return restored + prefix * (len(which) - 1)
