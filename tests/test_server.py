"""The runner over HTTP with a tiny model: routes, scoring equivalences, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import mlx.core as mx
import pytest

from runner.protocol.errors import Cancelled
from runner.protocol.wire import ScoreRequest, ScoreRow
from runner.score.scorer import Scorer
from runner.score.validate import Row, prepare_rows
from tests.candidates import full_vocab_logits, single_token_candidates
from tests.tiny import prefix_cache

PREFIX = "Answer with Yes or No. Is the sky blue? Is grass green? Is the sea wet? Q:"


async def score(client, rows, max_tokens=512):
    response = await client.post("/v1/score", json={"rows": rows, "max_tokens": max_tokens})
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("application/json")
    return await response.json()


# --- routes -------------------------------------------------------------------------------


async def test_status_reports_context_and_memory(client, llama_runner):
    response = await client.get("/v1/status")
    assert response.status == 200
    body = await response.json()
    assert body["Status"] == 0 and body["Progress"] == 100
    assert body["ContextLength"] == llama_runner.context_length
    assert isinstance(body["Memory"], int) and body["Memory"] > 0


async def test_status_never_waits_behind_inference(client, engine):
    gate = threading.Event()
    blocker = engine.submit(lambda job: gate.wait(30))
    try:
        started = time.perf_counter()
        response = await client.get("/v1/status")
        assert response.status == 200
        assert time.perf_counter() - started < 2
    finally:
        gate.set()
        blocker.done.wait(5)


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_models_answers_success(client, method):
    response = await client.request(method, "/v1/models")
    assert response.status == 200
    assert await response.json() == {"Success": True}


async def test_models_other_methods_answer_empty_200(client):
    response = await client.delete("/v1/models")
    assert response.status == 200
    assert await response.read() == b""


@pytest.mark.parametrize(
    ("method", "path", "target"),
    [
        ("GET", "/health", "/v1/status"),
        ("POST", "/load", "/v1/models"),
        ("POST", "/score", "/v1/score"),
    ],
)
async def test_legacy_paths_redirect_with_308(client, method, path, target):
    response = await client.request(method, path, allow_redirects=False)
    assert response.status == 308
    assert response.headers["Location"] == target


async def test_score_legacy_path_follows_308_with_body(client):
    body = {
        "rows": [{"prompt": "Is the sky blue?", "candidates": [" Yes", " No"]}],
        "max_tokens": 64,
    }
    response = await client.post("/score", json=body)
    assert response.status == 200
    assert len((await response.json())["logits"][0]) == 2


async def test_unknown_path_is_go_404(client):
    response = await client.get("/nope")
    assert response.status == 404
    assert await response.text() == "404 page not found\n"


async def test_tokenize_uses_tokenizer_and_null_for_empty(client, llama_runner):
    response = await client.post("/v1/tokenize", data=b"Is the sky blue?")
    assert await response.json() == llama_runner.tokenizer.encode("Is the sky blue?")
    response = await client.post("/v1/tokenize", data=b"")
    assert await response.read() == b"null\n"


# --- scoring numbers ----------------------------------------------------------------------


async def test_candidate_logits_equal_full_vocabulary_logits(client, engine, llama_runner):
    tokenizer = llama_runner.tokenizer
    prompt = "Is the sky blue? Answer:"
    candidates = single_token_candidates(tokenizer, prompt, 4)
    answer = await score(client, [{"prompt": prompt, "candidates": candidates}])
    tokens = tokenizer.encode(prompt)
    ids = [tokenizer.encode(prompt + c)[-1] for c in candidates]
    expected = full_vocab_logits(engine, llama_runner, tokens, ids)
    assert answer["logits"][0] == pytest.approx(expected, abs=1e-4)
    assert answer["input_tokens"] == len(tokens)
    assert answer["cached_tokens"] == 0


async def test_rows_sharing_a_prefix_equal_rows_scored_alone(
    client, llama_runner, fresh_runner, make_client
):
    tokenizer = llama_runner.tokenizer
    questions = [" Is fire hot? A:", " Is ice cold? A:", " Is snow black? A:"]
    rows = [
        {"prompt": PREFIX + q, "candidates": single_token_candidates(tokenizer, PREFIX + q, 3)}
        for q in questions
    ]
    together = await score(client, rows)
    alone = [await score(await make_client(fresh_runner()), [row]) for row in rows]
    for i, single in enumerate(alone):
        assert together["logits"][i] == pytest.approx(single["logits"][0], abs=1e-5)
        assert single["cached_tokens"] == 0
    token_rows = [tokenizer.encode(r["prompt"]) for r in rows]
    shared = 0
    while all(t[shared] == token_rows[0][shared] for t in token_rows):
        shared += 1
    assert shared >= len(tokenizer.encode(PREFIX)) - 1
    assert together["cached_tokens"] == shared * (len(rows) - 1)
    assert together["input_tokens"] == sum(len(t) for t in token_rows)


async def test_row_that_is_the_shared_prefix_reuses_its_hidden_row(
    client, llama_runner, fresh_runner, make_client
):
    tokenizer = llama_runner.tokenizer
    short = PREFIX
    long = PREFIX + " Is fire hot? A:"
    assert tokenizer.encode(long)[: len(tokenizer.encode(short))] == tokenizer.encode(short)
    rows = [
        {"prompt": long, "candidates": single_token_candidates(tokenizer, long, 2)},
        {"prompt": short, "candidates": single_token_candidates(tokenizer, short, 2)},
    ]
    together = await score(client, rows)
    for i, row in enumerate(rows):
        alone = await score(await make_client(fresh_runner()), [row])
        assert together["logits"][i] == pytest.approx(alone["logits"][0], abs=1e-5)
    # The short row is wholly stored: nothing of it is computed again.
    assert together["cached_tokens"] == len(tokenizer.encode(short))


async def test_a_later_request_restores_an_earlier_prefix(
    client, llama_runner, fresh_runner, make_client
):
    tokenizer = llama_runner.tokenizer
    first = {"prompt": PREFIX + " Is fire hot? A:", "candidates": [" Yes", " No"]}
    second = {"prompt": PREFIX + " Is ice hot? A:", "candidates": [" Yes", " No"]}
    await score(client, [first])
    warm = await score(client, [second])
    cold = await score(await make_client(fresh_runner()), [second])
    assert warm["logits"][0] == pytest.approx(cold["logits"][0], abs=1e-5)
    shared = len(tokenizer.encode(PREFIX))
    assert warm["cached_tokens"] >= shared - 1
    assert cold["cached_tokens"] == 0


def score_with(engine, model, cache, rows, check=None):
    """Score through `cache` (None: a fresh cache, so nothing is restored)."""

    def work(job):
        scorer = Scorer(model, cache or prefix_cache(model, name="fresh", keep_hidden=True))
        return scorer.score(rows, check or job.check)

    return engine.call(work)


def test_chunked_prefill_equals_one_shot(engine, llama_runner):
    tokenizer = llama_runner.tokenizer
    model = llama_runner.model
    request = ScoreRequest(
        rows=[
            ScoreRow(PREFIX + q, single_token_candidates(tokenizer, PREFIX + q, 2))
            for q in (" Is fire hot? A:", " Is mud dry? A:")
        ],
        maxtokens=512,
    )
    rows = prepare_rows(request, tokenizer, 512, model.vocab_size)
    one_shot = score_with(engine, model, None, rows)
    for chunk in (1, 3, 7):
        cache = engine.call(
            lambda job, c=chunk: prefix_cache(model, name="t", chunk_tokens=c, keep_hidden=True)
        )
        chunked = score_with(engine, model, cache, rows)
        for a, b in zip(chunked.logits, one_shot.logits, strict=True):
            assert a == pytest.approx(b, abs=1e-5)


# --- cancellation -------------------------------------------------------------------------


class StopAfter:
    def __init__(self, n: int):
        self.calls = 0
        self.n = n

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > self.n:
            raise Cancelled()


def test_cancel_between_chunks_keeps_progress_and_next_request_is_exact(engine, llama_runner):
    tokenizer = llama_runner.tokenizer
    model = llama_runner.model
    tokens = tokenizer.encode(PREFIX)
    rows = [Row(tokens, [tokenizer.encode(PREFIX + " Yes")[-1]])]
    cache = engine.call(lambda job: prefix_cache(model, name="t", chunk_tokens=2, keep_hidden=True))
    stop = StopAfter(4)  # one check per row, then one per chunk: 3 chunks pass
    with pytest.raises(Cancelled):
        score_with(engine, model, cache, rows, stop)
    assert stop.calls == 5
    again = score_with(engine, model, cache, rows)
    assert again.cached_tokens == 6  # the retry resumed where the cancelled prefill stopped
    fresh = score_with(engine, model, None, rows)
    assert again.logits[0] == pytest.approx(fresh.logits[0], abs=1e-5)


async def test_client_disconnect_cancels_queued_request(client, engine, llama_runner, monkeypatch):
    calls = []
    original = llama_runner.scorer.score
    monkeypatch.setattr(
        llama_runner.scorer, "score", lambda rows, check: calls.append(1) or original(rows, check)
    )
    gate = threading.Event()
    blocker = engine.submit(lambda job: gate.wait(30))
    body = {"rows": [{"prompt": "Is the sky blue?", "candidates": [" Yes"]}], "max_tokens": 64}
    request = asyncio.ensure_future(client.post("/v1/score", json=body))
    await asyncio.sleep(0.3)
    request.cancel()  # the client goes away while the job waits behind the blocker
    with pytest.raises(asyncio.CancelledError):
        await request
    await asyncio.sleep(0.3)
    gate.set()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, blocker.done.wait, 5)
    await loop.run_in_executor(None, lambda: engine.call(lambda job: None, timeout=5))
    assert calls == []  # the cancelled job never ran
    assert (await client.post("/v1/score", json=body)).status == 200
    assert calls == [1]


# --- memory -------------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "kept"), [(0, False), (1 << 40, True)])
async def test_scratch_memory_above_the_limit_is_released(client, engine, monkeypatch, limit, kept):
    from runner.server import memory

    monkeypatch.setattr(memory, "SCRATCH_LIMIT_BYTES", limit)
    body = {"rows": [{"prompt": PREFIX * 4, "candidates": [" Yes", " No"]}], "max_tokens": 512}
    assert (await client.post("/v1/score", json=body)).status == 200
    cached = engine.call(lambda job: mx.get_cache_memory())
    assert (cached > 0) is kept


# --- a model's own scoring hook -----------------------------------------------------------


def row_by_row_scorer(base):
    """`base` as a `CachedScorer` that takes /v1/score over, honestly: it validates with the
    runner's own rules (as a family with prompts of its own would, before preparing them),
    then scores each row through the runner's hidden rows, one row at a time, every
    candidate through its own head rows. The runner's built-in scorer must give the same
    answer (it batches rows and shares prefixes)."""
    from runner.protocol.wire import ScoreResponse

    class RowByRow(type(base)):
        def score(self, request, tokenizer, hidden_rows):
            rows = prepare_rows(request, tokenizer, self.context_length, self.vocab_size, self)
            logits, cached = [], 0
            for row in rows:
                hidden, restored = hidden_rows(row.tokens)
                cached += restored
                ids = mx.array(row.candidates, dtype=mx.int32)
                logits.append(self.unembed_candidates(hidden, ids).reshape(-1).tolist())
            return ScoreResponse(logits, sum(len(r.tokens) for r in rows), cached)

    hooked = RowByRow.__new__(RowByRow)
    hooked.__dict__.update(base.__dict__)
    return hooked


async def test_a_cached_scorer_model_answers_score_as_the_runner_would(
    llama_runner, make_client, engine
):
    """The model contract's `CachedScorer` (runner/models/base.py): a model that takes whole
    requests, asking for hidden rows through the scoring prefix cache, answers what the
    runner's own scorer answers; its rows are restored from the cache on the next request;
    a request it refuses is the same 400."""
    from runner.models import CachedScorer

    hooked = row_by_row_scorer(llama_runner.model)
    assert isinstance(hooked, CachedScorer) and not isinstance(llama_runner.model, CachedScorer)
    runner = engine.call(
        lambda job: type(llama_runner)(engine, hooked, llama_runner.tokenizer, "hooked")
    )
    client, plain = await make_client(runner), await make_client(llama_runner)
    rows = [
        {"prompt": PREFIX + q, "candidates": [" Yes", " No", " A"]}
        for q in (" Is it?", " Is it not?", " Why?")
    ]
    rows.append({"prompt": "Something else entirely:", "candidates": [" Yes"]})
    first, want = await score(client, rows), await score(plain, rows)
    assert first["input_tokens"] == want["input_tokens"]
    # one row at a time, each restores what it shares with the rows before it; the runner's
    # batch computes the shared prefix once, and counts it as cached for the rows it serves
    tokens = [llama_runner.tokenizer.encode(r["prompt"]) for r in rows]

    def shared(a: list[int], b: list[int]) -> int:
        return next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )

    restored = [max((shared(t, u) for u in tokens[:i]), default=0) for i, t in enumerate(tokens)]
    assert first["cached_tokens"] == want["cached_tokens"] == sum(restored) > 0
    for got_row, want_row in zip(first["logits"], want["logits"], strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-5)
    again = await score(client, rows)
    assert again["logits"] == first["logits"]
    assert again["cached_tokens"] == again["input_tokens"]  # every row stored whole
    bad = {"rows": [{"prompt": PREFIX, "candidates": [" Yes", " Yes"]}], "max_tokens": 512}
    refused, expected = (
        await client.post("/v1/score", json=bad),
        await plain.post("/v1/score", json=bad),
    )
    assert (refused.status, await refused.text()) == (400, await expected.text())


async def test_the_runner_scores_rows_sharing_a_prefix_in_one_batch(
    client, llama_runner, monkeypatch
):
    from runner.cache import live

    batches = []
    original = live.forward_suffixes

    def counting(model, caches, suffixes):
        batches.append(len(suffixes))
        return original(model, caches, suffixes)

    monkeypatch.setattr(live, "forward_suffixes", counting)  # the live state's batched forward
    rows = [{"prompt": PREFIX + q, "candidates": [" Yes", " No"]} for q in (" A?", " B?", " C?")]
    answer = await score(client, rows)
    assert batches == [3]
    assert len(answer["logits"]) == 3
