"""The OpenAI face of `serve` (docs/SERVE.md), and the tokenizer endpoints of vLLM's
server that lm-eval's `remote` tokenizer reads.

- `GET /v1/models`: the one model, as OpenAI lists models.
- `POST /v1/completions`: `prompt` as a string, a list of strings, a list of token ids or a
  list of lists (ids used exactly as sent); `echo`, integer `logprobs` (top-k with the chosen
  token included), `max_tokens` (0 allowed with `echo`), `temperature`, `top_p`, `top_k`,
  `stop`, `seed`, `n` = 1, `stream` (SSE). Prompt logprobs (`echo` with `logprobs`) are
  computed as `/v1/score` computes candidates (runner/score/loglikelihood.py), all the
  request's prompts together; with `max_tokens` 1 the next token is drawn from the row
  computed there, with nothing generated through the generation cache.
- `POST /v1/chat/completions`: the model's chat template, `logprobs` / `top_logprobs`,
  `stream`, images as `image_url` parts with `data:` URLs (image-text families).
- `GET /tokenizer_info`, `POST /tokenize`, `POST /detokenize`: vLLM's shapes.

Errors are OpenAI's: `{"error": {"message", "type", "param", "code"}}`, 400 for any bad
input (a prompt past the context with its count), 503 while stopping, 500 only for a failure
of the runner itself.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
from aiohttp import web

from runner.engine import Job
from runner.generate.pipeline import GenerateOptions
from runner.generate.sampling import Sampler, SamplerOptions, log_softmax
from runner.media.prepare import PreparedPrompt
from runner.protocol.errors import Cancelled
from runner.protocol.wire import Logprob
from runner.score.loglikelihood import Position
from runner.server.faces import (
    CREATED,
    Chunk,
    FaceError,
    Faces,
    Finished,
    Generated,
    StopText,
    TooLong,
    collect,
    generate,
    off_loop,
    request_scope,
    stream,
)

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class CompletionBody(msgspec.Struct):
    model: str | None = None
    prompt: Any = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    suffix: str | None = None


class ChatBody(msgspec.Struct):
    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeBody(msgspec.Struct):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeBody(msgspec.Struct):
    tokens: list[int]


def _decode(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise FaceError(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise FaceError(f"invalid JSON body: {e}") from None


# --- errors ---------------------------------------------------------------------------------
def error_response(message: str, status: int = 400, kind: str = "invalid_request_error"):
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def openai_errors(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Every failure in OpenAI's error shape: a 400 for bad input, never a 5xx for it."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except FaceError as e:
            return error_response(e.message, e.status, e.kind)
        except web.HTTPRequestEntityTooLarge as e:
            return error_response(f"request body too large: {e.text}", 400)
        except Cancelled:
            faces = request.app[FACES_KEY]
            if faces.runner.engine.stopping:
                return error_response("runner is stopping", 503, "server_error")
            return error_response("request cancelled", 499, "cancelled")
        except Exception as e:  # the process never dies from a request
            log.exception("request %s failed", request.path)
            return error_response(str(e) or type(e).__name__, 500, "server_error")

    return wrapped


FACES_KEY: web.AppKey[Faces] = web.AppKey("faces", Faces)


# --- /v1/models -----------------------------------------------------------------------------
def model_card(faces: Faces) -> dict[str, Any]:
    return {
        "id": faces.name,
        "object": "model",
        "created": CREATED,
        "owned_by": "ollama-mlx-runner",
        "max_model_len": faces.context_length,
    }


@openai_errors
async def models(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    # `Success` keeps what the Go wire answers on this path for a Go client reading it
    return web.json_response({"object": "list", "data": [model_card(faces)], "Success": True})


# --- sampling options -----------------------------------------------------------------------
def _sampler(
    body: CompletionBody | ChatBody, logprobs: bool = False, top: int = 0
) -> SamplerOptions:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if not math.isfinite(temperature) or temperature < 0:
        raise FaceError("temperature must be a number >= 0")
    if not 0 < top_p <= 1:
        raise FaceError("top_p must be in (0, 1]")
    top_k = body.top_k or 0
    if top_k < 0 and top_k != -1:
        raise FaceError("top_k must be -1 (off) or > 0")
    if body.n not in (None, 1) or getattr(body, "best_of", None) not in (None, 1):
        raise FaceError("only n = 1 is supported")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            if not -2 <= value <= 2:
                raise FaceError(f"{name} must be in [-2, 2]")
            penalties[name] = value
    repeat = body.repetition_penalty
    if repeat is not None and not (math.isfinite(repeat) and repeat > 0):
        raise FaceError("repetition_penalty must be > 0")
    return SamplerOptions(
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        min_p=body.min_p or 0.0,
        repeat_last_n=-1 if (penalties or repeat not in (None, 1.0)) else 0,
        repeat_penalty=repeat or 0.0,
        presence_penalty=penalties.get("presence_penalty", 0.0),
        frequency_penalty=penalties.get("frequency_penalty", 0.0),
        seed=-1 if body.seed is None else abs(body.seed),
        logprobs=logprobs,
        top_logprobs=top,
    )


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# --- /v1/completions ------------------------------------------------------------------------
@dataclass
class CompletionPlan:
    prompts: list[list[int]]
    texts: list[str]  # each prompt's text, for echo
    max_tokens: int  # 0: echo only
    budgets: list[int]
    echo: bool
    logprobs: int | None
    sampler: SamplerOptions
    stops: list[str]
    stream: bool
    usage_in_stream: bool
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")


def _prompts(faces: Faces, prompt: Any) -> tuple[list[list[int]], list[str]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise FaceError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids"
        )
    ids: list[list[int]] = []
    texts: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            tokens = faces.text_prompt(item)
            text = item
        elif isinstance(item, list):
            tokens = faces.token_prompt(item, f"prompt {i}")
            text = "".join(faces.token_text(t) for t in tokens)
        else:
            raise FaceError(f"prompt {i} must be a string or a list of token ids")
        if not tokens:
            raise FaceError(f"prompt {i} is empty")
        ids.append(tokens)
        texts.append(text)
    return ids, texts


def plan_completion(faces: Faces, body: bytes) -> CompletionPlan:
    request: CompletionBody = _decode(body, CompletionBody)
    if request.suffix:
        raise FaceError("suffix is not supported")
    echo = bool(request.echo)
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise FaceError(f"logprobs must be between 0 and {MAX_LOGPROBS}")
    max_tokens = DEFAULT_COMPLETION_TOKENS if request.max_tokens is None else request.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        raise FaceError("max_tokens must be at least 1 (0 only with echo)")
    sampler = _sampler(request, request.logprobs is not None, request.logprobs or 0)
    prompts, texts = _prompts(faces, request.prompt)
    budgets = []
    for tokens in prompts:
        if max_tokens == 0:
            if len(tokens) > faces.context_length:
                raise TooLong(
                    f"This model's maximum context length is {faces.context_length} tokens. "
                    f"However, the prompt has {len(tokens)} tokens. Please reduce the prompt."
                )
            budgets.append(0)
        else:
            asked = request.max_tokens
            budgets.append(faces.room(len(tokens), asked))
            if asked is None:  # OpenAI's default, within the context
                budgets[-1] = min(budgets[-1], DEFAULT_COMPLETION_TOKENS)
    options = request.stream_options or {}
    return CompletionPlan(
        prompts,
        texts,
        max_tokens,
        budgets,
        echo,
        request.logprobs,
        sampler,
        _stops(request.stop),
        bool(request.stream),
        bool(options.get("include_usage")),
    )


@dataclass
class Echoed:
    """A prompt's own part of its choice (echo): its text and logprobs."""

    index: int
    text: str
    logprobs: dict[str, list[Any]] | None


@dataclass
class Part:
    """Generated text of choice `index` (a `Chunk`, or the end)."""

    index: int
    item: Chunk | Finished


def _top_dict(
    faces: Faces, top: tuple[tuple[int, float], ...], chosen: int, logprob: float, k: int
):
    """OpenAI's top_logprobs entry: the k best and the chosen token, keyed by text; where two
    tokens share a text the larger value stays (so the maximum is the row's maximum)."""
    out: dict[str, float] = {}
    for token, value in [*top[:k], (chosen, logprob)]:
        text = faces.token_text(token)
        if text not in out or value > out[text]:
            out[text] = value
    return out


def _prompt_logprobs(faces: Faces, tokens: list[int], positions: list[Position | None], k: int):
    texts = [faces.token_text(t) for t in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token, position in zip(tokens, positions, strict=True):
        if position is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(position.logprob)
            tops.append(_top_dict(faces, position.top, token, position.logprob, k))
    return {
        "tokens": texts,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _next_token(faces: Faces, plan: CompletionPlan, tokens: list[int], logits: mx.array):
    """One token drawn from the row after the prompt (echo with max_tokens 1): its id, its
    logprob and the k best there."""
    sampler = Sampler(plan.sampler, faces.context_length, tokens)
    draw = sampler.sample(logits)
    logprobs = log_softmax(logits)
    k = max(1, plan.logprobs or 0)
    best = mx.argpartition(-logprobs, kth=k - 1)[:k]
    mx.eval(draw.token, logprobs, best)
    row = np.asarray(logprobs)
    token = int(np.asarray(draw.token))
    ids = [int(t) for t in np.asarray(best)]
    top = sorted(((t, float(row[t])) for t in ids), key=lambda p: (-p[1], p[0]))
    return token, float(row[token]), tuple(top)


def completion_work(
    faces: Faces, plan: CompletionPlan, job: Job, emit: Callable[[Any], None]
) -> None:
    """The whole request on the MLX thread: prompt logprobs for every prompt at once, then
    each prompt's generation."""
    runner = faces.runner
    answers = None
    one = plan.max_tokens == 1 and plan.echo and plan.logprobs is not None
    if plan.echo and plan.logprobs is not None:
        answers = faces.loglikelihoods.compute(
            plan.prompts, [1] * len(plan.prompts), plan.logprobs, one, job.check
        )
    for index, tokens in enumerate(plan.prompts):
        if plan.echo:
            lp = None
            if answers is not None:
                lp = _prompt_logprobs(faces, tokens, answers[index].positions, plan.logprobs or 0)
            emit(Echoed(index, plan.texts[index], lp))
        if plan.max_tokens == 0:
            emit(Part(index, Finished("length", len(tokens), 0, 0.0, 0.0, 0.0)))
            continue
        if one and answers is not None:
            logits = answers[index].next_logits
            assert logits is not None
            began = time.perf_counter()
            token, logprob, top = _next_token(faces, plan, tokens, logits)
            eos = runner.tokenizer.is_eos(token)
            text = "" if eos else StopText(plan.stops).feed(faces.token_text(token))
            top_list = [Logprob(faces.token_text(t), v) for t, v in top]
            chosen = Logprob(faces.token_text(token), logprob, top_list)  # type: ignore[arg-type]
            emit(Part(index, Chunk(text, [chosen], 1)))
            spent = time.perf_counter() - began
            emit(
                Part(
                    index,
                    Finished(
                        "stop" if eos else "length", len(tokens), 0 if eos else 1, 0.0, spent, spent
                    ),
                )
            )
            continue
        options = GenerateOptions(num_predict=plan.budgets[index], sampler=plan.sampler)
        generate(runner, PreparedPrompt(tokens), options, plan.stops, job, _tagged(emit, index))


def _tagged(emit: Callable[[Any], None], index: int) -> Callable[[Any], None]:
    return lambda item: emit(Part(index, item))


def _generated_logprobs(faces: Faces, logprobs: list[Logprob], k: int, offset: int):
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        tokens.append(lp.token)
        values.append(lp.logprob)
        top: dict[str, float] = {}
        alternatives: list[Any] = [*lp.top_logprobs[:k], lp]
        for alt in alternatives:
            if alt.token not in top or alt.logprob > top[alt.token]:
                top[alt.token] = alt.logprob
        tops.append(top)
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _extend(into: dict[str, list[Any]] | None, more: dict[str, list[Any]]) -> dict[str, list[Any]]:
    if into is None:
        return {k: list(v) for k, v in more.items()}
    for key, values in more.items():
        into[key].extend(values)
    return into


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@openai_errors
async def completions(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    body = await request.read()
    with request_scope(request) as scope:
        plan = await off_loop(lambda: plan_completion(faces, body))
        work = functools.partial(completion_work, faces, plan)
        if plan.stream:
            return await stream(
                request,
                faces.runner,
                scope,
                work,
                "text/event-stream",
                functools.partial(_completion_events, faces, plan, {}),
                _sse_error,
                b"data: [DONE]\n\n",
            )
        items = await collect(request, faces.runner, scope, work)
    return web.json_response(_completion_answer(faces, plan, items))


def _completion_answer(faces: Faces, plan: CompletionPlan, items: list[Any]) -> dict[str, Any]:
    choices: list[dict[str, Any]] = [
        {"index": i, "text": "", "logprobs": None, "finish_reason": None}
        for i in range(len(plan.prompts))
    ]
    offsets = [0] * len(plan.prompts)
    prompt_tokens = completion_tokens = 0
    for item in items:
        choice = choices[item.index]
        if isinstance(item, Echoed):
            choice["text"] += item.text
            offsets[item.index] = len(item.text)
            if item.logprobs is not None:
                choice["logprobs"] = item.logprobs
            continue
        part = item.item
        if isinstance(part, Chunk):
            choice["text"] += part.text
            if plan.logprobs is not None and part.logprobs:
                lp = _generated_logprobs(faces, part.logprobs, plan.logprobs, offsets[item.index])
                choice["logprobs"] = _extend(choice["logprobs"], lp)
            offsets[item.index] += len(part.text)
        else:
            choice["finish_reason"] = part.reason
            prompt_tokens += part.prompt_tokens
            completion_tokens += part.completion_tokens
    for choice in choices:
        if plan.logprobs is not None and choice["logprobs"] is None:
            choice["logprobs"] = {
                "tokens": [],
                "token_logprobs": [],
                "top_logprobs": [],
                "text_offset": [],
            }
    return {
        "id": plan.id,
        "object": "text_completion",
        "created": plan.created,
        "model": faces.name,
        "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def _sse(value: Any) -> bytes:
    return b"data: " + json.dumps(value, ensure_ascii=False).encode() + b"\n\n"


def _sse_error(error: BaseException) -> bytes:
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": 500}})


def _completion_events(
    faces: Faces, plan: CompletionPlan, state: dict[str, Any], item: Any
) -> Iterator[bytes]:
    def chunk(index: int, text: str, logprobs: Any, reason: str | None) -> bytes:
        return _sse(
            {
                "id": plan.id,
                "object": "text_completion",
                "created": plan.created,
                "model": faces.name,
                "choices": [
                    {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
                ],
            }
        )

    offsets = state.setdefault("offsets", {})
    if isinstance(item, Echoed):
        offsets[item.index] = len(item.text)
        yield chunk(item.index, item.text, item.logprobs, None)
        return
    part = item.item
    if isinstance(part, Chunk):
        lp = None
        if plan.logprobs is not None and part.logprobs:
            lp = _generated_logprobs(
                faces, part.logprobs, plan.logprobs, offsets.get(item.index, 0)
            )
        offsets[item.index] = offsets.get(item.index, 0) + len(part.text)
        yield chunk(item.index, part.text, lp, None)
        return
    usage = state.setdefault("usage", [0, 0])
    usage[0] += part.prompt_tokens
    usage[1] += part.completion_tokens
    yield chunk(item.index, "", None, part.reason)
    if plan.usage_in_stream and item.index == len(plan.prompts) - 1:
        yield _sse(
            {
                "id": plan.id,
                "object": "text_completion",
                "created": plan.created,
                "model": faces.name,
                "choices": [],
                "usage": _usage(*usage),
            }
        )


# --- /v1/chat/completions -------------------------------------------------------------------
@dataclass
class ChatPlan:
    prompt: PreparedPrompt
    options: GenerateOptions
    stops: list[str]
    stream: bool
    usage_in_stream: bool
    top: int | None  # None: no logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")


def _data_url(url: Any, where: str) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise FaceError(f"{where}: images must be data: URLs (base64)")
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise FaceError(f"{where}: images must be base64 data: URLs")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise FaceError(f"{where}: invalid base64 image data") from None


def chat_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """OpenAI messages as a chat template reads them: text parts kept, `image_url` parts as
    `{"type": "image"}` blocks, their bytes returned in order."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    if not messages:
        raise FaceError("messages must not be empty")
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise FaceError(f"messages[{i}].role must be a string")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    images.append(_data_url(url, f"messages[{i}].content[{j}]"))
                    parts.append({"type": "image"})
                else:
                    raise FaceError(f"messages[{i}].content[{j}]: unsupported content part")
            message = {**message, "content": parts}
        elif content is not None and not isinstance(content, str):
            raise FaceError(f"messages[{i}].content must be a string or a list of parts")
        out.append(message)
    return out, images


def plan_chat(faces: Faces, body: bytes, check: Callable[[], None]) -> ChatPlan:
    request: ChatBody = _decode(body, ChatBody)
    top = request.top_logprobs if request.logprobs else None
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise FaceError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}")
    asked = (
        request.max_completion_tokens
        if request.max_completion_tokens is not None
        else request.max_tokens
    )
    if asked is not None and asked < 1:
        raise FaceError("max_tokens must be at least 1")
    sampler = _sampler(request, bool(request.logprobs), top or 0)
    messages, images = chat_messages(request.messages)
    extra = dict(request.chat_template_kwargs or {})
    prompt = faces.chat_prompt(messages, images, check, tools=request.tools, **extra)
    budget = faces.room(len(prompt.tokens), asked)
    options = request.stream_options or {}
    return ChatPlan(
        prompt,
        GenerateOptions(num_predict=budget, sampler=sampler),
        _stops(request.stop),
        bool(request.stream),
        bool(options.get("include_usage")),
        top,
    )


def _chat_logprobs(logprobs: list[Logprob], k: int) -> list[dict[str, Any]]:
    def entry(lp: Logprob | Any) -> dict[str, Any]:
        return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode())}

    return [
        {**entry(lp), "top_logprobs": [entry(alt) for alt in lp.top_logprobs[:k]]}
        for lp in logprobs
    ]


@openai_errors
async def chat_completions(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    body = await request.read()
    with request_scope(request) as scope:
        plan = await off_loop(lambda: plan_chat(faces, body, scope.check))

        def work(job: Job, emit: Callable[[Any], None]) -> None:
            generate(faces.runner, plan.prompt, plan.options, plan.stops, job, emit)

        if plan.stream:
            return await stream(
                request,
                faces.runner,
                scope,
                work,
                "text/event-stream",
                functools.partial(_chat_events, faces, plan, {}),
                _sse_error,
                b"data: [DONE]\n\n",
            )
        generated = Generated.of(await collect(request, faces.runner, scope, work))
    text, finished = generated.text, generated.finished
    logprobs = None
    if plan.top is not None:
        logprobs = {"content": _chat_logprobs(generated.logprobs, plan.top)}
    return web.json_response(
        {
            "id": plan.id,
            "object": "chat.completion",
            "created": plan.created,
            "model": faces.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": finished.reason,
                }
            ],
            "usage": _usage(finished.prompt_tokens, finished.completion_tokens),
        }
    )


def _chat_events(faces: Faces, plan: ChatPlan, state: dict[str, Any], item: Any) -> Iterator[bytes]:
    def chunk(delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> bytes:
        return _sse(
            {
                "id": plan.id,
                "object": "chat.completion.chunk",
                "created": plan.created,
                "model": faces.name,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
                ],
            }
        )

    if not state.get("started"):
        state["started"] = True
        yield chunk({"role": "assistant", "content": ""}, None)
    if isinstance(item, Chunk):
        lp = None
        if plan.top is not None and item.logprobs:
            lp = {"content": _chat_logprobs(item.logprobs, plan.top)}
        if item.text or lp:
            yield chunk({"content": item.text}, None, lp)
        return
    yield chunk({}, item.reason)
    if plan.usage_in_stream:
        yield _sse(
            {
                "id": plan.id,
                "object": "chat.completion.chunk",
                "created": plan.created,
                "model": faces.name,
                "choices": [],
                "usage": _usage(item.prompt_tokens, item.completion_tokens),
            }
        )


# --- vLLM's tokenizer endpoints -------------------------------------------------------------
def _special_text(faces: Faces, key: str, ids: list[int]) -> str | None:
    if faces.chat_template is not None and key in faces.chat_template.special:
        return faces.chat_template.special[key]
    return faces.token_text(ids[0]) if ids else None


@openai_errors
async def tokenizer_info(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    tokenizer = faces.runner.tokenizer
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    info = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": _special_text(faces, "eos_token", tokenizer.eos_ids),
        "bos_token": _special_text(faces, "bos_token", bos),
        "pad_token": faces.chat_template.special.get("pad_token") if faces.chat_template else None,
        "add_bos_token": tokenizer.add_bos,
        "model_max_length": faces.context_length,
        "vocab_size": faces.vocab_limit,
        "chat_template": faces.chat_template.source if faces.chat_template else None,
    }
    return web.json_response(info)


@openai_errors
async def tokenize(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    body: TokenizeBody = _decode(await request.read(), TokenizeBody)
    specials = True if body.add_special_tokens is None else body.add_special_tokens

    def work() -> list[int]:
        tokenizer = faces.runner.tokenizer
        if body.messages is not None:
            messages, images = chat_messages(body.messages)
            if images:
                raise FaceError("tokenize: images are not tokenized here")
            generation = True if body.add_generation_prompt is None else body.add_generation_prompt
            return faces.chat_prompt(
                messages, [], lambda: None, add_generation_prompt=generation
            ).tokens
        if body.prompt is None:
            raise FaceError("tokenize: give prompt or messages")
        return tokenizer.encode(body.prompt, specials and tokenizer.add_bos)

    tokens = await off_loop(work)
    return web.json_response(
        {"count": len(tokens), "max_model_len": faces.context_length, "tokens": tokens}
    )


@openai_errors
async def detokenize(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    body: DetokenizeBody = _decode(await request.read(), DetokenizeBody)
    tokens = faces.token_prompt(body.tokens, "tokens")
    data = b"".join(faces.runner.tokenizer.token_bytes(t) for t in tokens)
    return web.json_response({"prompt": data.decode("utf-8", "replace")})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
