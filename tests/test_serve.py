"""`serve`'s public faces in process (runner/server/serve.py, openai.py, ollama.py): shapes,
the numbers (prompt logprobs equal to /v1/score's logits through a log-softmax), the Go
wire unchanged beside them, errors in each face's shape, cancellation of a dropped stream."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from runner.score.validate import Row
from runner.server.faces import Faces, StopText, place_images
from runner.server.serve import build_serve_app, is_openai_completion
from runner.text.chat_template import ChatTemplate

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
CONTEXT = "The quick brown fox jumps over the lazy dog. Is the sky blue?"


@pytest.fixture
async def serve(aiohttp_client, llama_runner):
    faces = Faces(llama_runner, ChatTemplate(TEMPLATE, CONFIG))
    app = build_serve_app(llama_runner, faces=faces)
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    client.runner = llama_runner
    return client


def _reference(runner, tokens):
    """log-softmax rows of every prefix of `tokens`, from /v1/score's scorer."""
    vocab = runner.model.vocab_size
    rows = [Row(tokens[:j], list(range(vocab))) for j in range(1, len(tokens) + 1)]
    fresh = runner.engine.call(
        lambda job: type(runner)(runner.engine, runner.model, runner.tokenizer, runner.name)
    )
    result = runner.engine.call(lambda job: fresh.scorer.score(rows, job.check))
    logits = np.array(result.logits, dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    return logits - (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))


# --- routing --------------------------------------------------------------------------------


def test_openai_bodies_are_told_from_go_ones():
    assert not is_openai_completion(b'{"Prompt": "hi", "Options": {"num_predict": 2}}')
    assert not is_openai_completion(b'{"prompt": "hi", "logprobs": true}')
    assert not is_openai_completion(b"not json")
    assert is_openai_completion(b'{"model": "m", "prompt": ')
    assert is_openai_completion(b'{"prompt": "hi", "model": "m"}')
    assert is_openai_completion(b'{"prompt": "hi", "logprobs": 1}')


async def test_go_wire_unchanged_beside_the_faces(serve):
    r = await serve.post(
        "/v1/completions", json={"Prompt": "Is the sky", "Options": {"num_predict": 3}}
    )
    assert r.status == 200 and r.content_type == "application/jsonl"
    lines = [json.loads(line) for line in (await r.text()).splitlines()]
    assert lines[-1]["Done"] is True
    r = await serve.post("/v1/models")
    assert await r.json() == {"Success": True}
    r = await serve.get("/v1/models")
    listed = await r.json()
    assert listed["Success"] is True and listed["object"] == "list"
    assert listed["data"][0]["id"] == serve.runner.name.split("/")[-1]
    r = await serve.post(
        "/v1/score", json={"rows": [{"prompt": "Is it", "candidates": [" Yes"]}], "max_tokens": 64}
    )
    assert r.status == 200


# --- OpenAI completions -----------------------------------------------------------------------


async def test_echo_logprobs_as_lm_eval_reads_them(serve):
    tokenizer = serve.runner.tokenizer
    context = tokenizer.encode(CONTEXT)
    prompts = [context + tokenizer.encode(c) for c in (" Yes.", " No, it is green.")]
    body = {
        "model": "m",
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = await serve.post("/v1/completions", json=body)
    assert r.status == 200, await r.text()
    answer = await r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for tokens, choice in zip(prompts, answer["choices"], strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(tokens) + 1  # the prompt, then one token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        reference = _reference(serve.runner, tokens)
        for j in range(1, len(tokens)):
            assert lp["token_logprobs"][j] == pytest.approx(reference[j - 1, tokens[j]], abs=2e-5)
            top = lp["top_logprobs"][j]
            assert max(top.values()) == pytest.approx(reference[j - 1].max(), abs=2e-5)
            assert lp["tokens"][j] in top  # the chosen token is included
        # lm-eval's is_greedy: the chosen token's logprob is the maximum, compared exactly
        for j in range(1, len(tokens)):
            greedy = int(np.argmax(reference[j - 1])) == tokens[j]
            assert (lp["token_logprobs"][j] == max(lp["top_logprobs"][j].values())) == greedy
        assert choice["text"].startswith(tokenizer.encode and "")
        assert choice["finish_reason"] in ("stop", "length")
    assert answer["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


async def test_echo_with_zero_tokens_and_strings(serve):
    body = {
        "model": "m",
        "prompt": [CONTEXT, "Is grass red?"],
        "max_tokens": 0,
        "echo": True,
        "logprobs": 3,
    }
    answer = await (await serve.post("/v1/completions", json=body)).json()
    assert [c["text"] for c in answer["choices"]] == [CONTEXT, "Is grass red?"]
    for choice in answer["choices"]:
        assert all(1 <= len(t) <= 4 for t in choice["logprobs"]["top_logprobs"][1:])
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        assert answer["usage"]["completion_tokens"] == 0


async def test_generation_with_stop_and_stream(serve):
    body = {"model": "m", "prompt": CONTEXT, "max_tokens": 12, "temperature": 0}
    plain = await (await serve.post("/v1/completions", json=body)).json()
    text = plain["choices"][0]["text"]
    assert plain["usage"]["completion_tokens"] >= 1
    r = await serve.post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.content_type == "text/event-stream"
    events = [line[6:] for line in (await r.text()).split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"] == plain["usage"]
    if len(text) > 2:
        stop = text[1:3]
        cut = await (await serve.post("/v1/completions", json={**body, "stop": [stop]})).json()
        assert cut["choices"][0]["text"] == text[: text.index(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"model": "m", "prompt": }', "invalid JSON"),
        (b'{"model": "m", "prompt": 5}', "prompt must be"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "ten"}', "max_tokens"),
        (b'{"model": "m", "prompt": "x", "n": 2}', "n = 1"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"model": "m", "prompt": [[1, 2, 100000]]}', "token ids"),
        (b'{"model": "m", "prompt": [], "max_tokens": 1}', "prompt must be"),
        (b'{"model": "m", "prompt": "x", "logprobs": 99}', "logprobs"),
        (b'{"model": "m", "prompt": "x", "temperature": -1}', "temperature"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 5000}', "maximum context length is 2048"),
        (
            b'{"model": "m", "prompt": ['
            + b",".join([b"5"] * 2049)
            + b'], "echo": true, "max_tokens": 0}',
            "2049",
        ),
    ],
)
async def test_openai_errors_are_openai_shaped(serve, body, needle):
    r = await serve.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
    assert r.status == 400
    error = (await r.json())["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


# --- chat -----------------------------------------------------------------------------------


async def test_chat_completion_uses_the_template(serve):
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    answer = await (await serve.post("/v1/chat/completions", json=body)).json()
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    rendered = ChatTemplate(TEMPLATE, CONFIG).render(messages)
    tokenizer = serve.runner.tokenizer
    assert answer["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered))
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    r = await serve.post("/v1/chat/completions", json={**body, "stream": True})
    events = [line[6:] for line in (await r.text()).split("\n\n") if line.startswith("data: ")]
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]


async def test_chat_errors(serve):
    r = await serve.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status == 400 and "messages" in (await r.json())["error"]["message"]
    bad = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    ]
    r = await serve.post("/v1/chat/completions", json={"model": "m", "messages": bad})
    assert r.status == 400 and "data: URLs" in (await r.json())["error"]["message"]
    image = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        }
    ]
    r = await serve.post("/v1/chat/completions", json={"model": "m", "messages": image})
    assert r.status == 400 and "image input" in (await r.json())["error"]["message"]


# --- tokenizer endpoints ----------------------------------------------------------------------


async def test_tokenizer_endpoints(serve):
    info = await (await serve.get("/tokenizer_info")).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == TEMPLATE
    ids = (
        await (
            await serve.post("/tokenize", json={"prompt": CONTEXT, "add_special_tokens": False})
        ).json()
    )["tokens"]
    assert ids == serve.runner.tokenizer.encode(CONTEXT)
    text = (await (await serve.post("/detokenize", json={"tokens": ids})).json())["prompt"]
    assert text == CONTEXT
    r = await serve.post("/detokenize", json={"tokens": ["a"]})
    assert r.status == 400 and "error" in await r.json()


# --- Ollama ---------------------------------------------------------------------------------


async def test_ollama_generate_and_chat(serve):
    body = {
        "model": "m",
        "prompt": "Is the sky blue?",
        "options": {"num_predict": 4, "temperature": 0},
    }
    r = await serve.post("/api/generate", json=body)
    assert r.content_type == "application/x-ndjson"
    lines = [json.loads(line) for line in (await r.text()).splitlines()]
    final = lines[-1]
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    for key in (
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    ):
        assert isinstance(final[key], int)
    assert final["eval_count"] <= 4
    whole = await (await serve.post("/api/generate", json={**body, "stream": False})).json()
    assert whole["response"] == "".join(line["response"] for line in lines)
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "stream": False,
        "options": {"num_predict": 4, "temperature": 0},
    }
    answer = await (await serve.post("/api/chat", json=chat)).json()
    assert answer["message"]["role"] == "assistant" and answer["done"] is True
    assert answer["message"]["content"] == whole["response"]  # the same template, the same prompt
    load = await (await serve.post("/api/generate", json={"model": "m"})).json()
    assert load["done_reason"] == "load"
    for path in ("/api/tags", "/api/ps"):
        assert (await (await serve.get(path)).json())["models"][0]["name"]
    assert "version" in await (await serve.get("/api/version")).json()
    show = await (await serve.post("/api/show", json={"model": "m"})).json()
    assert show["template"] == TEMPLATE and show["capabilities"] == ["completion"]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/api/generate", b"{", "invalid JSON"),
        ("/api/generate", b'{"prompt": "x"}', "model is required"),
        (
            "/api/generate",
            b'{"model": "m", "prompt": "x", "options": {"temperature": "hot"}}',
            "temperature",
        ),
        ("/api/generate", b'{"model": "m", "prompt": "x", "images": ["%%%"]}', "base64"),
        ("/api/chat", b'{"model": "m", "messages": [{"content": "x"}]}', "role"),
        (
            "/api/generate",
            b'{"model": "m", "prompt": "' + b"word " * 3000 + b'", "raw": true}',
            "maximum context length",
        ),
        (
            "/api/generate",
            b'{"model": "m", "prompt": "hello there", "options": {"num_ctx": 2}}',
            "maximum context length is 2",
        ),
    ],
)
async def test_ollama_errors_are_ollama_shaped(serve, path, body, needle):
    r = await serve.post(path, data=body, headers={"Content-Type": "application/json"})
    assert r.status == 400
    answer = await r.json()
    assert set(answer) == {"error"} and needle in answer["error"]


# --- cancellation ---------------------------------------------------------------------------


async def test_a_dropped_stream_cancels_the_work(serve, llama_runner):
    steps = []
    original = llama_runner.generator.steps

    def counted(*args, **kwargs):
        for step in original(*args, **kwargs):
            steps.append(1)
            yield step

    llama_runner.generator.steps = counted
    body = {"model": "m", "prompt": CONTEXT, "max_tokens": 1900, "temperature": 0, "stream": True}
    r = await serve.post("/v1/completions", json=body)
    await r.content.readline()
    r.close()  # the client goes away
    await asyncio.sleep(1.0)
    seen = len(steps)
    await asyncio.sleep(0.5)
    assert len(steps) == seen < 1900  # stopped, well before the budget
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: llama_runner.engine.call(lambda job: None, timeout=5))


# --- pieces ---------------------------------------------------------------------------------


def test_stop_text_holds_back_what_may_begin_a_stop():
    stop = StopText(["END", "\n\n"])
    assert stop.feed("abcE") == "abc"
    assert stop.feed("N") == ""
    assert stop.feed("x") == "ENx"
    assert stop.feed("yy\n") == "yy"
    assert stop.feed("\nzz") == "" and stop.stopped
    assert StopText([]).feed("a\n\n") == "a\n\n"


def test_images_take_the_template_markers():
    assert place_images("a<start_of_image>b<start_of_image>", 2) == "a[img-0]b[img-1]"
    assert place_images("plain", 1) == "[img-0]plain"
    assert math.isfinite(1.0)
