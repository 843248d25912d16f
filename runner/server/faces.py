"""What `serve`'s public faces (runner/server/openai.py, runner/server/ollama.py) share.

- `Faces`: the loaded runner seen from them: its name, the chat template (the model's own,
  runner/text/chat_template.py), the prompt logprobs (runner/score/loglikelihood.py, over
  the scoring prefix cache) and the times reported.
- Prompts: text tokenized as a Go completion prompt (BOS only with `add_bos_token`), or
  token ids taken exactly as sent; images go through the runner's own preparation
  (`[img-N]` tags, runner/generate/prepare.py); a prompt that leaves no room past the
  context is refused with its count (`TooLong`), never cut.
- `generate`: one generation on the MLX thread through the runner's `Generator` (its
  prefix cache, its sampler, Go's UTF-8 hold-back), with stop strings cut before their
  first occurrence (`StopText`, holding back what could begin one); it emits `Chunk`s and
  one `Finished`.
- `stream`: a job's items streamed as they come (SSE for OpenAI, NDJSON for Ollama), with
  the Go wire's cancellation (`cancelled_on_disconnect`): a client that goes away cancels
  the job before its next token; the header goes out when the job starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from runner.engine import EngineStopped, Job
from runner.generate.detokenize import Detokenizer, go_string
from runner.generate.pipeline import DONE_STOP, GenerateOptions, Stats
from runner.generate.prepare import prepare_completion
from runner.media.prepare import PreparedPrompt
from runner.protocol.errors import Cancelled, RequestError
from runner.protocol.wire import CompletionRequest, Logprob, MediaItem, Options
from runner.score.loglikelihood import Loglikelihoods
from runner.server import app as go_app
from runner.service import Runner
from runner.text.chat_template import ChatTemplate, template_source

log = logging.getLogger(__name__)

CREATED = int(time.time())


class FaceError(Exception):
    """A request a face refuses: its status and message (each face writes its own shape)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind


class TooLong(FaceError):
    """A prompt past the context: refused with its count, never truncated."""


def too_long(count: int, context_length: int, asked: int = 0) -> TooLong:
    if asked:
        return TooLong(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {count + asked} tokens ({count} in the prompt, {asked} for the "
            "completion). Please reduce the prompt or the completion length."
        )
    return TooLong(
        f"This model's maximum context length is {context_length} tokens. However, the prompt "
        f"has {count} tokens, which leaves no room to complete it. Please reduce the prompt."
    )


class Faces:
    """The runner as the public faces use it."""

    def __init__(self, runner: Runner, chat_template: ChatTemplate | None = None):
        self.runner = runner
        self.name = Path(runner.name).name if Path(runner.name).is_dir() else runner.name
        self.chat_template = chat_template
        self.loglikelihoods = Loglikelihoods(runner.model, runner.score_cache)
        self.started = time.time()

    @classmethod
    def load(cls, runner: Runner) -> Faces:
        """With the model's chat template, when it has one (a model without one serves
        completions only: its chat endpoints answer 400)."""
        template = None
        try:
            config = runner.tokenizer_config
            source = template_source(config, runner.chat_template)
            if source is not None:
                template = ChatTemplate(source, config)
        except Exception as e:  # the faces still serve completions
            log.warning("no chat template: %s", e)
        return cls(runner, template)

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    @property
    def vocab_limit(self) -> int:
        return min(self.runner.tokenizer.vocab_size, self.runner.model.vocab_size)

    def token_text(self, token: int) -> str:
        return go_string(self.runner.tokenizer.token_bytes(token))

    # --- prompts (off the MLX thread) -----------------------------------------------------
    def text_prompt(self, text: str, add_bos: bool | None = None) -> list[int]:
        """`text` tokenized as a Go completion prompt (BOS only with `add_bos_token`, unless
        `add_bos` says), refused with its count when it leaves no room in the context."""
        tokenizer = self.runner.tokenizer
        bos = tokenizer.bos(tokenizer.add_bos if add_bos is None else add_bos)
        ((ids, _),) = tokenizer.encode_extended([(text, [])], self.context_length)
        if isinstance(ids, int):
            raise too_long(ids + len(bos), self.context_length)
        return [*bos, *ids]

    def token_prompt(self, ids: list[Any], where: str) -> list[int]:
        """Token ids as sent: ints that index the vocabulary, used exactly."""
        limit = self.vocab_limit
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limit:
                raise FaceError(f"{where}: token ids must be integers in [0, {limit}), not {t!r}")
        return list(ids)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        images: list[bytes],
        check: Callable[[], None],
        **template_args: Any,
    ) -> PreparedPrompt:
        """The conversation through the model's chat template (its images as `[img-N]`
        tags where the template placed them), tokenized as transformers tokenizes a
        rendered chat (no BOS beyond the template's own)."""
        from runner.text.chat_template import ChatTemplateError

        if self.chat_template is None:
            raise FaceError("this model has no chat template: use the completions endpoint")
        try:
            text = self.chat_template.render(messages, **template_args)
        except ChatTemplateError as e:
            raise FaceError(str(e)) from None
        tokenizer = self.runner.tokenizer
        bos_text = self.chat_template.special.get("bos_token")
        if tokenizer.add_bos and bos_text and text.startswith(bos_text):
            text = text[len(bos_text) :]  # the Go preparation adds the BOS id itself
        if images:
            text = place_images(text, len(images))
        return self.prepare(text, images, check)

    def prepare(self, text: str, images: list[bytes], check: Callable[[], None]) -> PreparedPrompt:
        """A text prompt with `[img-N]` tags for `images` (N their index) through the Go
        completion preparation: images expanded as the model does, its errors 400s."""
        if not images:
            return PreparedPrompt(self.text_prompt(text))
        import base64

        media = [
            MediaItem(data=base64.b64encode(data).decode(), id=i, kind="image")
            for i, data in enumerate(images)
        ]
        request = CompletionRequest(prompt=text, media=media, options=Options(num_predict=1))
        runner = self.runner
        try:
            prompt, _ = prepare_completion(
                request, runner.tokenizer, runner.context_length, runner.model, check
            )
        except RequestError as e:
            raise FaceError(e.message, e.status) from None
        return prompt

    def room(self, prompt_tokens: int, asked: int | None) -> int:
        """The completion budget: `asked` (refused with the counts past the context), or the
        rest of the context."""
        left = self.context_length - prompt_tokens
        if left <= 0:
            raise too_long(prompt_tokens, self.context_length)
        if asked is None or asked <= 0:
            return left
        if asked > left:
            raise too_long(prompt_tokens, self.context_length, asked)
        return asked


# Where chat templates put an image, in the order tried: Qwen3.5's and Gemma3's markers, each
# replaced by the runner's `[img-N]` tag, which the model expands as its processor does.
IMAGE_MARKERS = ("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")


def place_images(text: str, count: int) -> str:
    """`text` with the template's image markers replaced by `[img-0]`, `[img-1]`, ...; when
    the template placed none, the tags go first."""
    for marker in IMAGE_MARKERS:
        if text.count(marker) == count:
            parts = text.split(marker)
            out = [parts[0]]
            for i, part in enumerate(parts[1:]):
                out += [f"[img-{i}]", part]
            return "".join(out)
    return "".join(f"[img-{i}]" for i in range(count)) + text


# --- stop strings ---------------------------------------------------------------------------
class StopText:
    """Text streamed up to the first occurrence of any stop string (excluded); what could
    still begin one is held back until the next text decides."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self.held + text
        first = min((i for s in self.stops if (i := buffer.find(s)) >= 0), default=-1)
        if first >= 0:
            self.stopped, self.held = True, ""
            return buffer[:first]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buffer)), 0, -1):
                if buffer.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


# --- generation on the MLX thread -----------------------------------------------------------
@dataclass
class Chunk:
    text: str
    logprobs: list[Logprob] = field(default_factory=list)
    tokens: int = 0  # generated tokens this chunk completes


@dataclass
class Finished:
    reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float
    eval_seconds: float
    total_seconds: float
    tokens: list[int] = field(default_factory=list)  # the generated ids (EOS excluded)


def generate(
    runner: Runner,
    prompt: PreparedPrompt,
    options: GenerateOptions,
    stops: list[str],
    job: Job,
    emit: Callable[[Any], None],
) -> None:
    """Generate for `prompt`, emitting `Chunk`s and a final `Finished`."""
    began = time.perf_counter()
    stats = Stats()
    detokenizer: Detokenizer[Logprob] = Detokenizer(runner.tokenizer.token_bytes)
    stop = StopText(stops)
    generated: list[int] = []
    pending = 0
    with contextlib.closing(runner.generator.steps(prompt, options, job, stats)) as steps:
        for step in steps:
            generated.append(step.token)
            pending += 1
            flushed = detokenizer.add(step.token, step.logprob)
            if flushed is None:
                continue
            text, logprobs = flushed
            shown = stop.feed(text)
            if shown or logprobs:
                emit(Chunk(shown, logprobs, pending))
                pending = 0
            if stop.stopped:
                break
    rest = stop.flush()
    if rest:
        emit(Chunk(rest))
    if stop.stopped or stats.done_reason == DONE_STOP:
        reason = "stop"
    else:
        reason = "length"
    eval_seconds = time.perf_counter() - stats.eval_started if stats.eval_started else 0.0
    emit(
        Finished(
            reason,
            len(prompt.tokens),
            len(generated),
            stats.prompt_seconds,
            eval_seconds,
            time.perf_counter() - began,
            generated,
        )
    )


# --- running jobs from handlers ------------------------------------------------------------
class Scope(Protocol):
    """What a client's disconnect cancels (runner/server/app.py's request scope)."""

    def attach(self, job: Job) -> Job: ...

    def check(self) -> None: ...

    def cancel(self) -> None: ...


def request_scope(request: web.Request) -> AbstractContextManager[Scope]:
    """The Go wire's one cancellation mechanism (`cancelled_on_disconnect`) around a request:
    a client that goes away cancels its preparation and its job."""
    return go_app.cancelled_on_disconnect(request)


def submit(request: web.Request, runner: Runner, fn: Callable[[Job], Any]) -> Job:
    try:
        return runner.engine.submit(fn, asyncio.get_running_loop())
    except EngineStopped as e:
        raise FaceError(str(e), 503, "server_error") from None


async def outcome(job: Job) -> Any:
    assert job.future is not None
    return await asyncio.shield(job.future)


async def off_loop(fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def run_job(request: web.Request, runner: Runner, work: Callable[[Job], Any]) -> Any:
    """`work` on the engine, cancelled with the request (the Go wire's mechanism)."""
    with request_scope(request) as scope:
        return await run_in_scope(request, runner, scope, work)


async def run_in_scope(
    request: web.Request, runner: Runner, scope: Scope, work: Callable[[Job], Any]
) -> Any:
    job = scope.attach(submit(request, runner, work))
    return await outcome(job)


async def collect(
    request: web.Request,
    runner: Runner,
    scope: Scope,
    work: Callable[[Job, Callable[[Any], None]], None],
) -> list[Any]:
    """Everything `work(job, emit)` emits on the engine inside `scope`, in order."""
    items: list[Any] = []
    await run_in_scope(request, runner, scope, lambda job: work(job, items.append))
    return items


@dataclass
class Generated:
    """One generation's collected answer: its text, its end, its tokens' logprobs."""

    text: str
    finished: Finished
    logprobs: list[Logprob]

    @classmethod
    def of(cls, items: list[Any]) -> Generated:
        chunks = [i for i in items if isinstance(i, Chunk)]
        return cls(
            "".join(c.text for c in chunks),
            next(i for i in items if isinstance(i, Finished)),
            [lp for c in chunks for lp in c.logprobs],
        )


async def stream(
    request: web.Request,
    runner: Runner,
    scope: Scope,
    work: Callable[[Job, Callable[[Any], None]], None],
    content_type: str,
    encode: Callable[[Any], Iterator[bytes]],
    failed: Callable[[BaseException], bytes],
    end: bytes = b"",
) -> web.StreamResponse:
    """Run `work(job, emit)` on the engine inside `scope` and stream each emitted item as
    `encode` writes it (the Go wire's mechanism, runner/server/app.py `stream_emitted`); an
    error before the header goes out is the request's."""
    response, job = await go_app.stream_emitted(
        request,
        scope,
        functools.partial(submit, request, runner),
        work,
        content_type,
        encode,
        failed,
        end,
        headers={"Cache-Control": "no-cache"},
    )
    if response is None:
        if job.error is not None and not isinstance(job.error, Cancelled):
            raise job.error
        raise Cancelled()  # gone (or the runner stopped) before the job started
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
