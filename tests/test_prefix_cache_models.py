"""The prefix cache on real tiny models of every cache kind: numbers never change.

Llama has only KV caches, Gemma3 adds sliding-window rings (window 8, so they wrap),
Qwen3.5 adds recurrent gated-delta states; each restores differently.
"""

from __future__ import annotations

import logging
import random

import pytest

from runner.score.scorer import Scorer
from runner.score.validate import Row
from tests.tiny import IMAGE_TEXT_ARCHITECTURES, TINY_ARCHITECTURES, prefix_cache, score_uncached

SHARED = "You are a careful judge. Answer each question with Yes or No. " * 22


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES + IMAGE_TEXT_ARCHITECTURES)
def test_random_requests_cached_equal_uncached(engine, loaded_models, arch):
    runner = loaded_models(arch)
    model = runner.model
    rng = random.Random(7)
    cache = engine.call(
        lambda job: prefix_cache(model, name="prop", keep_hidden=True, chunk_tokens=5)
    )
    cached_scorer = Scorer(model, cache)
    alphabet = [5, 17, 42, 99]
    history: list[list[int]] = []
    restored = 0
    for _ in range(12):
        rows = []
        for _ in range(rng.randint(1, 3)):
            base = rng.choice(history) if history and rng.random() < 0.8 else []
            tokens = base[: rng.randint(0, len(base))] + rng.choices(alphabet, k=rng.randint(1, 9))
            rows.append(Row(tokens, [3, 7, 11]))
            history.append(tokens)
        warm = engine.call(lambda job, r=rows: cached_scorer.score(r, job.check))
        cold = engine.call(lambda job, r=rows: score_uncached(model, r, job.check))
        restored += warm.cached_tokens
        for a, b in zip(warm.logits, cold.logits, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
    assert restored > 0  # the cache was actually used


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
async def test_second_request_sharing_300_tokens_restores_them(fresh_runner, make_client, arch):
    runner = fresh_runner(arch)
    client = await make_client(runner)
    assert len(runner.tokenizer.encode(SHARED)) >= 300

    def request(questions):
        return {
            "rows": [{"prompt": SHARED + q, "candidates": [" Yes", " No"]} for q in questions],
            "max_tokens": 1024,
        }

    first = await client.post("/v1/score", json=request(["Is fire hot?", "Is ice hot?"]))
    assert first.status == 200, await first.text()
    second_request = request(["Is snow white?", "Is coal white?", "Is milk white?"])
    second = await (await client.post("/v1/score", json=second_request)).json()
    assert second["cached_tokens"] >= 300 * 3
    cold = await (
        await (await make_client(fresh_runner(arch))).post("/v1/score", json=second_request)
    ).json()
    assert cold["cached_tokens"] < second["cached_tokens"]
    for warm_row, cold_row in zip(second["logits"], cold["logits"], strict=True):
        assert warm_row == pytest.approx(cold_row, abs=1e-4)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES + IMAGE_TEXT_ARCHITECTURES)
@pytest.mark.parametrize("batch_bytes", [1 << 30, 1])  # one batch; one row per batch
def test_batched_suffixes_equal_rows_one_by_one(
    engine, loaded_models, monkeypatch, arch, batch_bytes
):
    from runner.cache import session

    monkeypatch.setattr(session, "BATCH_BYTES", batch_bytes)
    model = loaded_models(arch).model
    rng = random.Random(3)
    shared = rng.choices(range(3, 300), k=40)  # past Gemma3's window of 8
    suffixes = [rng.choices(range(3, 300), k=n) for n in (1, 5, 12, 3, 12, 0)]
    rows = [Row(shared + s, [3, 7, 11]) for s in suffixes]
    cache = engine.call(lambda job: prefix_cache(model, name="batch", keep_hidden=True))
    batched = engine.call(lambda job: Scorer(model, cache).score(rows, job.check))
    alone = [engine.call(lambda job, r=r: score_uncached(model, [r], job.check)) for r in rows]
    for got, want in zip(batched.logits, alone, strict=True):
        assert got == pytest.approx(want.logits[0], abs=1e-4)
    assert batched.cached_tokens == 40 * (len(rows) - 1)
    # Every row is stored now: the same request again computes nothing.
    again = engine.call(lambda job: Scorer(model, cache).score(rows, job.check))
    assert again.cached_tokens == sum(len(r.tokens) for r in rows)
    for got, want in zip(again.logits, batched.logits, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_rows_sharing_more_than_the_batch_prefix_store_whole_nodes(engine, loaded_models, arch):
    """Rows of one batch that share more with each other than with every row: the second
    row's path cuts the node the first row's suffix was just stored in. Both parts must hold
    that row's segments (the front part once held none, and the next restore through it
    failed with a 500: found by the fuzz)."""
    model = loaded_models(arch).model
    rng = random.Random(5)
    shared = rng.choices(range(3, 300), k=40)
    a, b, c = rng.sample(range(3, 300), 3)
    rows = [
        Row([*shared, a, b, c, a, b, c], [3, 7, 11]),
        Row([*shared, a, b, b], [3, 7, 11]),  # cuts the first row's node after [a, b]
        Row([*shared, c], [3, 7, 11]),
    ]
    cache = engine.call(lambda job: prefix_cache(model, name="cut", keep_hidden=True))
    engine.call(lambda job: Scorer(model, cache).score(rows, job.check))
    later = [Row([*shared, a, b, a], [3, 7, 11]), Row([*shared, a, c], [3, 7, 11])]
    for row in [*later, *rows]:
        warm = engine.call(lambda job, r=row: Scorer(model, cache).score([r], job.check))
        cold = engine.call(lambda job, r=row: score_uncached(model, [r], job.check))
        assert warm.logits[0] == pytest.approx(cold.logits[0], abs=1e-4)
    assert warm.cached_tokens == len(rows[-1].tokens)  # stored whole, restored whole


def test_memory_held_is_the_memory_counted(engine, loaded_models):
    """Snapshots are materialised when stored: a lazy copy would keep its whole source
    buffer alive while the budget counts only the copy (the byte budget would then never
    evict enough)."""
    import mlx.core as mx

    model = loaded_models("LlamaForCausalLM").model
    rng = random.Random(11)

    def run(job):
        mx.clear_cache()
        cache = prefix_cache(model, name="memory", keep_hidden=True)
        before = mx.get_active_memory()
        for _ in range(20):
            shared = rng.choices(range(3, 300), k=150)
            rows = [Row(shared + rng.choices(range(3, 300), k=5), [3, 7]) for _ in range(4)]
            Scorer(model, cache).score(rows, job.check)
        mx.clear_cache()
        live = sum(a.nbytes for a in cache.live.arrays())
        return mx.get_active_memory() - before, cache.nbytes, live

    held, counted, live = engine.call(run)
    assert counted > 0
    assert held <= 1.25 * (counted + live) + (1 << 20)


def test_rows_over_latent_caches_are_scored_one_by_one(engine, loaded_models, monkeypatch, caplog):
    """GLM's latent (MLA) caches cannot batch rows over a shared prefix (its attention scores
    every cached position itself): the scorer says so in the log and scores the rows in turn,
    each restoring the stored prefix, with the numbers of rows scored alone."""
    from runner.cache.session import PrefixSession

    def batched(*args, **kwargs):
        raise AssertionError("rows were batched over latent caches")

    monkeypatch.setattr(PrefixSession, "forward_rows", batched)
    model = loaded_models("Glm4MoeLiteForCausalLM").model
    rng = random.Random(5)
    shared = rng.choices(range(3, 300), k=30)
    rows = [Row(shared + rng.choices(range(3, 300), k=n), [3, 7, 11]) for n in (4, 9, 1)]
    cache = engine.call(lambda job: prefix_cache(model, name="latent", keep_hidden=True))
    with caplog.at_level(logging.INFO, logger="runner.score.scorer"):
        scorer = Scorer(model, cache)
    assert "one by one: latent kv caches cannot be batched" in caplog.text
    result = engine.call(lambda job: scorer.score(rows, job.check))
    assert result.cached_tokens == 30 * (len(rows) - 1)
    alone = [engine.call(lambda job, r=r: score_uncached(model, [r], job.check)) for r in rows]
    for got, want in zip(result.logits, alone, strict=True):
        assert got == pytest.approx(want.logits[0], abs=1e-4)
