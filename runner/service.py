"""A loaded model and what serves with it: the engine, the tokenizer, the caches.

The HTTP side holds one `Runner` and reaches it through the endpoint façades
(runner/server/endpoints.py). What touches MLX runs only on the engine's thread; the facts read
from any thread (`context_length`, `model.vocab_size`, ...) are plain values fixed at load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from runner.backend import Backend
from runner.cache.budget import ByteBudget, budget_from_env
from runner.cache.prefix_cache import PrefixCache
from runner.engine import Engine, Job
from runner.generate.pipeline import Generator
from runner.models import Model, build_model
from runner.score.scorer import Scorer
from runner.sources.loader import load_model_source
from runner.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
        prefix_cache: Callable[..., PrefixCache] = PrefixCache,
    ):
        # the model's tokenizer_config.json and chat_template.jinja, as loaded (the public
        # faces render chat templates from them: runner/server/faces.py)
        self.tokenizer_config: dict[str, Any] | None = None
        self.chat_template: str | None = None
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.backend = backend if backend is not None else Backend.for_device()
        self.context_length = model.context_length
        self.cache_budget = cache_budget or ByteBudget(budget_from_env())
        chunk, batch = self.backend.prefill_chunk_tokens, self.backend.batch_tokens
        self.score_cache = prefix_cache(
            model,
            name="score",
            budget=self.cache_budget,
            keep_hidden=True,
            chunk_tokens=chunk,
            batch_tokens=batch,
            defer_stores=True,
        )
        self.scorer = Scorer(model, self.score_cache)
        self.generate_cache = prefix_cache(
            model,
            name="generate",
            budget=self.cache_budget,
            chunk_tokens=chunk,
            batch_tokens=batch,
            defer_stores=True,
        )
        self.generator = Generator(model, tokenizer, self.generate_cache)
        for cache in (self.score_cache, self.generate_cache):
            # a request's answer does not wait for its cache's store (`defer_stores`): the
            # engine stores after delivering it, before the next job
            engine.after_each_job(cache.settle)

    @classmethod
    def load(
        cls,
        engine: Engine,
        name: str,
        cache_budget: ByteBudget | None = None,
        backend: Backend | None = None,
        distribute: Callable[[Any, str], None] | None = None,
        prefix_cache: Callable[..., PrefixCache] = PrefixCache,
    ) -> Runner:
        """Load `name` on the engine thread; raises ModelLoadError (or ValueError) on failure.
        `distribute` and `prefix_cache`: a rank of a process group's (runner/distributed/)."""

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
            model = build_model(source, chosen, distribute)
            log.info(
                "loaded model=%s architecture=%s context=%d backend=%s seconds=%.2f",
                name,
                model.architecture,
                model.context_length,
                chosen.name,
                time.perf_counter() - started,
            )
            runner = cls(engine, model, tokenizer, name, cache_budget, chosen, prefix_cache)
            runner.tokenizer_config = source.tokenizer_config
            runner.chat_template = source.chat_template
            return runner

        return engine.call(load)
