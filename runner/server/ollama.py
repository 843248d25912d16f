"""The Ollama face of `serve` (docs/SERVE.md): what the `ollama` client and the tools
built on it call.

- `POST /api/generate`: `prompt` (through the model's chat template as a user message after
  `system`, unless `raw` or the model has none), `images` (base64), `options`, `stream`
  (NDJSON, Ollama's default) or one JSON answer; no `prompt` loads the model (`done_reason`
  "load").
- `POST /api/chat`: `messages` (with `images`), through the chat template.
- `GET /api/tags`, `POST /api/show`, `GET /api/version`, `GET /api/ps`.

Options keep Ollama's names and defaults (temperature 0.8, top_k 40, top_p 0.9,
repeat_penalty 1.1 over the last 64 tokens, a random seed, no length limit but the context):
`num_predict`, `temperature`, `top_k`, `top_p`, `min_p`, `seed`, `stop`, `num_ctx` (a
smaller context: a prompt past it is refused with its count, never cut), `repeat_penalty`,
`repeat_last_n`, `presence_penalty`, `frequency_penalty`. Every answer line carries `model`
and `created_at`; the last one `done`, `done_reason` and the durations (nanoseconds):
`total_duration`, `load_duration`, `prompt_eval_count`, `prompt_eval_duration`,
`eval_count`, `eval_duration`. Errors are Ollama's `{"error": "..."}`: 400 for bad input,
never a 5xx for it.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from runner.engine import Job
from runner.generate.pipeline import GenerateOptions
from runner.generate.sampling import SamplerOptions
from runner.media.prepare import PreparedPrompt
from runner.protocol.errors import Cancelled
from runner.protocol.wire import Logprob
from runner.server.faces import (
    Chunk,
    FaceError,
    Faces,
    Finished,
    Generated,
    collect,
    generate,
    off_loop,
    request_scope,
    stream,
    too_long,
)
from runner.server.openai import FACES_KEY

log = logging.getLogger(__name__)

VERSION = "0.12.0"  # the Ollama API this face follows


class OllamaOptions(msgspec.Struct):
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    num_ctx: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class Message(msgspec.Struct):
    role: str
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[Any] | None = None


class GenerateBody(msgspec.Struct):
    model: str = ""
    prompt: str | None = None
    system: str | None = None
    images: list[str] | None = None
    raw: bool | None = None
    stream: bool | None = None
    options: OllamaOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    format: Any = None
    keep_alive: Any = None
    think: Any = None


class ChatBody(msgspec.Struct):
    model: str = ""
    messages: list[Message] | None = None
    stream: bool | None = None
    options: OllamaOptions | None = None
    tools: list[Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    format: Any = None
    keep_alive: Any = None
    think: Any = None


class ShowBody(msgspec.Struct):
    model: str = ""
    name: str = ""  # the older spelling


def _decode(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise FaceError(str(e)) from None
    except msgspec.DecodeError as e:
        raise FaceError(f"invalid JSON: {e}") from None


def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


def ollama_errors(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except FaceError as e:
            return error_response(e.message, e.status)
        except web.HTTPRequestEntityTooLarge as e:
            return error_response(f"request body too large: {e.text}")
        except Cancelled:
            if request.app[FACES_KEY].runner.engine.stopping:
                return error_response("runner is stopping", 503)
            return error_response("request cancelled", 499)
        except Exception as e:
            log.exception("request %s failed", request.path)
            return error_response(str(e) or type(e).__name__, 500)

    return wrapped


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _images(images: list[str] | None, where: str) -> list[bytes]:
    out = []
    for i, data in enumerate(images or []):
        try:
            out.append(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            raise FaceError(f"{where}[{i}]: invalid base64 image data") from None
    return out


@dataclass
class Plan:
    prompt: PreparedPrompt
    options: GenerateOptions
    stops: list[str]
    stream: bool
    chat: bool
    top: int | None
    started: float = field(default_factory=time.perf_counter)


def _options(
    faces: Faces, given: OllamaOptions | None, logprobs: bool, top: int
) -> tuple[SamplerOptions, list[str], int, int | None]:
    o = given or OllamaOptions()
    context = faces.context_length
    if o.num_ctx is not None and o.num_ctx > 0:
        context = min(context, o.num_ctx)
    temperature = 0.8 if o.temperature is None else o.temperature
    if temperature < 0:
        raise FaceError("temperature must be >= 0")
    sampler = SamplerOptions(
        temperature=temperature,
        top_k=40 if o.top_k is None else o.top_k,
        top_p=0.9 if o.top_p is None else o.top_p,
        min_p=o.min_p or 0.0,
        repeat_last_n=64 if o.repeat_last_n is None else o.repeat_last_n,
        repeat_penalty=1.1 if o.repeat_penalty is None else o.repeat_penalty,
        presence_penalty=o.presence_penalty or 0.0,
        frequency_penalty=o.frequency_penalty or 0.0,
        seed=-1 if o.seed is None else o.seed,
        logprobs=logprobs,
        top_logprobs=top,
    )
    stops = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    return sampler, stops, context, o.num_predict


def _plan(
    faces: Faces,
    messages: list[dict[str, Any]],
    images: list[bytes],
    raw_text: str | None,
    body: Any,
    check: Callable[[], None],
    chat: bool,
) -> Plan:
    if not body.model:
        raise FaceError("model is required")
    top = body.top_logprobs if body.logprobs else None
    if top is not None and not 0 <= top <= 20:
        raise FaceError("top_logprobs must be between 0 and 20")
    sampler, stops, context, num_predict = _options(
        faces, body.options, bool(body.logprobs), top or 0
    )
    if raw_text is not None:
        prompt = faces.prepare(raw_text, images, check)
    else:
        prompt = faces.chat_prompt(messages, images, check, tools=getattr(body, "tools", None))
    count = len(prompt.tokens)
    if count >= context:
        raise too_long(count, context)
    room = context - count
    budget = room if num_predict is None or num_predict <= 0 else min(num_predict, room)
    options = GenerateOptions(num_predict=budget, sampler=sampler)
    return Plan(prompt, options, stops, body.stream is not False, chat, top)


def _logprobs(logprobs: list[Logprob], k: int) -> list[dict[str, Any]]:
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top_logprobs[:k]],
        }
        for lp in logprobs
    ]


def _line(
    faces: Faces, plan: Plan, text: str, logprobs: list[Logprob] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": faces.name, "created_at": _now()}
    if plan.chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["response"] = text
    out["done"] = False
    if plan.top is not None and logprobs:
        out["logprobs"] = _logprobs(logprobs, plan.top)
    return out


def _done(faces: Faces, plan: Plan, finished: Finished, text: str = "") -> dict[str, Any]:
    out = _line(faces, plan, text)
    out.update(
        done=True,
        done_reason=finished.reason,
        total_duration=int((time.perf_counter() - plan.started) * 1e9),
        load_duration=0,
        prompt_eval_count=finished.prompt_tokens,
        prompt_eval_duration=int(finished.prompt_seconds * 1e9),
        eval_count=finished.completion_tokens,
        eval_duration=int(finished.eval_seconds * 1e9),
    )
    if not plan.chat:
        out["context"] = [*plan.prompt.tokens, *finished.tokens]
    return out


def _ndjson(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode() + b"\n"


def _events(faces: Faces, plan: Plan, item: Any) -> Iterator[bytes]:
    if isinstance(item, Chunk):
        if item.text or item.logprobs:
            yield _ndjson(_line(faces, plan, item.text, item.logprobs))
    else:
        yield _ndjson(_done(faces, plan, item))


def _failed(error: BaseException) -> bytes:
    return _ndjson({"error": getattr(error, "message", None) or str(error) or type(error).__name__})


async def _answer(
    request: web.Request, faces: Faces, plan_of: Callable[[Callable[[], None]], Plan]
) -> web.StreamResponse:
    with request_scope(request) as scope:
        plan = await off_loop(lambda: plan_of(scope.check))

        def work(job: Job, emit: Callable[[Any], None]) -> None:
            generate(faces.runner, plan.prompt, plan.options, plan.stops, job, emit)

        if plan.stream:
            return await stream(
                request,
                faces.runner,
                scope,
                work,
                "application/x-ndjson",
                functools.partial(_events, faces, plan),
                _failed,
            )
        generated = Generated.of(await collect(request, faces.runner, scope, work))
    answer = _done(faces, plan, generated.finished, generated.text)
    if plan.top is not None:
        answer["logprobs"] = _logprobs(generated.logprobs, plan.top)
    return web.json_response(answer)


@ollama_errors
async def generate_handler(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    body: GenerateBody = _decode(await request.read(), GenerateBody)
    if not body.model:
        raise FaceError("model is required")
    images = _images(body.images, "images")
    if not body.prompt and not images:  # Ollama's load request
        return web.json_response(
            {
                "model": faces.name,
                "created_at": _now(),
                "response": "",
                "done": True,
                "done_reason": "load",
            }
        )
    prompt = body.prompt or ""
    raw = bool(body.raw) or faces.chat_template is None
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    content: Any = prompt
    if images:
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": prompt}]
    messages.append({"role": "user", "content": content})
    raw_text = None
    if raw:
        raw_text = "".join(f"[img-{i}]" for i in range(len(images))) + prompt
    return await _answer(
        request,
        faces,
        lambda check: _plan(faces, messages, images, raw_text, body, check, chat=False),
    )


@ollama_errors
async def chat_handler(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    body: ChatBody = _decode(await request.read(), ChatBody)
    if not body.model:
        raise FaceError("model is required")
    if not body.messages:  # Ollama's load request
        return web.json_response(
            {
                "model": faces.name,
                "created_at": _now(),
                "message": {"role": "assistant", "content": ""},
                "done": True,
                "done_reason": "load",
            }
        )
    messages: list[dict[str, Any]] = []
    images: list[bytes] = []
    for i, m in enumerate(body.messages):
        pictures = _images(m.images, f"messages[{i}].images")
        images += pictures
        content: Any = m.content or ""
        if pictures:
            content = [
                *({"type": "image"} for _ in pictures),
                {"type": "text", "text": m.content or ""},
            ]
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.thinking:
            message["thinking"] = m.thinking
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        messages.append(message)
    return await _answer(
        request, faces, lambda check: _plan(faces, messages, images, None, body, check, chat=True)
    )


def _details(faces: Faces) -> dict[str, Any]:
    arch = faces.runner.model.architecture
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": arch,
        "families": [arch],
        "parameter_size": "",
        "quantization_level": "",
    }


def _entry(faces: Faces) -> dict[str, Any]:
    return {
        "name": faces.name,
        "model": faces.name,
        "modified_at": datetime.fromtimestamp(faces.started, UTC).isoformat(),
        "size": 0,
        "digest": "",
        "details": _details(faces),
    }


@ollama_errors
async def tags(request: web.Request) -> web.StreamResponse:
    return web.json_response({"models": [_entry(request.app[FACES_KEY])]})


@ollama_errors
async def ps(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    entry = {**_entry(faces), "expires_at": "2262-04-11T23:47:16.854775807Z", "size_vram": 0}
    entry["context_length"] = faces.context_length
    return web.json_response({"models": [entry]})


@ollama_errors
async def version(request: web.Request) -> web.StreamResponse:
    return web.json_response({"version": VERSION})


@ollama_errors
async def show(request: web.Request) -> web.StreamResponse:
    faces = request.app[FACES_KEY]
    body: ShowBody = _decode(await request.read(), ShowBody)
    if not (body.model or body.name):
        raise FaceError("model is required")
    arch = faces.runner.model.architecture
    capabilities = ["completion"]
    from runner.models import ImageModel

    if isinstance(faces.runner.model, ImageModel):
        capabilities.append("vision")
    return web.json_response(
        {
            "modelfile": "",
            "parameters": "",
            "template": faces.chat_template.source if faces.chat_template else "",
            "details": _details(faces),
            "model_info": {
                "general.architecture": arch,
                f"{arch}.context_length": faces.context_length,
                f"{arch}.vocab_size": faces.runner.model.vocab_size,
            },
            "capabilities": capabilities,
            "modified_at": datetime.fromtimestamp(faces.started, UTC).isoformat(),
        }
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/generate", generate_handler)
    app.router.add_post("/api/chat", chat_handler)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/ps", ps)
