"""Text generation on the MLX thread: the Go runner's pipeline (UPSTREAM.md §4.2-4.4).

`Generator.generate(tokens, options, job, emit)`:
- `session = begin(tokens)` (a cache session: maybe restored, else empty caches), then the
  prompt is prefilled up to its last token, which is kept as the decode seed as Go does;
- decode is pipelined one step ahead like mlx-lm's `generate_step`: the forward for token n
  is dispatched (`mx.async_eval`) before the host reads token n, so graph building and the
  device overlap the host's detokenizing and streaming (on the CPU backend the one-row
  products run in numpy as they are built, runner/models/cpu_gemv.py, so the step is
  computed there and then: twice as fast as the overlap it gives up);
- every token fed through the caches in decode (the seed included) is recorded with
  `session.append` once its forward is evaluated; when decode stops, the forward still in
  flight is waited for and recorded too, so the caches never hold an unrecorded token; a
  failed forward calls `session.fail()`; the session is closed always;
- `job.check()` runs before every decode step, so a cancelled request stops within one step.

`emit` receives `CompletionResponse`s: a chunk whenever the detokenizer flushes text, then the
final one (Done, DoneReason 0 at EOS / 1 at the budget, prompt and eval counts, durations).
EOS ends the run without being streamed or counted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .cache.session import CacheSession, fresh_sessions
from .detokenize import Detokenizer, go_string
from .engine import Job
from .errors import Cancelled
from .sampling import Draw, Sampler, SamplerOptions, top_sorted
from .tokenizer import Tokenizer
from .wire import CompletionResponse, Logprob, TopLogprob

log = logging.getLogger(__name__)

CLEAR_CACHE_INTERVAL = 256  # generated tokens between mx.clear_cache() calls, as Go
DONE_STOP = 0  # EOS
DONE_LENGTH = 1  # num_predict reached


@dataclass(frozen=True)
class GenerateOptions:
    num_predict: int  # already resolved against the context: 1 <= num_predict <= M - N
    sampler: SamplerOptions = field(default_factory=SamplerOptions)


@dataclass
class Step:
    """One decoded token as the host sees it."""

    token: int
    logprob: Logprob | None = None


@dataclass
class Stats:
    prompt_seconds: float = 0.0
    eval_started: float = 0.0
    generated: int = 0
    done_reason: int = DONE_LENGTH


class Generator:
    """Generates for one request at a time; call only on the MLX thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        begin: Callable[[list[int]], CacheSession] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.begin = begin if begin is not None else fresh_sessions(model)

    def generate(
        self,
        tokens: list[int],
        options: GenerateOptions,
        job: Job,
        emit: Callable[[CompletionResponse], None],
    ) -> None:
        stats = Stats()
        detokenizer: Detokenizer[Logprob] = Detokenizer(self.tokenizer.token_bytes)
        with contextlib.closing(self.steps(tokens, options, job, stats)) as steps:
            for step in steps:
                flushed = detokenizer.add(step.token, step.logprob)
                if flushed is not None:
                    text, logprobs = flushed
                    emit(CompletionResponse(Content=text, Logprobs=logprobs or None))
        emit(
            CompletionResponse(
                Done=True,
                DoneReason=stats.done_reason,
                PromptEvalCount=len(tokens),
                PromptEvalDuration=int(stats.prompt_seconds * 1e9),
                EvalCount=stats.generated,
                EvalDuration=int((time.perf_counter() - stats.eval_started) * 1e9),
            )
        )
        log.debug(
            "generated prompt=%d tokens=%d reason=%d prompt_seconds=%.3f",
            len(tokens),
            stats.generated,
            stats.done_reason,
            stats.prompt_seconds,
        )

    def steps(
        self, tokens: list[int], options: GenerateOptions, job: Job, stats: Stats | None = None
    ) -> Iterator[Step]:
        """The generated tokens up to EOS (excluded) or the budget; fills `stats`."""
        stats = stats if stats is not None else Stats()
        session = self.begin(tokens)
        try:
            started = time.perf_counter()
            first = self._prefill(session, tokens, job)
            stats.prompt_seconds = time.perf_counter() - started
            stats.eval_started = time.perf_counter()
            yield from self._decode(session, tokens, first, options, job, stats)
        finally:
            session.close()
            mx.clear_cache()  # Go clears unconditionally at the end of every request

    def _prefill(self, session: CacheSession, tokens: list[int], job: Job) -> mx.array | None:
        """Feed the prompt but its last token; the hidden row of the whole prompt when the
        session already has it (nothing left to compute), else None."""
        if session.hidden_row is not None and session.offset >= len(tokens):
            return session.hidden_row
        if session.offset < len(tokens) - 1:
            session.prefill(len(tokens) - 1, job.check)
        return None

    def _decode(
        self,
        session: CacheSession,
        tokens: list[int],
        hidden_row: mx.array | None,
        options: GenerateOptions,
        job: Job,
        stats: Stats,
    ) -> Iterator[Step]:
        sampler = Sampler(options.sampler, self.model.context_length, tokens)
        budget = options.num_predict

        def forward(token: mx.array) -> Draw:
            hidden = self.model.hidden(token.reshape(1, 1), session.caches)
            draw = sampler.sample(self.model.unembed(hidden[0, -1:])[0])
            mx.async_eval(*draw.arrays())
            return draw

        # Invariant at the top of each loop turn: `draw` is in flight, computed by the forward
        # of `fed` (None when a stored hidden row stood in for it). `fed` is recorded with
        # session.append once that forward is known to be evaluated: when its draw is read.
        fed: int | None = None
        draw: Draw | None = None
        try:
            job.check()
            if hidden_row is not None:
                draw = sampler.sample(self.model.unembed(hidden_row)[0])
                mx.async_eval(*draw.arrays())
            else:
                fed = tokens[-1]  # the decode seed: the last prompt token
                draw = forward(mx.array([fed], dtype=mx.int32))
            while draw is not None:
                # Dispatch the next forward before reading this token, but only when another
                # token could still be wanted (the budget is not spent by this one).
                upcoming = None
                if stats.generated + 1 < budget:
                    job.check()
                    upcoming = forward(draw.token)
                current, token = draw, draw.token.item()
                if fed is not None:
                    session.append(fed)
                fed, draw = (token if upcoming is not None else None), upcoming
                if self.tokenizer.is_eos(token):
                    stats.done_reason = DONE_STOP
                    break
                stats.generated += 1
                logprob = self._logprob(token, current) if options.sampler.logprobs else None
                yield Step(token, logprob)
                if stats.generated % CLEAR_CACHE_INTERVAL == 0:
                    mx.clear_cache()
            else:
                stats.done_reason = DONE_LENGTH
        except (Cancelled, GeneratorExit):
            self._settle(session, fed, draw)
            raise
        except BaseException:
            session.fail()  # a forward failed: the caches may be half-written
            raise
        self._settle(session, fed, draw)

    @staticmethod
    def _settle(session: CacheSession, fed: int | None, draw: Draw | None) -> None:
        """Wait for the forward still in flight and record the token it fed, so the caches
        never hold a token the session does not know."""
        if fed is not None and draw is not None:
            mx.eval(draw.token)
            session.append(fed)

    def _logprob(self, token: int, draw: Draw) -> Logprob:
        def text(t: int) -> str:
            return go_string(self.tokenizer.token_bytes(t))

        assert draw.logprob is not None
        top: list[TopLogprob] = []
        if draw.top_ids is not None and draw.top_logprobs is not None:
            pairs = top_sorted(draw.top_ids.tolist(), draw.top_logprobs.tolist())
            top = [TopLogprob(text(t), lp) for t, lp in pairs]
        return Logprob(text(token), draw.logprob.item(), top)
