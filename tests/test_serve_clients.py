"""A spawned `python -m runner serve` driven by the official `openai` and `ollama` Python
clients, as users' code drives it (tools/spawned.py spawns it)."""

from __future__ import annotations

import json
import shutil

import pytest

from tools.spawned import SpawnedRunner

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    model = tmp_path_factory.mktemp("chat-model") / "tiny-chat"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with SpawnedRunner("serve", "--model", str(model)) as runner:
        runner.wait_ready(timeout=300)
        yield runner
        assert runner.stop() == 0


def test_openai_client(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    (model,) = client.models.list().data
    assert model.id == "tiny-chat"
    done = client.completions.create(
        model=model.id,
        prompt="Is the sky blue?",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
    )
    choice = done.choices[0]
    assert choice.text.startswith("Is the sky blue?")
    assert choice.logprobs.token_logprobs[0] is None
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs[1:])
    ids = client.completions.create(
        model=model.id, prompt=[[5, 6, 7]], max_tokens=0, echo=True, logprobs=0
    )
    assert len(ids.choices[0].logprobs.token_logprobs) == 3
    chat = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model.id, prompt="x", n=2)
    assert refused.value.status_code == 400 and "n = 1" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model.id, prompt="word " * 3000, max_tokens=1)
    assert "maximum context length is 2048" in str(refused.value)


def test_ollama_client(served):
    client = ollama.Client(host=served.url)
    listed = client.list()
    assert listed.models[0].model == "tiny-chat"
    options = {"num_predict": 4, "temperature": 0, "seed": 1}
    answer = client.generate(model="tiny-chat", prompt="Is the sky blue?", options=options)
    assert answer.done and answer.eval_count <= 4 and answer.prompt_eval_count > 0
    parts = list(
        client.generate(model="tiny-chat", prompt="Is the sky blue?", options=options, stream=True)
    )
    assert "".join(p.response for p in parts) == answer.response
    assert parts[-1].done_reason in ("stop", "length") and parts[-1].total_duration > 0
    chat = client.chat(
        model="tiny-chat",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        options=options,
    )
    assert chat.message.role == "assistant" and chat.message.content == answer.response
    shown = client.show("tiny-chat")
    assert shown.template == TEMPLATE
    assert client.ps().models[0].model == "tiny-chat"
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="tiny-chat", prompt="word " * 3000, raw=True)
    assert refused.value.status_code == 400 and "maximum context length" in refused.value.error
