"""Generation through its prefix cache: a conversation that goes on restores its history,
and generates exactly what an uncached runner generates."""

from __future__ import annotations

import logging
import re

import pytest

from tests.generators import generate, tiny_generator
from tests.tiny import IMAGE_TEXT_ARCHITECTURES, TINY_ARCHITECTURES, prefix_cache

GREEDY = {"temperature": 0.0}


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES + IMAGE_TEXT_ARCHITECTURES)
def test_extending_a_conversation_restores_it_and_generates_the_same(tmp_path, arch, caplog):
    cached = tiny_generator(tmp_path / "a", arch)
    fresh = tiny_generator(tmp_path / "b", arch)

    def uncached(prompt: list[int]) -> list[int]:
        fresh.cache = prefix_cache(fresh.model, name="fresh")  # empty: nothing to restore
        return generate(fresh, prompt, 6, GREEDY)[0]

    turn1 = [5, 17, 42, 99, 23, 8, 61, 7, 19, 33, 71, 12]
    out1, _ = generate(cached, turn1, 6, GREEDY)
    assert out1 == uncached(turn1)
    turn2 = [*turn1, *out1, 44, 45, 46]
    with caplog.at_level(logging.INFO, logger="runner.cache.prefix_cache"):
        out2, _ = generate(cached, turn2, 6, GREEDY)
    assert out2 == uncached(turn2)
    hits = [r.getMessage() for r in caplog.records if "prefix cache generate" in r.getMessage()]
    (line,) = hits
    cached_tokens = int(re.search(r"cached=(\d+)", line).group(1))
    # Everything the first request fed: its prompt and all but its last generated token.
    assert "hit" in line and cached_tokens == len(turn1) + len(out1) - 1
