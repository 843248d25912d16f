"""A loaded model and what serves with it: the engine, the tokenizer, the scorer.

The HTTP side holds one `Runner`. Its methods that touch MLX are only ever called on the
engine's thread, through `Engine.run`/`Engine.call`; everything else (facts, tokenizing) is
safe from the event loop or a CPU executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import mlx.core as mx

from .cache.prefix_cache import ByteBudget, PrefixCache, budget_from_env
from .engine import Engine, Job
from .generate import Generator
from .loader import load_model_source
from .models import RunnerModel, ScoresRequests, build_model
from .score import Row, Scorer, ScoreResult
from .tokenizer import Tokenizer
from .wire import ScoreRequest, ScoreResponse

log = logging.getLogger(__name__)

# Keep small reusable buffers, but release a large working set once a request is done.
SCRATCH_LIMIT_BYTES = 512 << 20
STATUS_MEMORY_WAIT_SECONDS = 0.05


def compute_dtype() -> mx.Dtype | None:
    """float32 on the CPU backend (its bfloat16/float16 matmuls are slow); else as stored."""
    if mx.default_device() == mx.cpu:
        return mx.float32
    return None


class Runner:
    def __init__(
        self,
        engine: Engine,
        model: RunnerModel,
        tokenizer: Tokenizer,
        name: str,
        cache_budget: ByteBudget | None = None,
    ):
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        # Scoring and generation keep separate prefix caches under one byte budget, so
        # decisions never evict a chat's prefix and vice versa.
        self.cache_budget = cache_budget or ByteBudget(budget_from_env())
        self.score_cache = PrefixCache(
            model, name="score", budget=self.cache_budget, keep_hidden=True
        )
        self.scorer = Scorer(model, self.score_cache)
        self.generate_cache = PrefixCache(model, name="generate", budget=self.cache_budget)
        self.generator = Generator(model, tokenizer, self.generate_cache.begin)
        self.memory = StatusMemory(engine)

    @property
    def context_length(self) -> int:
        return self.model.context_length

    @classmethod
    def load(cls, engine: Engine, name: str, cache_budget: ByteBudget | None = None) -> Runner:
        """Load `name` on the engine thread; raises ModelLoadError (or ValueError) on failure."""

        def load(_: Job) -> Runner:
            started = time.perf_counter()
            source = load_model_source(name)
            tokenizer = Tokenizer(
                source.tokenizer_json,
                config=source.config,
                tokenizer_config=source.tokenizer_config,
                generation_config=source.generation_config,
            )
            dtype = compute_dtype()
            if dtype is not None:
                log.info(
                    "computing in %s: the %s backend is slow in bfloat16/float16 "
                    "(quantized weights stay quantized)",
                    dtype,
                    mx.default_device(),
                )
            model = build_model(source, dtype)
            log.info(
                "loaded model=%s architecture=%s context=%d seconds=%.2f",
                name,
                model.architecture,
                model.context_length,
                time.perf_counter() - started,
            )
            return cls(engine, model, tokenizer, name, cache_budget)

        return engine.call(load)

    # --- work that runs on the engine thread -------------------------------------------
    def score_by_model(self, request: ScoreRequest, job: Job) -> ScoreResponse:
        """The model's own scoring hook, with hidden rows from the scoring prefix cache."""
        assert isinstance(self.model, ScoresRequests)

        def hidden_row(tokens: list[int]) -> tuple[mx.array, int]:
            session = self.score_cache.begin(tokens)
            try:
                row = session.hidden_row
                if row is None:
                    row = session.prefill(len(tokens), job.check)
                return row, session.offset
            finally:
                session.close()

        with scratch_released():
            return self.model.score_request(request, self.tokenizer, hidden_row)

    def score(self, rows: Sequence[Row], job: Job) -> ScoreResult:
        with scratch_released():
            return self.scorer.score(rows, job.check)


@contextlib.contextmanager
def scratch_released() -> Iterator[None]:
    """After a request: release MLX scratch memory above the limit, or all of it when the
    request failed (its working set is no use to the next one)."""
    try:
        yield
    except BaseException:
        mx.clear_cache()
        raise
    if mx.get_cache_memory() > SCRATCH_LIMIT_BYTES:
        mx.clear_cache()


class StatusMemory:
    """MLX memory for /v1/status without waiting behind inference (UPSTREAM.md §1.5.6).

    At most one refresh is queued on the engine at a time; a reader waits up to 50 ms for
    it and otherwise gets the last value read.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.value = 0
        self._refresh: asyncio.Future[int] | None = None

    async def read(self, wait: float = STATUS_MEMORY_WAIT_SECONDS) -> int:
        if self._refresh is None or self._refresh.done():
            job = self.engine.submit(_memory_bytes, asyncio.get_running_loop())
            assert job.future is not None
            self._refresh = job.future
            self._refresh.add_done_callback(self._store)
        try:
            await asyncio.wait_for(asyncio.shield(self._refresh), wait)
        except (TimeoutError, asyncio.TimeoutError):
            pass
        except Exception:  # a failed read keeps the old value
            log.debug("memory refresh failed", exc_info=True)
        return self.value

    def _store(self, future: asyncio.Future[int]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.value = future.result()


def _memory_bytes(_: Job) -> int:
    return int(mx.get_active_memory() + mx.get_cache_memory())
