"""`/v1/score` validation, off the MLX thread (docs/PROTOCOL.md §4): each row tokenized
and checked by the Go runner's scoring handler's rules, in its order, with its texts; the
first failure is the answer (`BadRequest`). What it produces, `Row`s of token ids and
candidate ids, is what runner/score/scorer.py computes on the MLX thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from runner.media.prepare import PreparedPrompt, RequestImages, plan_prompt
from runner.models import ImageModel
from runner.protocol.errors import BadRequest, go_quote
from runner.protocol.wire import ScoreRequest, ScoreRow
from runner.text.tokenizer import Tokenizer

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
    check: Callable[[], None] | None = None,
) -> list[Row]:
    """Tokenize and validate every row; raises BadRequest with the Go handler's text.

    With `media` (an `ImageModel` only), each row's `[img-N]` tags expand to the model's
    image tokens (runner/media/prepare.py); a candidate is checked against the text after the
    row's last tag. A row's images are counted from their headers, and decoded only once
    its length is within `max_tokens` (after Go's length check, before its candidates');
    `check` (raising `Cancelled`) runs before each image is decoded."""
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
        prompts = _image_prompts(request, tokenizer, model, max_tokens, check)
    else:
        prompts = _text_prompts(request, tokenizer, max_tokens)
    rows: list[Row] = []
    for i, (row, (realize, count, tail, joined)) in enumerate(
        zip(request.rows, prompts, strict=True)
    ):
        refused = _length_refusal(i, count, max_tokens)
        if refused is not None:
            raise BadRequest(refused)
        prompt = realize()  # a row's images are decoded here, once it is known to fit
        refused = _candidates_refusal(i, row)
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


# Per row, lazily in Go's order of checks: the prepared prompt (made on demand: a prompt with
# images decodes them then), its length in tokens, the tokens a candidate must extend (the
# prompt's, or its text after the last tag), and the candidates' tokenizations (a count only
# past the limit, None where a candidate is longer than any token).
Prompts = Iterator[
    tuple[
        Callable[[], PreparedPrompt],
        int,
        list[int],
        Callable[[], list[list[int] | int | None]],
    ]
]


def _length_refusal(i: int, tokens: int, max_tokens: int) -> str | None:
    """Go's first check of row `i`: its prompt's length."""
    if not 1 <= tokens <= max_tokens:
        return f"prompt {i} has {tokens} tokens; expected 1–{max_tokens} (input is never truncated)"
    return None


def _candidates_refusal(i: int, row: ScoreRow) -> str | None:
    """Go's second check of row `i`: how many candidates it has."""
    if not 1 <= len(row.candidates) <= MAX_CANDIDATES:
        return f"prompt {i} requires 1–{MAX_CANDIDATES} candidates"
    return None


def _row_refusal(i: int, row: ScoreRow, tokens: int, max_tokens: int) -> str | None:
    """Go's checks of row `i` before its candidates are read."""
    return _length_refusal(i, tokens, max_tokens) or _candidates_refusal(i, row)


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
        prompt = functools.partial(PreparedPrompt, tokens)
        yield prompt, count, tokens, functools.partial(list, mine)


def _appended(tokenizer: Tokenizer, candidates: list[str]) -> list[str | None]:
    """Each candidate to append and tokenize; None for one longer than any token (it cannot
    append one, and a candidate of megabytes took seconds to tokenize)."""
    return [c if tokenizer.may_be_one_token(c) else None for c in candidates]


def _image_prompts(
    request: ScoreRequest,
    tokenizer: Tokenizer,
    model: ImageModel,
    max_tokens: int,
    check: Callable[[], None] | None,
) -> Prompts:
    """Each row's tags planned from the images' headers (every media item decoded at most
    once per request, when `realize` is called); candidates are checked against the text
    after the row's last tag."""
    images = RequestImages(request.media, model, check)
    for row in request.rows:
        planned = plan_prompt(row.prompt, images, tokenizer, False, max_tokens)
        tail_text = str(planned.parts[-1])

        def joined(row=row, tail_text=tail_text) -> list[list[int] | int | None]:
            appended = _appended(tokenizer, row.candidates)
            return tokenizer.encode_extended([(tail_text, appended)], None)[0][1]

        yield planned.realize, planned.count, planned.tail, joined
