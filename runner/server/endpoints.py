"""One façade per endpoint: validate -> engine -> response, for HTTP, the bench and tests.

Each façade has two halves with different homes, so the event loop and the MLX thread each
do only their own work (docs/DESIGN.md §1):
- `prepare(request, check)` runs on any thread but the MLX one (the HTTP side uses an
  executor; images go to the image pool from there): tokenizing and validation, raising
  BadRequest with the Go runner's texts; `check` raises `Cancelled` once the client has
  gone, and is called before each image is decoded;
- `execute(prepared, job, ...)` runs on the MLX thread (an engine job) and checks
  `job.check()` between units of work.
`__call__` does both from a plain thread (bench, tests): prepare here, execute on the engine.

Scoring is dispatched here: a `CachedScorer` model validates and scores whole requests
itself, asking for hidden rows through the scoring prefix cache; every other model goes
through `prepare_rows` and the runner's `Scorer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runner.engine import Job
from runner.generate.pipeline import GenerateOptions
from runner.generate.prepare import prepare_completion
from runner.media.prepare import PreparedPrompt
from runner.models import CachedScorer
from runner.protocol.wire import CompletionRequest, CompletionResponse, ScoreRequest, ScoreResponse
from runner.score.validate import Row, prepare_rows
from runner.server.memory import scratch_released
from runner.service import Runner

Check = Callable[[], None]  # raises Cancelled once the request is cancelled


@dataclass(frozen=True)
class ScorePlan:
    """A validated score request: its rows, or (for a `CachedScorer`) the request itself."""

    request: ScoreRequest
    rows: list[Row] | None


class ScoreEndpoint:
    """`/v1/score` (docs/PROTOCOL.md §4)."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def prepare(self, request: ScoreRequest, check: Check | None = None) -> ScorePlan:
        runner = self.runner
        if isinstance(runner.model, CachedScorer):  # it validates on the MLX thread itself
            return ScorePlan(request, None)
        rows = prepare_rows(
            request,
            runner.tokenizer,
            runner.context_length,
            runner.model.vocab_size,
            runner.model,
            check,
        )
        return ScorePlan(request, rows)

    def execute(self, plan: ScorePlan, job: Job) -> ScoreResponse:
        runner = self.runner
        with scratch_released():
            if plan.rows is None:
                assert isinstance(runner.model, CachedScorer)
                cache = runner.score_cache

                def hidden_rows(tokens: list[int]):
                    return cache.last_hidden(tokens, job.check)

                return runner.model.score(plan.request, runner.tokenizer, hidden_rows)
            result = runner.scorer.score(plan.rows, job.check)
        return ScoreResponse(
            logits=result.logits,
            input_tokens=sum(len(r.tokens) for r in plan.rows),
            cached_tokens=result.cached_tokens,
        )

    def __call__(self, request: ScoreRequest) -> ScoreResponse:
        plan = self.prepare(request)
        return self.runner.engine.call(lambda job: self.execute(plan, job))


@dataclass(frozen=True)
class PreparedCompletion:
    prompt: PreparedPrompt  # its tokens, and the images spliced into them
    options: GenerateOptions


Emit = Callable[[CompletionResponse], None]


class CompletionEndpoint:
    """`/v1/completions` (docs/PROTOCOL.md §5): `execute` emits the stream's lines."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def prepare(self, request: CompletionRequest, check: Check | None = None) -> PreparedCompletion:
        runner = self.runner
        prompt, options = prepare_completion(
            request, runner.tokenizer, runner.context_length, runner.model, check
        )
        return PreparedCompletion(prompt, options)

    def execute(self, prepared: PreparedCompletion, job: Job, emit: Emit) -> None:
        self.runner.generator.generate(prepared.prompt, prepared.options, job, emit)

    def __call__(self, request: CompletionRequest) -> list[CompletionResponse]:
        prepared = self.prepare(request)
        lines: list[CompletionResponse] = []
        self.runner.engine.call(lambda job: self.execute(prepared, job, lines.append))
        return lines
