"""A loaded model and what serves with it: the engine, the tokenizer, the caches.

The HTTP side holds one `Runner` and reaches it through the endpoint façades
(runner/endpoints.py). What touches MLX runs only on the engine's thread; the facts read
from any thread (`context_length`, `model.vocab_size`, ...) are plain values fixed at load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import mlx.core as mx

from .backend import Backend
from .cache.budget import ByteBudget, budget_from_env
from .cache.prefix_cache import PrefixCache
from .engine import Engine, Job
from .generate import Generator
from .loader import load_model_source
from .models import Model, build_model
from .score import Scorer
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Keep small reusable buffers, but release a large working set once a request is done.
SCRATCH_LIMIT_BYTES = 512 << 20
STATUS_MEMORY_WAIT_SECONDS = 0.05


class Runner:
    """A loaded model and everything that serves with it, on one engine.

    Scoring and generation keep separate prefix caches under one byte budget, so decisions
    never evict a chat's prefix and vice versa. Built on the engine thread (it makes caches).
    """

    def __init__(
        self,
        engine: Engine,
        model: Model,
        tokenizer: Tokenizer,
        name: str,
        cache_budget: ByteBudget | None = None,
        backend: Backend | None = None,
    ):
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.backend = backend if backend is not None else Backend.for_device()
        self.context_length = model.context_length
        self.cache_budget = cache_budget or ByteBudget(budget_from_env())
        chunk = self.backend.prefill_chunk_tokens
        self.score_cache = PrefixCache(
            model,
            name="score",
            budget=self.cache_budget,
            keep_hidden=True,
            chunk_tokens=chunk,
            batch_tokens=self.backend.batch_tokens,
            defer_stores=True,
        )
        self.scorer = Scorer(model, self.score_cache)
        self.generate_cache = PrefixCache(
            model, name="generate", budget=self.cache_budget, chunk_tokens=chunk, defer_stores=True
        )
        self.generator = Generator(model, tokenizer, self.generate_cache)
        for cache in (self.score_cache, self.generate_cache):
            # a request's answer does not wait for its cache's store (`defer_stores`): the
            # engine stores after delivering it, before the next job
            engine.after_each_job(cache.settle)
        self.memory = StatusMemory(engine)

    @classmethod
    def load(
        cls,
        engine: Engine,
        name: str,
        cache_budget: ByteBudget | None = None,
        backend: Backend | None = None,
    ) -> Runner:
        """Load `name` on the engine thread; raises ModelLoadError (or ValueError) on failure."""

        def load(_: Job) -> Runner:
            started = time.perf_counter()
            chosen = backend if backend is not None else Backend.for_device()
            source = load_model_source(name)
            tokenizer = Tokenizer(
                source.tokenizer_json,
                config=source.config,
                tokenizer_config=source.tokenizer_config,
                generation_config=source.generation_config,
            )
            if chosen.compute_dtype is not None:
                log.info(
                    "computing in %s: the %s backend is slow in bfloat16/float16 "
                    "(quantized weights stay quantized)",
                    chosen.compute_dtype,
                    chosen.name,
                )
            model = build_model(source, chosen)
            log.info(
                "loaded model=%s architecture=%s context=%d backend=%s seconds=%.2f",
                name,
                model.architecture,
                model.context_length,
                chosen.name,
                time.perf_counter() - started,
            )
            return cls(engine, model, tokenizer, name, cache_budget, chosen)

        return engine.call(load)


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
    """MLX memory for /v1/status without waiting behind inference (docs/PROTOCOL.md §6).

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
        except TimeoutError:
            pass
        except Exception:  # a failed read keeps the old value
            log.debug("memory refresh failed", exc_info=True)
        return self.value

    def _store(self, future: asyncio.Future[int]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.value = future.result()


def _memory_bytes(_: Job) -> int:
    return int(mx.get_active_memory() + mx.get_cache_memory())
