"""`/v1/score`: validate a decision request, then compute candidate logits (docs/PROTOCOL.md §4).

Two halves with different homes:
- `prepare_rows` tokenizes and validates, off the MLX thread. Rules and messages are the Go
  runner's scoring handler's, checked in its order; the first failure is the answer.
- `Scorer.score` runs on the MLX thread. A row whose whole prompt is stored reuses its
  stored hidden row and computes nothing. Rows that share a prefix are computed together:
  the prefix once (restored from the scoring prefix cache where possible), then all the
  unshared suffixes as batches over it; where a cache kind cannot batch (said once in the
  log), each row restores the stored prefix in turn. Other rows open one prefix-cache
  session each.
  Nothing computes vocabulary logits at prompt positions; at the last position a
  `CandidateUnembedder` model computes only the candidates' rows of the output projection
  (float32), any other model unembeds fully and the candidates are gathered, as Go does.

`cached_tokens` counts, per row, the tokens restored instead of computed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .cache.batch import unbatched_kinds
from .cache.prefix_cache import PrefixCache
from .errors import BadRequest, go_quote
from .media.prepare import Placed, PreparedPrompt, prepare_prompt, split_prompt
from .media.request import RequestMedia
from .models import CandidateUnembedder, ImageModel, Model
from .tokenizer import Tokenizer
from .wire import ScoreRequest, ScoreRow

log = logging.getLogger(__name__)

MAX_ROWS = 64
MAX_CANDIDATES = 26


@dataclass(frozen=True)
class Row:
    tokens: list[int]  # the prefix cache's keys: token ids, and image folds over expansions
    candidates: list[int]
    prompt: PreparedPrompt | None = None  # a prompt with images: its tokens and items

    @property
    def has_images(self) -> bool:
        return self.prompt is not None and bool(self.prompt.items)


def prepare_rows(
    request: ScoreRequest,
    tokenizer: Tokenizer,
    context_length: int,
    vocab_size: int,
    model: Any = None,
) -> list[Row]:
    """Tokenize and validate every row; raises BadRequest with the Go handler's text.

    With `media` (an `ImageModel` only), each row's `[img-N]` tags expand to the model's
    image tokens (runner/media/prepare.py); a candidate is checked against the text after the
    row's last tag."""
    if request.media and not isinstance(model, ImageModel):
        raise BadRequest("this model does not support image input")
    if not 1 <= len(request.rows) <= MAX_ROWS:
        raise BadRequest(f"scoring requires 1–{MAX_ROWS} prompts")
    max_tokens = request.maxtokens
    if not 1 <= max_tokens <= context_length:
        raise BadRequest(f"max_tokens must be between 1 and {context_length}")
    # An id must index both the tokenizer's table and the model's output rows.
    id_limit = min(tokenizer.vocab_size, vocab_size)
    if request.media:
        prompts = _image_prompts(request, tokenizer, model)
    else:
        prompts = _text_prompts(request, tokenizer, max_tokens)
    rows: list[Row] = []
    for i, (row, (prompt, count, tail, joined)) in enumerate(
        zip(request.rows, prompts, strict=True)
    ):
        refused = _row_refusal(i, row, count, max_tokens)
        if refused is not None:
            raise BadRequest(refused)
        candidates: list[int] = []
        for candidate, ids in zip(row.candidates, joined(), strict=True):
            if (
                not isinstance(ids, list)  # longer than any token, or than the limit
                or tokenizer.is_special(candidate)
                or len(ids) != len(tail) + 1
                or ids[:-1] != tail
            ):
                raise BadRequest(
                    f"candidate {go_quote(candidate)} must append exactly one ordinary token "
                    f"to prompt {i}"
                )
            token = ids[-1]
            if not 0 <= token < id_limit or token in candidates:
                raise BadRequest(f"prompt {i} has invalid or duplicate candidate tokens")
            candidates.append(token)
        rows.append(Row(prompt.keys, candidates, prompt if prompt.items else None))
    return rows


# Per row, lazily in Go's order of checks: the prepared prompt, its length in tokens, the tokens
# a candidate must extend (the prompt's, or its text after the last tag), and the candidates'
# tokenizations (a count only past the limit, None where a candidate is longer than any token).
Prompts = Iterator[
    tuple[PreparedPrompt, int, list[int], Callable[[], list[list[int] | int | None]]]
]


def _row_refusal(i: int, row: ScoreRow, tokens: int, max_tokens: int) -> str | None:
    """Go's checks of row `i` before its candidates are read: its prompt's length, then how
    many candidates it has."""
    if not 1 <= tokens <= max_tokens:
        return f"prompt {i} has {tokens} tokens; expected 1–{max_tokens} (input is never truncated)"
    if not 1 <= len(row.candidates) <= MAX_CANDIDATES:
        return f"prompt {i} requires 1–{MAX_CANDIDATES} candidates"
    return None


# A prompt of more characters than this many a token of `max_tokens` is tokenized before its
# candidates are: it may well be refused for its length, and then they are never read.
LONG_PROMPT_CHARS_PER_TOKEN = 8


def _text_prompts(request: ScoreRequest, tokenizer: Tokenizer, max_tokens: int) -> Prompts:
    """Every prompt and prompt + candidate tokenized in one parallel batch
    (`Tokenizer.encode_extended`: the candidates cost a few words each where the tokenizer
    allows cuts), except the candidates of long prompts (`LONG_PROMPT_CHARS_PER_TOKEN`):
    those are tokenized in a second batch, with their prompts again, and only for rows
    before the first that `_row_refusal` refuses (the checks stop there). A refused
    million-token prompt is tokenized once, not once more per candidate (~1 s of a core
    each, and its ids built and freed with the GIL held)."""
    long = LONG_PROMPT_CHARS_PER_TOKEN * max_tokens
    later = [len(row.prompt) > long or len(row.candidates) > MAX_CANDIDATES for row in request.rows]
    # Past max_tokens + 1 a text can be neither an accepted prompt nor a prompt + one token.
    encoded = tokenizer.encode_extended(
        [
            (row.prompt, [] if wait else _appended(tokenizer, row.candidates))
            for row, wait in zip(request.rows, later, strict=True)
        ],
        max_tokens + 1,
    )
    prompts = [ids if isinstance(ids, list) else [] for ids, _ in encoded]
    counts = [len(ids) if isinstance(ids, list) else ids for ids, _ in encoded]
    read = len(request.rows)  # rows whose candidates the checks reach
    for i, (row, count) in enumerate(zip(request.rows, counts, strict=True)):
        if _row_refusal(i, row, count, max_tokens) is not None:
            read = i
            break
    waited = [row for row, wait in zip(request.rows[:read], later, strict=False) if wait]
    second = iter(
        tokenizer.encode_extended(
            [(row.prompt, _appended(tokenizer, row.candidates)) for row in waited], max_tokens + 1
        )
    )
    rows = zip(prompts, counts, later, encoded, strict=True)
    for i, (tokens, count, wait, (_, joined)) in enumerate(rows):
        mine = [] if wait and i >= read else next(second)[1] if wait else joined
        yield PreparedPrompt(tokens), count, tokens, functools.partial(list, mine)


def _appended(tokenizer: Tokenizer, candidates: list[str]) -> list[str | None]:
    """Each candidate to append and tokenize; None for one longer than any token (it cannot
    append one, and a candidate of megabytes took seconds to tokenize)."""
    return [c if tokenizer.may_be_one_token(c) else None for c in candidates]


def _image_prompts(request: ScoreRequest, tokenizer: Tokenizer, model: ImageModel) -> Prompts:
    """Each row's tags expanded (every media item decoded once per request); candidates are
    checked against the text after the row's last tag."""
    expansions: dict[int, Placed] = {}
    for row in request.rows:
        prompt = prepare_prompt(row.prompt, request.media, tokenizer, model, False, expansions)
        tail_text = str(split_prompt(row.prompt)[-1])

        def joined(row=row, tail_text=tail_text) -> list[list[int] | int | None]:
            appended = _appended(tokenizer, row.candidates)
            return tokenizer.encode_extended([(tail_text, appended)], None)[0][1]

        yield prompt, len(prompt.tokens), prompt.tokens[prompt.tail_start :], joined


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
