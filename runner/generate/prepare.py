"""`/v1/completions` before streaming: the Go handler's `Prepare` (docs/PROTOCOL.md §5.1).

Runs off the MLX thread (it tokenizes, and decodes images). Checks, in Go's order, each a 400
with Go's text: media sent to a model without image support, the images
(runner/media/prepare.py: unknown ids, headers refused), an empty prompt, a prompt that
does not leave room for one token. The images' tokens are counted from their headers; they
are decoded (undecodable bytes, the request's image budget) only for a prompt that fits.
Then resolves the token budget: `num_predict` <= 0 means the rest of the context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from runner.generate.pipeline import GenerateOptions
from runner.generate.sampling import SamplerOptions
from runner.media.prepare import PreparedPrompt, RequestImages, plan_prompt
from runner.models import ImageModel
from runner.protocol.errors import BadRequest
from runner.protocol.wire import CompletionRequest
from runner.text.tokenizer import Tokenizer


def prepare_completion(
    request: CompletionRequest,
    tokenizer: Tokenizer,
    context_length: int,
    model: Any = None,
    check: Callable[[], None] | None = None,
) -> tuple[PreparedPrompt, GenerateOptions]:
    """The prompt (with its images expanded, for an `ImageModel`) and the resolved options;
    `check` (raising `Cancelled`) runs before each image is decoded."""
    if request.media and not isinstance(model, ImageModel):
        kind = request.media[0].kind or "media"
        raise BadRequest(f"this model does not support {kind} input")
    if request.media:
        images = RequestImages(request.media, model, check)
        planned = plan_prompt(request.prompt, images, tokenizer, tokenizer.add_bos, context_length)
        if planned.count >= context_length:  # refused before anything is decoded
            _too_long(planned.count, context_length)
        prompt = planned.realize()
    else:  # past the context, only the count: a prompt of millions of tokens is not listed
        # (a beginning kept from earlier prompts is not tokenized again: runner/text/tokenizer.py)
        ((ids, _),) = tokenizer.encode_extended([(request.prompt, [])], context_length)
        bos = tokenizer.bos(tokenizer.add_bos)
        if isinstance(ids, int):
            _too_long(ids + len(bos), context_length)
        prompt = PreparedPrompt([*bos, *ids])
    tokens = prompt.tokens
    if not tokens:
        raise BadRequest("empty prompt")
    if len(tokens) >= context_length:
        _too_long(len(tokens), context_length)
    room = context_length - len(tokens)
    num_predict = request.options.num_predict
    num_predict = room if num_predict <= 0 else min(num_predict, room)
    sampler = SamplerOptions.from_options(request.options, request.logprobs, request.toplogprobs)
    return prompt, GenerateOptions(num_predict=num_predict, sampler=sampler)


def _too_long(count: int, context_length: int) -> NoReturn:
    raise BadRequest(
        f"input length ({count} tokens) exceeds the model's maximum context length "
        f"({context_length} tokens)"
    )
