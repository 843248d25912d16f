"""Greedy generation of every tiny architecture equals Hugging Face transformers', token for
token.

Default tier: the stored goldens (tests/data/golden/generate_<arch>.json, written by
tests/golden/make_generate_goldens.py): from a 20-token prompt (longer than Gemma3's sliding
window of 8, so its ring wraps while decoding), 12 new tokens at temperature 0, plain and with
a repeat penalty over the whole sequence. `-m reference` recomputes them with transformers.
Also here: the generation prefix cache records exactly the tokens decode fed through it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from runner.cache import trie
from runner.engine import Job
from runner.generate.pipeline import DONE_LENGTH, DONE_STOP, GenerateOptions, Generator
from runner.protocol.errors import Cancelled
from tests.generators import generate, tiny_generator
from tests.golden.make_generate_goldens import reference_cases
from tests.tiny import GOLDEN, TINY_ARCHITECTURES, write_tiny_model


def assert_matches(generator: Generator, golden: dict[str, Any]) -> None:
    for case in golden["cases"]:
        tokens, stats = generate(
            generator, golden["prompt"], golden["max_new_tokens"], case["options"]
        )
        assert tokens == case["generated"], case["options"]
        assert stats.generated == len(case["generated"])
        assert stats.done_reason == (DONE_STOP if case["eos"] else DONE_LENGTH)


@pytest.fixture(scope="module")
def generators(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Generator]:
    root = tmp_path_factory.mktemp("tiny-generate")
    return {arch: tiny_generator(root / arch, arch) for arch in TINY_ARCHITECTURES}


def stored(arch: str) -> dict[str, Any]:
    return json.loads((GOLDEN / f"generate_{arch}.json").read_text())


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_greedy_generation_matches_stored_goldens(generators, arch):
    """Temperature 0 (and with repeat_penalty, repeat_last_n < 0) gives transformers' tokens."""
    golden = stored(arch)
    assert len(golden["prompt"]) > 8  # past Gemma3's window
    assert_matches(generators[arch], golden)


def assert_caches_hold(generator: Generator, tokens: list[int]) -> None:
    """The live caches hold exactly `tokens`, and the trie stored them on close."""
    live = generator.cache.live
    assert live.tokens == tokens
    offsets = [getattr(c, "offset", None) for c in live.caches]
    assert offsets and all(o in (None, len(tokens)) for o in offsets)
    stored_path, matched = trie.match(generator.cache.root, tokens)
    assert matched == len(tokens) and stored_path[-1].end == len(tokens)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3_5ForCausalLM"])
@pytest.mark.parametrize("n", [1, 5])
def test_session_records_every_fed_token(tmp_path, arch, n):
    """Decode feeds the seed (the last prompt token), then each generated token but the last
    (the budget needs no forward after it); the cache records each."""
    generator = tiny_generator(tmp_path, arch)
    prompt = stored(arch)["prompt"]
    tokens, _ = generate(generator, prompt, n, {})
    assert_caches_hold(generator, [*prompt, *tokens[:-1]])


def test_cancelling_records_the_forward_in_flight(tmp_path):
    """A cancelled decode stops before its next step, after waiting for the forward already
    dispatched, so the caches never hold a token the session was not told about."""
    generator = tiny_generator(tmp_path, "LlamaForCausalLM")
    prompt = stored("LlamaForCausalLM")["prompt"]
    job = Job(lambda _: None, None)
    seen = []
    steps = generator.steps(prompt, GenerateOptions(num_predict=10), job)
    with pytest.raises(Cancelled):
        for step in steps:
            seen.append(step.token)
            if len(seen) == 3:
                job.cancel()
    assert_caches_hold(generator, [*prompt, *seen])  # the third token's forward was in flight


@pytest.mark.reference
@pytest.mark.usefixtures("reference_libraries")
class TestReference:
    @pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
    def test_live_transformers_generation_matches(self, generators, tmp_path, arch):
        """Goldens recomputed now agree with the stored ones and with ours."""
        live = reference_cases(write_tiny_model(arch, tmp_path))
        golden = stored(arch)
        assert live["prompt"] == golden["prompt"]
        for now, then in zip(live["cases"], golden["cases"], strict=True):
            assert now["generated"] == then["generated"], "transformers drifted"
        assert_matches(generators[arch], live)
