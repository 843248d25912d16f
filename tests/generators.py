"""A generator over a tiny model, and generation through it (tests/test_generate_golden.py,
tests/test_generate_cache.py)."""

from __future__ import annotations

from pathlib import Path

from runner.engine import Job
from runner.generate.pipeline import GenerateOptions, Generator, Stats
from runner.generate.sampling import SamplerOptions
from runner.models import build_model
from runner.sources.loader import load_local_dir
from runner.text.tokenizer import Tokenizer
from tests.tiny import prefix_cache, write_tiny_model


def tiny_generator(path: Path, arch: str, dtype: str = "float32") -> Generator:
    """A generator over a tiny `arch` model stored in `dtype` at `path`."""
    return generator_of(write_tiny_model(arch, path, dtype=dtype))


def generator_of(model_dir: Path) -> Generator:
    """A generator over the model directory `model_dir`."""
    source = load_local_dir(model_dir)
    tokenizer = Tokenizer(
        source.tokenizer_json,
        config=source.config,
        tokenizer_config=source.tokenizer_config,
        generation_config=source.generation_config,
    )
    model = build_model(source)
    return Generator(model, tokenizer, prefix_cache(model, name="generate"))


def generate(generator: Generator, prompt: list[int], n: int, options: dict) -> tuple[list, Stats]:
    stats = Stats()
    job = Job(lambda _: None, None)
    sampler = SamplerOptions(**options)  # temperature 0: greedy
    steps = generator.steps(prompt, GenerateOptions(num_predict=n, sampler=sampler), job, stats)
    return [step.token for step in steps], stats
