"""`/v1/completions` before streaming: the Go handler's `Prepare` (docs/PROTOCOL.md §5.1).

Runs off the MLX thread (it tokenizes). Checks, in Go's order, each a 400 with Go's text:
media sent to this text-only model, an empty prompt, a prompt that does not leave room for one
token. Then resolves the token budget: `num_predict` <= 0 means the rest of the context.
"""

from __future__ import annotations

from .errors import BadRequest
from .generate import GenerateOptions
from .sampling import SamplerOptions
from .tokenizer import Tokenizer
from .wire import CompletionRequest


def prepare_completion(
    request: CompletionRequest, tokenizer: Tokenizer, context_length: int
) -> tuple[list[int], GenerateOptions]:
    if request.media:
        kind = request.media[0].kind or "media"
        raise BadRequest(f"this model does not support {kind} input")
    tokens = tokenizer.encode(request.prompt, tokenizer.add_bos)
    if not tokens:
        raise BadRequest("empty prompt")
    if len(tokens) >= context_length:
        raise BadRequest(
            f"input length ({len(tokens)} tokens) exceeds the model's maximum context length "
            f"({context_length} tokens)"
        )
    room = context_length - len(tokens)
    num_predict = request.options.num_predict
    num_predict = room if num_predict <= 0 else min(num_predict, room)
    sampler = SamplerOptions.from_options(request.options, request.logprobs, request.toplogprobs)
    return tokens, GenerateOptions(num_predict=num_predict, sampler=sampler)
