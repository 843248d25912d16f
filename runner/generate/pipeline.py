"""Text generation on the MLX thread: the Go runner's pipeline (docs/PROTOCOL.md §5).

`Generator.generate(prompt, options, job, emit)`:
- a session of the generation prefix cache (the caches hold a restored prefix, or nothing),
  then the prompt is prefilled up to its last token, which is kept as the decode seed as Go
  does;
- decode is pipelined one step ahead like mlx-lm's `generate_step`: the forward for token n
  is dispatched (`mx.async_eval`) before the host reads token n, so graph building and the
  device overlap the host's detokenizing and streaming (on the CPU backend a decode step of
  a family the native step covers is one native call, runner/backend/native_step.py, and
  without the native library the one-row products run in numpy as they are built,
  runner/backend/gemv.py: either way the step is computed there and then);
- a greedy draw (no temperature, penalty or logprobs) from logits the native head computed
  on the host is their argmax taken there (`HostLogits`, runner/models/base.py): the same
  token as MLX's argmax, without a round trip through MLX's stream for it;
- the session records every token fed in decode (the seed included) and, when decode stops,
  waits for the forward still in flight (runner/cache/live.py); a failure discards the live
  state, a cancellation stores it;
- `job.check()` runs before every decode step, so a cancelled request stops within one step.

`emit` receives `CompletionResponse`s: a chunk whenever the detokenizer flushes text, then the
final one (Done, DoneReason 0 at EOS / 1 at the budget, prompt and eval counts, durations).
EOS ends the run without being streamed or counted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from collections.abc import Generator as Stream
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from runner.cache.prefix_cache import PrefixCache
from runner.cache.session import PrefixSession
from runner.engine import Job
from runner.generate.detokenize import Detokenizer, go_string
from runner.generate.sampling import Draw, Sampler, SamplerOptions, top_sorted
from runner.media.prepare import PreparedPrompt
from runner.media.request import RequestMedia
from runner.models import Model
from runner.models.base import DecodeSteps, HostLogits
from runner.protocol.wire import CompletionResponse, Logprob, TopLogprob
from runner.text.tokenizer import Tokenizer

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

    def __init__(self, model: Model, tokenizer: Tokenizer, cache: PrefixCache):
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache

    def generate(
        self,
        prompt: PreparedPrompt,
        options: GenerateOptions,
        job: Job,
        emit: Callable[[CompletionResponse], None],
    ) -> None:
        stats = Stats()
        detokenizer: Detokenizer[Logprob] = Detokenizer(self.tokenizer.token_bytes)
        tokens = prompt.tokens
        with contextlib.closing(self.steps(prompt, options, job, stats)) as steps:
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
        self,
        prompt: PreparedPrompt | list[int],
        options: GenerateOptions,
        job: Job,
        stats: Stats | None = None,
    ) -> Stream[Step, None, None]:
        """The generated tokens up to EOS (excluded) or the budget; fills `stats`. A prompt
        with images is stored under its keys (runner/media/prepare.py); its last token (the
        decode seed) is text."""
        stats = stats if stats is not None else Stats()
        if not isinstance(prompt, PreparedPrompt):
            prompt = PreparedPrompt(prompt)
        tokens = prompt.tokens
        media = RequestMedia(self.model, prompt) if prompt.items else None
        try:
            with self.cache.begin(prompt.keys, media=media) as session:
                started = time.perf_counter()
                if session.offset < len(tokens) - 1:
                    session.prefill(len(tokens) - 1, job.check)  # all but the decode seed
                stats.prompt_seconds = time.perf_counter() - started
                stats.eval_started = time.perf_counter()
                yield from self._decode(session, tokens, options, job, stats)
        finally:
            mx.clear_cache()  # Go clears unconditionally at the end of every request

    def _decode(
        self,
        session: PrefixSession,
        tokens: list[int],
        options: GenerateOptions,
        job: Job,
        stats: Stats,
    ) -> Stream[Step, None, None]:
        sampler = Sampler(options.sampler, self.model.context_length, tokens)
        budget = options.num_predict
        # A greedy draw from logits the native head computed on the host is their argmax
        # taken there: each MLX evaluation in a decode loop waits on MLX's stream thread
        # (~0.1-0.2 ms a round trip on a 2-core VM, two a token for argmax and its id).
        host = self.model if sampler.argmax_alone and isinstance(self.model, HostLogits) else None

        # A decode step's forward and head may be computed another exact way than a forward's
        # (runner/models/base.py, `DecodeSteps`)
        model = self.model
        steps = model.decode_steps if isinstance(model, DecodeSteps) else contextlib.nullcontext

        def forward(token: int | mx.array) -> Draw:
            with steps():
                hidden = session.decode(token)
                logits = host.host_logits(hidden) if host is not None else None
                if logits is not None:
                    return Draw(int(np.argmax(logits[0])))
                unembedded = model.unembed(hidden)[0]
            draw = sampler.sample(unembedded)
            mx.async_eval(*draw.arrays())
            return draw

        # At the top of each loop turn `draw` is in flight; the session records the tokens
        # fed and waits for the last forward when it closes.
        job.check()
        draw: Draw | None = forward(tokens[-1])  # the decode seed: the last prompt token
        while draw is not None:
            # Dispatch the next forward before reading this token, but only when another
            # token could still be wanted (the budget is not spent by this one).
            upcoming = None
            if stats.generated + 1 < budget:
                job.check()
                upcoming = forward(draw.token)
            current, token = draw, draw.token_id()
            draw = upcoming
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

    def _logprob(self, token: int, draw: Draw) -> Logprob:
        def text(t: int) -> str:
            return go_string(self.tokenizer.token_bytes(t))

        assert draw.logprob is not None
        top: list[TopLogprob] = []
        if draw.top_ids is not None and draw.top_logprobs is not None:
            pairs = top_sorted(draw.top_ids.tolist(), draw.top_logprobs.tolist())  # type: ignore[arg-type]
            top = [TopLogprob(text(t), lp) for t, lp in pairs]
        return Logprob(text(token), float(draw.logprob.item()), top)  # type: ignore[arg-type]
