"""The HTTP face of the runner: routes, decoding, encoding, cancellation (docs/PROTOCOL.md).

Handlers only decode bodies, hand them to the endpoint façades (runner/server/endpoints.py:
`prepare` in a CPU executor, never on the loop, its images on the image pool; `execute` as an
engine job) and encode what comes back; the loop never touches MLX. One mechanism cancels:
`cancelled_on_disconnect` cancels the request's scope when the client goes away (a transport
watcher) or the handler task is cancelled: its preparation stops before its next image, its
job (once submitted) before its next chunk or token.

Go conventions kept: every response is `application/json` unless a route says otherwise;
errors are `http.Error` text (message + newline, text/plain); unknown paths answer
`404 page not found`; the legacy paths answer 308 to their /v1 routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

from aiohttp import web

from runner.engine import EngineStopped, Job
from runner.protocol.errors import BadRequest, Cancelled, RequestError
from runner.protocol.go_json import DecodeError
from runner.protocol.wire import (
    CompletionResponse,
    StatusError,
    StatusResponse,
    decode_completion_request,
    decode_score_request,
    encode_json,
    go_encodable,
)
from runner.server.endpoints import CompletionEndpoint, ScoreEndpoint
from runner.server.memory import StatusMemory
from runner.service import Runner

log = logging.getLogger(__name__)
T = TypeVar("T")

RUNNER_KEY: web.AppKey[Runner] = web.AppKey("runner", Runner)
SCORE_KEY: web.AppKey[ScoreEndpoint] = web.AppKey("score", ScoreEndpoint)
COMPLETIONS_KEY: web.AppKey[CompletionEndpoint] = web.AppKey("completions", CompletionEndpoint)
MEMORY_KEY: web.AppKey[StatusMemory] = web.AppKey("memory", StatusMemory)
MAX_BODY_BYTES = 64 << 20
DISCONNECT_POLL_SECONDS = 0.05

REDIRECTS = {
    ("GET", "/health"): "/v1/status",
    ("POST", "/load"): "/v1/models",
    ("POST", "/score"): "/v1/score",
    ("POST", "/completion"): "/v1/completions",
}


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode_json(value), status=status, content_type="application/json")


def error_response(message: str, status: int) -> web.Response:
    """Go's http.Error: the message and a newline, as plain text."""
    return web.Response(
        text=message + "\n",
        status=status,
        content_type="text/plain",
        charset="utf-8",
        headers={"X-Content-Type-Options": "nosniff"},
    )


@web.middleware
async def go_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]):
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(f"request body too large: {e.text}", 400)
    except web.HTTPNotFound:
        return error_response("404 page not found", 404)
    except web.HTTPMethodNotAllowed as e:
        response = error_response("Method Not Allowed", 405)
        response.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
        return response
    except RequestError as e:
        return error_response(e.message, e.status)
    except web.HTTPException:
        raise
    except Cancelled:
        if request.app[RUNNER_KEY].engine.stopping:  # the client is there: say why
            return error_response("runner is stopping", 503)
        return error_response("request cancelled", 499)  # the client is gone
    except Exception as e:  # the process never dies from a request
        log.exception("request %s failed", request.path)
        return error_response(str(e) or type(e).__name__, 500)


async def status(request: web.Request) -> web.Response:
    memory = await request.app[MEMORY_KEY].read()
    return json_response(StatusResponse(0, 100, request.app[RUNNER_KEY].context_length, memory))


async def models(request: web.Request) -> web.Response:
    if request.method in ("GET", "POST"):
        return json_response({"Success": True})
    return web.Response(status=200)


async def tokenize(request: web.Request) -> web.Response:
    runner = request.app[RUNNER_KEY]
    text = (await request.read()).decode("utf-8", "replace")
    loop = asyncio.get_running_loop()
    tokenizer = runner.tokenizer
    ids = await loop.run_in_executor(None, lambda: tokenizer.encode(text, tokenizer.add_bos))
    return json_response(ids or None)


async def score(request: web.Request) -> web.Response:
    endpoint = request.app[SCORE_KEY]
    body = await request.read()
    with cancelled_on_disconnect(request) as scope:
        try:  # decoding a large body takes time: never on the loop (/v1/status must answer)
            plan = await _off_loop(
                decode_score_request, lambda r: endpoint.prepare(r, scope.check), body
            )
        except _Undecodable as e:
            raise BadRequest(str(e.error)) from None
        job = scope.attach(_submit(request, lambda job: endpoint.execute(plan, job)))
        answer = await _outcome(job)
    if not go_encodable(answer):
        # Go's encoder refuses a non-finite logit and writes nothing: the answer is a 200
        # with an empty body, which a Go client reads as an error, never as a 0.
        log.error("score: a logit is not finite; answering with an empty body, as Go does")
        return web.Response(status=200, content_type="application/json")
    return json_response(answer)


async def completions(request: web.Request) -> web.StreamResponse:
    endpoint = request.app[COMPLETIONS_KEY]
    body = await request.read()
    with cancelled_on_disconnect(request) as scope:
        try:
            prepared = await _off_loop(
                decode_completion_request, lambda r: endpoint.prepare(r, scope.check), body
            )
        except _Undecodable:
            raise BadRequest("Bad Request") from None  # Go's handler hides the decoder's text
        work = functools.partial(endpoint.execute, prepared)
        return await stream_jsonl(request, scope, work)


class _Undecodable(Exception):
    """The body did not decode (`error`: the decoder's); raised only by `_off_loop`'s decoding,
    so a DecodeError from anywhere else is not mistaken for a bad body."""

    def __init__(self, error: DecodeError):
        self.error = error


async def _off_loop(decode: Callable[[bytes], Any], prepare: Callable[[Any], T], body: bytes) -> T:
    """prepare(decode(body)) in one trip to the executor: each trip is a thread hand-off
    (~0.3-0.5 ms of a decision request measured, two trips against one)."""

    def run() -> T:
        try:
            decoded = decode(body)
        except DecodeError as e:
            raise _Undecodable(e) from None
        return prepare(decoded)

    return await asyncio.get_running_loop().run_in_executor(None, run)


_STARTED, _FINISHED = object(), object()


async def stream_emitted(
    request: web.Request,
    scope: Any,
    submit: Callable[[Callable[[Job], Any]], Job],
    work: Callable[[Job, Callable[[Any], None]], None],
    content_type: str,
    encode: Callable[[Any], Iterable[bytes] | None],
    failed: Callable[[BaseException], bytes],
    end: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[web.StreamResponse | None, Job]:
    """Run `work(job, emit)` on the engine (the job from `submit`, attached to `scope`, a
    `RequestScope`) and stream what it emits as `encode` writes each item; `encode` returning
    None ends the stream there and cancels the job. The response (None: never started) and
    the job, for the caller to end the request.

    The 200 header goes out when the job starts running (it is accepted), so a request still
    queued can end without one. Emitted items cross from the MLX thread in order through
    `call_soon_threadsafe`, followed by the job's completion. A failure after the header is
    one `failed(error)` chunk, sent only while the client is still there; a disconnect
    cancels the job (it stops before its next token) and nothing more is written; `end`
    closes a stream that finished."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def emit(item: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def job_fn(job: Job) -> None:
        emit(_STARTED)
        work(job, emit)

    job = scope.attach(submit(job_fn))
    assert job.future is not None
    job.future.add_done_callback(lambda _: queue.put_nowait(_FINISHED))
    response: web.StreamResponse | None = None
    try:
        while (item := await queue.get()) is not _FINISHED:
            if _gone(request):
                continue  # the job is cancelled; wait for it to stop
            if item is _STARTED:
                response = web.StreamResponse(status=200, headers=headers)
                response.content_type = content_type
                await response.prepare(request)
                continue
            data = encode(item)
            if data is None:
                job.cancel()
                break
            assert response is not None
            for chunk in data:
                await response.write(chunk)
        error = job.error
        if response is not None and error is not None and not isinstance(error, Cancelled):
            log.error("Request terminated: %s", error, exc_info=error)
            if not _gone(request):
                await response.write(failed(error))
        elif response is not None and error is None and end and not _gone(request):
            await response.write(end)
    except ConnectionError:
        log.info("client disconnected; cancelling %s", request.path)
        scope.cancel()
    if response is not None:
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    return response, job


async def stream_jsonl(
    request: web.Request, scope: RequestScope, work: Callable[[Job, Callable[[Any], None]], None]
) -> web.StreamResponse:
    """`stream_emitted` in the Go wire's form: one JSON line an item, an `Error` line for a
    failure after the header."""
    response, _ = await stream_emitted(
        request,
        scope,
        functools.partial(_submit, request),
        work,
        "application/jsonl",
        _jsonl_line,
        lambda error: encode_json(_error_line(error)),
    )
    if response is None:
        raise Cancelled()  # gone (or the runner stopped) before the job started
    return response


def _jsonl_line(item: Any) -> list[bytes] | None:
    if not go_encodable(item):
        # Go's encoder refuses a non-finite logprob and its handler stops the stream there:
        # no more lines, no Done line, the work cancelled.
        log.error("completion: a logprob is not finite; ending the stream")
        return None
    return [encode_json(item)]


def _error_line(error: BaseException) -> CompletionResponse:
    """Go wraps an error that is not an api.StatusError as a 500; Status stays empty."""
    if isinstance(error, RequestError):
        return CompletionResponse(Error=StatusError(error.status, "", error.message))
    return CompletionResponse(Error=StatusError(500, "", str(error) or type(error).__name__))


def _submit(request: web.Request, fn: Callable[[Job], Any]) -> Job:
    try:
        return request.app[RUNNER_KEY].engine.submit(fn, asyncio.get_running_loop())
    except EngineStopped as e:
        raise RequestError(str(e), 503) from None


async def _outcome(job: Job) -> Any:
    """The job's result (its error raised), without cancelling it if this await is."""
    assert job.future is not None
    return await asyncio.shield(job.future)


class RequestScope:
    """What a client's disconnect cancels: the request's preparation (`check`, called before
    each image it decodes, raises `Cancelled`) and, once submitted, its engine job."""

    def __init__(self) -> None:
        self._cancelled = threading.Event()  # read from the executor and image threads
        self.job: Job | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()
        if self.job is not None:
            self.job.cancel()

    def check(self) -> None:
        if self._cancelled.is_set():
            raise Cancelled()

    def attach(self, job: Job) -> Job:
        """`job` is the request's: cancelled with it (at once if it already is)."""
        self.job = job
        if self._cancelled.is_set():
            job.cancel()
        return job


@contextlib.contextmanager
def cancelled_on_disconnect(request: web.Request) -> Iterator[RequestScope]:
    """The one cancellation mechanism: while inside, a client that goes away cancels the
    request's scope (its preparation, then its job); leaving early (the handler task
    cancelled, an error) cancels it too. Cancelling what has finished does nothing."""
    scope = RequestScope()
    watcher = asyncio.ensure_future(_cancel_when_gone(request, scope))
    try:
        yield scope
    finally:
        watcher.cancel()
        scope.cancel()
        job = scope.job
        if job is not None:
            assert job.future is not None
            job.future.add_done_callback(lambda f: f.cancelled() or f.exception())


async def _cancel_when_gone(request: web.Request, scope: RequestScope) -> None:
    while not _gone(request):
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    log.info("client disconnected; cancelling %s", request.path)
    scope.cancel()


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _redirect(target: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=308, headers={"Location": target})

    return handler


def build_app(runner: Runner, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[go_errors])
    app[RUNNER_KEY] = runner
    app[SCORE_KEY] = ScoreEndpoint(runner)
    app[COMPLETIONS_KEY] = CompletionEndpoint(runner)
    app[MEMORY_KEY] = StatusMemory(runner.engine)
    app.router.add_get("/v1/status", status)
    app.router.add_route("*", "/v1/models", models)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/v1/score", score)
    app.router.add_post("/v1/completions", completions)
    for (method, path), target in REDIRECTS.items():
        app.router.add_route(method, path, _redirect(target))
        if method == "GET":  # Go's GET patterns match HEAD too
            app.router.add_route("HEAD", path, _redirect(target))
    return app
