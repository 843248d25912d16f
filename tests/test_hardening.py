"""Hostile input and extreme values over HTTP: the loop never stalls, values Go cannot read are
never written, and no option value yields a 5xx, an error line or a non-finite number."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from typing import Any

import mlx.core as mx
import pytest

from runner.service import Runner

GOOD = {"rows": [{"prompt": "Is the sky blue?", "candidates": [" Yes", " No"]}], "max_tokens": 64}


class NonFinite:
    """The tiny model with every logit replaced by `value` (a model whose weights overflow)."""

    def __init__(self, model: Any, value: float):
        self._model = model
        self.value = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def unembed(self, hidden: mx.array) -> mx.array:
        return mx.full(self._model.unembed(hidden).shape, self.value)

    def unembed_candidates(self, hidden: mx.array, ids: mx.array) -> mx.array:
        return mx.full(self._model.unembed_candidates(hidden, ids).shape, self.value)


@pytest.fixture
def runner_of(engine, llama_runner):
    def make(model: Any) -> Runner:
        tokenizer = llama_runner.tokenizer
        return engine.call(lambda job: Runner(engine, model, tokenizer, "wrapped"))

    return make


async def test_a_huge_body_decodes_off_the_loop_while_status_answers(client, monkeypatch):
    """A large body (a huge array under an unknown key) is decoded in an executor: the
    supervisor's health check answers while the decode is in progress.

    Proven without a clock: the decoder waits until a /v1/status answer arrives after it
    started. Run on the loop, it would block the only thread that could answer, and the
    wait would run out (the flag stays unset)."""
    import runner.server.app as app_module

    started, answered_during = threading.Event(), threading.Event()
    waits: list[bool] = []
    real_decode = app_module.decode_score_request

    def decode_while_status_answers(body: bytes) -> Any:
        started.set()
        waits.append(answered_during.wait(timeout=10))
        return real_decode(body)

    monkeypatch.setattr(app_module, "decode_score_request", decode_while_status_answers)
    body = b'{"junk": [' + b"1," * 2_500_000 + b'1], "rows": []}'
    posted = asyncio.ensure_future(client.post("/v1/score", data=body))
    while not posted.done():
        was_started = started.is_set()
        assert (await client.get("/v1/status")).status == 200
        if was_started:
            answered_during.set()
        await asyncio.sleep(0.01)
    assert (await posted).status == 400  # no rows: "scoring requires 1–64 prompts"
    assert waits == [True]  # a status answer arrived while the decoder was running


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_a_non_finite_logit_is_an_empty_200_as_go_writes_it(
    make_client, runner_of, llama_runner, value
):
    client = await make_client(runner_of(NonFinite(llama_runner.model, value)))
    response = await client.post("/v1/score", json=GOOD)
    assert response.status == 200
    assert await response.read() == b""  # Go's encoder refused it: a Go client gets an error


async def test_a_non_finite_logprob_ends_the_stream_without_a_line(
    make_client, runner_of, llama_runner
):
    client = await make_client(runner_of(NonFinite(llama_runner.model, math.nan)))
    body = {"Prompt": "Is the sky", "Logprobs": True, "Options": {"num_predict": 4}}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    assert await response.read() == b""  # the first line could not be written: nothing is


async def test_head_health_redirects_as_get_does(client):
    response = await client.head("/health", allow_redirects=False)
    assert response.status == 308 and response.headers["Location"] == "/v1/status"


EXTREME_OPTIONS = [
    {"temperature": 1e-45},
    {"temperature": 3.4e38, "top_k": 9223372036854775807},
    {"temperature": 0.7, "top_k": -5, "top_p": 1e-30, "min_p": 1.0},
    {"repeat_penalty": 3.4e38, "repeat_last_n": 9223372036854775807},
    {"repeat_penalty": -3.4e38, "repeat_last_n": -9223372036854775808},
    {"presence_penalty": -3.4e38, "frequency_penalty": -3.4e38, "temperature": 1},
    {"presence_penalty": 3.4e38, "frequency_penalty": 3.4e38},
    {"seed": 9223372036854775807, "temperature": 1.5},
    {"seed": -9223372036854775808, "temperature": 1.5},
    {"num_predict": -9223372036854775808},
]


@pytest.mark.parametrize("options", EXTREME_OPTIONS, ids=lambda o: ",".join(o))
async def test_extreme_options_give_a_clean_stream_with_finite_numbers(client, options):
    body = {
        "Prompt": "The cat sat on the mat and the dog",
        "Logprobs": True,
        "TopLogprobs": 9223372036854775807,
        "Options": {"num_predict": 3, **options},
    }
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200, await response.text()
    lines = [json.loads(line) for line in (await response.read()).splitlines()]
    assert lines and lines[-1]["Done"] and lines[-1]["Error"] is None
    for line in lines:
        for logprob in line["Logprobs"] or []:
            assert math.isfinite(logprob["logprob"])
            assert all(math.isfinite(t["logprob"]) for t in logprob.get("top_logprobs", []))
