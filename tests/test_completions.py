"""`/v1/completions` over HTTP on the tiny llama, as the Go runner streams it (docs/PROTOCOL.md
§3, §5): Go key spelling and order, validation texts, the token budget, EOS, UTF-8
held back across tokens, disconnects and errors after the header.

Behaviour that a random model cannot show on its own is steered: `Steered` wraps the tiny
model and adds a large bias to a scripted token per decode step (or bans EOS), so the stream's
tokens are known in advance while everything else (prefill, caches, sampler, detokenizer,
HTTP) is the real path.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from typing import Any

import mlx.core as mx
import pytest

from runner.protocol.go_json import DecodeError
from runner.protocol.wire import CompletionResponse, decode_completion_request, encode_json
from runner.server.app import build_app
from runner.service import Runner

KEYS = [
    "Content",
    "Done",
    "DoneReason",
    "PromptEvalCount",
    "PromptEvalDuration",
    "EvalCount",
    "EvalDuration",
    "Logprobs",
    "Error",
]
TYPES = [str, bool, int, int, int, int, int, (list, type(None)), type(None)]
PROMPT = "Is the sky blue? Yes. The cat sat on"
EOS = 2  # <|im_end|>


class Steered:
    """The tiny model, its logits steered per decode step (unembed call): step i's argmax is
    `script[i]` while the script lasts; `ban` ids never win; `delay` slows each step; from
    step `fail_at` on, unembed raises."""

    def __init__(
        self, model: Any, *, script=(), ban=(), context_length=None, delay=0.0, fail_at=None
    ):
        self._model = model
        self.script = list(script)
        self.ban = list(ban)
        self._context_length = context_length
        self.delay = delay
        self.fail_at = fail_at
        self.steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @property
    def context_length(self) -> int:
        return self._context_length or self._model.context_length

    def unembed(self, hidden: mx.array) -> mx.array:
        step = self.steps
        self.steps += 1
        if self.fail_at is not None and step >= self.fail_at:
            raise RuntimeError("boom")
        if self.delay:
            time.sleep(self.delay)
        logits = self._model.unembed(hidden)
        bias = mx.zeros((logits.shape[-1],), logits.dtype)
        if self.ban:
            bias = bias.at[mx.array(self.ban)].add(-1e4)
        if step < len(self.script):
            bias = bias.at[self.script[step]].add(1e4)
        return logits + bias


@pytest.fixture
def steered(engine, llama_runner, aiohttp_client):
    """Make (model, client) for a runner around a `Steered` tiny llama."""

    async def make(**kwargs):
        model = Steered(llama_runner.model, **kwargs)
        tokenizer = llama_runner.tokenizer
        runner = engine.call(lambda job: Runner(engine, model, tokenizer, "steered"))
        client = await aiohttp_client(
            build_app(runner), server_kwargs={"handler_cancellation": True}
        )
        return model, client

    return make


async def complete(client, body, path="/v1/completions") -> list[dict]:
    response = await client.post(path, data=json.dumps(body))
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"] == "application/jsonl"
    return [json.loads(line) for line in (await response.read()).splitlines()]


async def error_text(client, body) -> tuple[int, str, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post("/v1/completions", data=data)
    return response.status, response.headers["Content-Type"], await response.text()


def content(lines: list[dict]) -> str:
    return "".join(line["Content"] for line in lines)


# --- wire -----------------------------------------------------------------------------------


def test_response_encodes_go_field_names_in_order():
    assert encode_json(CompletionResponse()) == (
        b'{"Content":"","Done":false,"DoneReason":0,"PromptEvalCount":0,"PromptEvalDuration":0,'
        b'"EvalCount":0,"EvalDuration":0,"Logprobs":null,"Error":null}\n'
    )


def test_request_keys_any_case_underscores_kept_unknown_ignored_null_zero():
    request = decode_completion_request(
        b'{"prompt":"hi","OPTIONS":{"Num_Predict":3,"TEMPERATURE":0.5,"topk":9,"stop":["x"],'
        b'"seed":null,"use_mmap":true},"LOGPROBS":true,"toplogprobs":2,"extra":{},"Media":null}'
    )
    assert request.prompt == "hi"
    assert request.options.num_predict == 3
    assert request.options.temperature == 0.5
    assert request.options.top_k == 0  # "topk" is not "top_k" for completions
    assert request.options.seed == 0
    assert request.logprobs is True and request.toplogprobs == 2
    assert request.media == []


def test_missing_fields_are_zero_values_not_ollama_defaults():
    request = decode_completion_request(b'{"Prompt":"x"}')
    o = request.options
    assert (o.temperature, o.top_k, o.top_p, o.num_predict, o.seed) == (0, 0, 0, 0, 0)
    assert (o.repeat_penalty, o.repeat_last_n) == (0, 0)


def test_media_items_decode():
    data = base64.b64encode(b"\x89PNG").decode()
    request = decode_completion_request(
        json.dumps({"Media": [{"DATA": data, "Id": 4, "kind": "image"}]}).encode()
    )
    assert (request.media[0].raw, request.media[0].id, request.media[0].kind) == (
        b"\x89PNG",
        4,
        "image",
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[1]",
        b'{"Prompt":5}',
        b'{"Options":{"num_predict":1.5}}',
        b'{"Options":{"stop":"x"}}',
        b'{"Media":[{"data":"!!"}]}',
    ],
)
def test_bad_bodies_fail_to_decode(body):
    with pytest.raises(DecodeError):
        decode_completion_request(body)


# --- streaming ------------------------------------------------------------------------------


async def test_lines_have_go_keys_types_and_order(client, llama_runner):
    body = {
        "Prompt": PROMPT,
        "Media": None,
        "Options": {"num_predict": 6},
        "Logprobs": True,
        "TopLogprobs": 3,
    }
    lines = await complete(client, body)
    for line in lines:
        assert list(line) == KEYS
        for key, kind in zip(KEYS, TYPES, strict=True):
            assert isinstance(line[key], kind), (key, line)
    *chunks, final = lines
    assert chunks and all(not c["Done"] and c["Content"] for c in chunks)
    assert all(c["PromptEvalCount"] == 0 and c["EvalCount"] == 0 for c in chunks)
    assert final["Done"] is True and final["Content"] == "" and final["Logprobs"] is None
    assert final["DoneReason"] == 1 and final["EvalCount"] == 6
    assert final["PromptEvalCount"] == len(llama_runner.tokenizer.encode(PROMPT))
    assert final["PromptEvalDuration"] > 0 and final["EvalDuration"] > 0
    logprobs = [lp for c in chunks for lp in c["Logprobs"]]
    assert len(logprobs) == 6
    for lp in logprobs:
        assert list(lp) == ["token", "logprob", "top_logprobs"]
        tops = [t["logprob"] for t in lp["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert all(list(t) == ["token", "logprob"] for t in lp["top_logprobs"])
        assert lp["logprob"] <= tops[0]
    assert chunks == (await complete(client, body))[:-1]  # greedy is deterministic


async def test_logprobs_are_null_unless_asked_and_tops_omitted_when_zero(client):
    lines = await complete(
        client, {"Prompt": PROMPT, "Options": {"num_predict": 3}, "TopLogprobs": 5}
    )
    assert all(line["Logprobs"] is None for line in lines)
    lines = await complete(
        client, {"Prompt": PROMPT, "Options": {"num_predict": 3}, "Logprobs": True}
    )
    assert all("top_logprobs" not in lp for line in lines[:-1] for lp in line["Logprobs"])


async def test_seeded_sampling_repeats_and_differs_by_seed(client):
    def body(seed):
        return {
            "Prompt": PROMPT,
            "Options": {"num_predict": 12, "temperature": 1.5, "top_k": 50, "seed": seed},
        }

    first = content(await complete(client, body(7)))
    assert first == content(await complete(client, body(7)))
    assert first != content(await complete(client, body(8)))


async def test_a_character_split_across_tokens_arrives_whole(steered, llama_runner):
    text = " café €"
    script = llama_runner.tokenizer.encode(text)
    assert b"\xc3" in [llama_runner.tokenizer.token_bytes(t) for t in script]  # é is split
    _, client = await steered(script=script)
    lines = await complete(
        client, {"Prompt": PROMPT, "Options": {"num_predict": len(script)}, "Logprobs": True}
    )
    *chunks, final = lines
    assert content(chunks) == text
    assert all("\ufffd" not in c["Content"] for c in chunks)
    assert final["EvalCount"] == len(script)
    # the tokens that showed nothing yet ride with the chunk that completes their character
    riding = {c["Content"]: [lp["token"] for lp in c["Logprobs"]] for c in chunks}
    assert riding["é"] == ["\ufffd", "\ufffd"]
    assert riding["€"] == ["\ufffd", "\ufffd", "\ufffd"]
    assert sum(len(c["Logprobs"]) for c in chunks) == len(script)


async def test_bytes_still_held_at_the_end_are_dropped(steered, llama_runner):
    script = llama_runner.tokenizer.encode(" café")[:-1]  # ends on the first byte of é
    _, client = await steered(script=script)
    lines = await complete(client, {"Prompt": PROMPT, "Options": {"num_predict": len(script)}})
    assert content(lines) == " caf"
    assert lines[-1]["EvalCount"] == len(script)


async def test_eos_is_neither_streamed_nor_counted(steered, llama_runner):
    words = llama_runner.tokenizer.encode("The cat sat")
    _, client = await steered(script=[*words, EOS])
    lines = await complete(client, {"Prompt": PROMPT, "Options": {"num_predict": 50}})
    assert content(lines) == "The cat sat"
    assert lines[-1]["DoneReason"] == 0 and lines[-1]["EvalCount"] == len(words)
    assert "<|im_end|>" not in content(lines)


async def test_eos_first_ends_with_no_chunks(steered):
    _, client = await steered(script=[EOS])
    lines = await complete(client, {"Prompt": PROMPT, "Options": {"num_predict": 5}})
    assert len(lines) == 1
    assert lines[0]["Done"] and lines[0]["DoneReason"] == 0 and lines[0]["EvalCount"] == 0


# --- validation and the budget --------------------------------------------------------------


async def test_bad_body_is_go_bad_request(client):
    for body in (b"", b"{", b"[]", b'{"Prompt":1}'):
        assert await error_text(client, body) == (400, "text/plain; charset=utf-8", "Bad Request\n")


@pytest.mark.parametrize(
    ("media", "kind"),
    [
        ([{"data": "iVBORw==", "id": 0, "Kind": "image"}], "image"),
        ([{"data": "", "id": 0, "Kind": "audio"}, {"Kind": "image"}], "audio"),  # the first
        ([{"data": "", "id": 1}], "media"),  # no Kind
    ],
)
async def test_media_is_refused_by_a_text_model(client, media, kind):
    body = {"Prompt": "[img-0] what is this?", "Media": media}
    message = f"this model does not support {kind} input\n"
    assert (await error_text(client, body))[::2] == (400, message)


@pytest.mark.parametrize("body", [{"Prompt": ""}, {}, {"Prompt": None}])
async def test_empty_prompt(client, body):
    assert (await error_text(client, body))[::2] == (400, "empty prompt\n")


async def test_prompt_must_leave_room_for_one_token(steered, llama_runner):
    _, client = await steered(context_length=32, ban=[EOS])
    count = len(llama_runner.tokenizer.encode("a " * 31))
    assert count == 32  # "a", 30 times " a", " "
    for words, n in ((31, 32), (40, 41)):
        message = (
            f"input length ({n} tokens) exceeds the model's maximum context length (32 tokens)\n"
        )
        assert (await error_text(client, {"Prompt": "a " * words}))[::2] == (400, message)
    lines = await complete(client, {"Prompt": "a " * 30})  # 31 tokens: one to generate
    assert lines[-1]["EvalCount"] == 1 and lines[-1]["DoneReason"] == 1


@pytest.mark.parametrize(("num_predict", "expected"), [(3, 3), (0, 27), (-1, 27), (1000, 27)])
async def test_num_predict_is_capped_by_the_context(steered, llama_runner, num_predict, expected):
    """num_predict <= 0 means the rest of the context (32 - 5 prompt tokens); larger ones are
    cut to it; the budget ends with DoneReason 1."""
    _, client = await steered(context_length=32, ban=[EOS])
    prompt = "Is the sky blue?"
    assert len(llama_runner.tokenizer.encode(prompt)) == 5
    lines = await complete(client, {"Prompt": prompt, "Options": {"num_predict": num_predict}})
    assert lines[-1]["EvalCount"] == expected and lines[-1]["DoneReason"] == 1
    assert lines[-1]["PromptEvalCount"] == 5


async def test_options_keys_keep_their_underscores(steered):
    _, client = await steered(context_length=32, ban=[EOS])
    lines = await complete(client, {"PROMPT": "Is the sky blue?", "options": {"NUM_PREDICT": 2}})
    assert lines[-1]["EvalCount"] == 2
    lines = await complete(client, {"Prompt": "Is the sky blue?", "Options": {"numpredict": 2}})
    assert lines[-1]["EvalCount"] == 27  # an unknown key: num_predict stays 0


# --- routes, acceptance, disconnects, errors ------------------------------------------------


async def test_legacy_completion_path_redirects_with_308(client):
    response = await client.post("/completion", data=b"{}", allow_redirects=False)
    assert response.status == 308
    assert response.headers["Location"] == "/v1/completions"
    lines = await complete(client, {"Prompt": PROMPT, "Options": {"num_predict": 2}}, "/completion")
    assert lines[-1]["EvalCount"] == 2


async def test_header_waits_until_the_job_is_accepted(client, engine):
    gate = threading.Event()
    blocker = engine.submit(lambda job: gate.wait(30))
    try:
        request = asyncio.ensure_future(
            client.post("/v1/completions", json={"Prompt": PROMPT, "Options": {"num_predict": 2}})
        )
        await asyncio.sleep(0.3)
        assert not request.done()  # queued behind the blocker: no status line yet
    finally:
        gate.set()
        blocker.done.wait(5)
    response = await request
    assert response.status == 200
    assert json.loads((await response.read()).splitlines()[-1])["EvalCount"] == 2


async def wait_idle(engine, seconds: float = 5.0) -> float:
    """Seconds until the worker runs a no-op job: how long the work before it kept it."""
    started = time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: engine.call(lambda job: None, timeout=seconds)
    )
    return time.perf_counter() - started


async def test_a_client_that_disconnects_stops_the_work(steered, engine, client):
    model, steered_client = await steered(ban=[EOS], delay=0.02)  # ~40 s for the whole budget
    response = await steered_client.post("/v1/completions", json={"Prompt": PROMPT})
    assert response.status == 200
    for _ in range(2):
        assert json.loads(await response.content.readline())["Done"] is False
    response.close()
    at_disconnect = model.steps
    # Not a speed: the whole budget is ~40 s, and a shared CI machine can stall a second.
    assert await wait_idle(engine, seconds=20.0) < 10.0
    assert model.steps - at_disconnect <= 3  # stopped before its next token or two
    steps_when_idle = model.steps
    lines = await complete(client, {"Prompt": PROMPT, "Options": {"num_predict": 3}})
    assert lines[-1]["EvalCount"] == 3  # the worker serves the next request at once
    assert model.steps == steps_when_idle


async def test_a_failure_after_the_header_is_one_error_line(steered, engine, client):
    _, steered_client = await steered(ban=[EOS], fail_at=3)
    lines = await complete(steered_client, {"Prompt": PROMPT, "Options": {"num_predict": 10}})
    *chunks, error = lines
    assert all(not c["Done"] and c["Error"] is None for c in chunks)
    assert error == {
        "Content": "",
        "Done": False,
        "DoneReason": 0,
        "PromptEvalCount": 0,
        "PromptEvalDuration": 0,
        "EvalCount": 0,
        "EvalDuration": 0,
        "Logprobs": None,
        "Error": {"StatusCode": 500, "Status": "", "error": "boom"},
    }
    assert list(error) == KEYS and list(error["Error"]) == ["StatusCode", "Status", "error"]
    await wait_idle(engine)
    lines = await complete(client, {"Prompt": PROMPT, "Options": {"num_predict": 2}})
    assert lines[-1]["EvalCount"] == 2
