"""`serve`: the runner's app (the Go wire, exactly as in runner mode) with the public faces.

`build_serve_app(runner)` is `build_app(runner)` plus the OpenAI face and vLLM's tokenizer
endpoints (runner/server/openai.py) and the Ollama face (runner/server/ollama.py). Two paths
are shared with the Go wire, and the request decides (docs/SERVE.md §1):
- `POST /v1/completions`: a body that is a JSON object with a key the Go `CompletionRequest`
  does not have (OpenAI's `model`, `max_tokens`, `echo`, ...), or a number for `logprobs`
  (Go's is a boolean), is OpenAI's, and so is a body that is not JSON but names one of
  OpenAI's keys; any other body is the Go wire's, answered as before;
- `GET /v1/models`: OpenAI's model list, with the Go wire's `"Success": true` in it;
  `POST /v1/models` stays the Go wire's.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from runner.server import ollama, openai
from runner.server.app import MAX_BODY_BYTES, build_app
from runner.server.faces import Faces
from runner.service import Runner

# The Go CompletionRequest's keys, as Go matches them (case-insensitively).
GO_COMPLETION_KEYS = frozenset({"prompt", "media", "options", "logprobs", "toplogprobs"})
_NUMBER_START = frozenset(b"-0123456789")
_OPENAI_KEY = re.compile(rb'"(model|max_tokens|echo|stream|temperature|top_p|n|stop|seed)"\s*:')


def is_openai_completion(body: bytes) -> bool:
    """Whether a /v1/completions body is OpenAI's rather than the Go wire's."""
    try:
        members = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        # not a JSON object: OpenAI's when it names one of OpenAI's keys, else the Go
        # decoder says what is wrong with it
        return _OPENAI_KEY.search(body[:4096]) is not None
    for key, value in members.items():
        folded = key.casefold()
        if folded not in GO_COMPLETION_KEYS:
            return True
        raw = bytes(value)
        if folded == "logprobs" and raw[:1] and raw[0] in _NUMBER_START:
            return True
    return False


@web.middleware
async def public_faces(
    request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
) -> Any:
    """The two paths the faces share with the Go wire, decided per request."""
    if request.path == "/v1/completions" and request.method == "POST":
        try:
            body = await request.read()  # kept by aiohttp: the Go handler reads it again
        except web.HTTPRequestEntityTooLarge:
            return await handler(request)  # the Go wire's answer
        if is_openai_completion(body):
            return await openai.completions(request)
    elif request.path == "/v1/models" and request.method == "GET":
        return await openai.models(request)
    return await handler(request)


def build_serve_app(
    runner: Runner, max_body_bytes: int = MAX_BODY_BYTES, faces: Faces | None = None
) -> web.Application:
    app = build_app(runner, max_body_bytes)
    app[openai.FACES_KEY] = faces if faces is not None else Faces.load(runner)
    openai.add_routes(app)
    ollama.add_routes(app)
    app.middlewares.append(public_faces)
    return app
