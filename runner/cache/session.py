"""A prefix-cache session: one request's forward through the live caches.

`PrefixCache.begin(tokens)` returns a session whose live caches already hold the first
`offset` tokens of `tokens` (restored, not computed). The session is everything a request
pipeline needs to compute: callers (runner/score/scorer.py, runner/generate/pipeline.py) never touch
caches, kinds or token bookkeeping.

- `prefill(end, check)`: feed tokens[offset:end] in chunks (the one prefill loop), cut at
  the scheduled capture points, storing a node at each; returns the last hidden row. With
  images (`media`, runner/media/request.py) `tokens` are the prompt's keys, chunks never end
  strictly inside an atomic image, and each chunk gets its images' features.
- `last_hidden(check)`: the hidden row of the last token, stored or prefilled.
- `decode(token)`: one decode step, built lazily; returns its hidden row.
- `forward_rows(suffixes, check)`: rows that continue `tokens` with their own suffixes,
  computed as padded batches over the live state (one copy of the prefix), stored in the
  trie; returns each row's last hidden row.
- `close()`: store what the session computed. As a context manager, an exception other than
  a cancellation discards the live state instead (a forward may have half-written it).

Contract: `offset <= len(tokens) - 1` unless a stored hidden row covers the whole prompt
(`hidden_row` is then set and nothing needs computing). `check()` is called before every
forward and raises to cancel; tokens crossed before a cancellation stay stored (the next
request resumes there).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from runner.cache.batch import broadcast
from runner.cache.live import LiveState
from runner.protocol.errors import Cancelled

if TYPE_CHECKING:
    from runner.media.request import RequestMedia

BATCH_BYTES = 1 << 30  # the batched caches of one forward of rows


class SessionOwner(Protocol):
    """What a session needs of the prefix cache that opened it (runner/cache/prefix_cache.py):
    its live state, the sizes of its forwards, and where what was computed is stored."""

    model: Any
    live: LiveState
    chunk_tokens: int  # prompt tokens per prefill forward
    batch_tokens: int  # suffix tokens per batched forward of rows

    def store_live(self) -> Any:
        """Store the live state as a node (a capture point was reached)."""

    def evict(self) -> None:
        """Bring the byte budget under its limit."""

    def store_rows(self, rows: list[list[int]], prefix: int, batch: list[Any], hidden: Any) -> None:
        """Store rows computed as a batch over the live state's `prefix` tokens."""

    def session_ended(self) -> None:
        """The session closed: store the live state (now, or at the next settle)."""


class PrefixSession:
    def __init__(
        self,
        owner: SessionOwner,
        tokens: list[int],
        offset: int,
        captures: list[int],
        hidden_row: mx.array | None = None,
        media: RequestMedia | None = None,
    ):
        self.owner = owner
        self.media = media
        self.tokens = list(tokens)
        self.offset = offset
        self.captures = captures
        self.hidden_row = hidden_row
        self.closed = False

    def __enter__(self) -> PrefixSession:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if kind is None or issubclass(kind, Cancelled | GeneratorExit):
            self.close()
        else:
            self.fail()

    # --- computing --------------------------------------------------------------------
    def prefill(self, end: int, check: Callable[[], None]) -> mx.array:
        live, owner = self.owner.live, self.owner
        fed = len(live.tokens)
        last: mx.array | None = None
        while fed < end:
            check()
            stop = min(fed + owner.chunk_tokens, end, *(c for c in self.captures if c > fed))
            if self.media is not None:  # never end strictly inside an atomic image
                stop = self.media.extend_chunk(fed, stop, end)
            last = live.feed(self.tokens[fed:stop], self.media)[0, -1:, :]
            fed = stop
            if self.media is not None:
                self.media.release(fed)
            if fed in self.captures:
                owner.store_live()
                owner.evict()
        assert last is not None, "prefill needs at least one token to feed"
        return last

    def last_hidden(self, check: Callable[[], None]) -> mx.array:
        if self.hidden_row is not None:
            return self.hidden_row
        return self.prefill(len(self.tokens), check)

    def decode(self, token: int | mx.array) -> mx.array:
        """The hidden row [1, H] of one more token after what the caches hold (lazy: the
        caller evaluates, and may build the next step before reading this one)."""
        return self.owner.live.step(token, self.media.layout if self.media is not None else None)

    def forward_rows(
        self, suffixes: list[list[int]], check: Callable[[], None], every_position: bool = False
    ) -> list[mx.array]:
        """Each suffix's last hidden row [1, H] (with `every_position`, every position's:
        [n, H] for a suffix of n tokens), the rows computed as batches over the live state,
        which must hold all of `tokens` (their shared prefix); suffixes are not empty. Every
        row is stored in the trie (edge kinds; point kinds cannot describe a padded row's
        end)."""
        owner, live = self.owner, self.owner.live
        prefix = len(self.tokens)
        assert live.tokens == self.tokens, "the live state must hold the whole prefix"
        assert all(suffixes), "every row continues the prefix"
        owner.store_live()  # rows are stored below the prefix's node
        # The prefix's position layout serves every row: rows batched here have all their
        # images in the shared prefix (runner/score/scorer.py), so past it each row's positions are
        # its indices plus the same delta, which the prefix's layout gives.
        layout = self.media.layout if self.media is not None else None
        out: list[mx.array | None] = [None] * len(suffixes)
        order = sorted(range(len(suffixes)), key=lambda i: len(suffixes[i]))  # pad little
        kinds = live.kinds[: len(live.caches)]
        per_token = sum(k.bytes_per_token(c) for k, c in zip(kinds, live.caches, strict=True))
        begin = 0
        while begin < len(order):
            check()
            width = len(suffixes[order[-1]])
            # Per row: its own K/V (the prefix is shared) and the attention scores over the
            # prefix, for a generous 32 query heads.
            per_row = per_token * width + 12 * 32 * width * prefix
            size = max(1, min(BATCH_BYTES // max(1, per_row), owner.batch_tokens // width))
            chunk = order[begin : begin + size]
            batch = broadcast(kinds, live.caches, len(chunk))
            rows = [suffixes[i] for i in chunk]
            hidden = live.forward_rows(batch, rows, layout)
            for j, i in enumerate(chunk):
                n = len(suffixes[i])
                out[i] = hidden[j, (0 if every_position else n - 1) : n, :]
            mx.eval(*(out[i] for i in chunk))
            owner.store_rows([self.tokens + suffixes[i] for i in chunk], prefix, batch, hidden)
            begin += size
        assert all(row is not None for row in out)
        return out  # type: ignore[return-value]

    def computed_rows(self) -> mx.array | None:
        """The final hidden rows [1, k, H] of the positions the live state computed since this
        session restored its prefix (from `offset`), for a cache that keeps hidden rows; None
        when there are none."""
        hidden = self.owner.live.hidden
        if hidden is None or hidden.rows is None:
            return None
        return hidden.rows[:, self.offset - hidden.base :, :]

    # --- ending -----------------------------------------------------------------------
    def close(self) -> None:
        """Store what the session computed (the live state as a node); once."""
        if self.closed:
            return
        self.closed = True
        if self.hidden_row is None:  # else nothing was computed
            self.owner.session_ended()

    def fail(self) -> None:
        """A forward failed: the live caches may be half-written; store nothing."""
        self.closed = True
        self.owner.live.reset()
