"""The runner as a process, driven the way Ollama's Go supervisor drives it (docs/PROTOCOL.md §1).

Spawn `<python> -m runner runner --mlx-engine --model NAME --port P` against a model in a
temporary Ollama store, poll /v1/status every 100 ms until it answers 200, POST to the legacy
/score path and follow the 308 with the body, then SIGINT and expect exit 0 within 5 s.
Fatal start-up errors are one `Error: ` line on stderr and exit 1.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.ollama_store import write_ollama_model
from tools.spawned import SpawnedRunner

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def spawned(models_dir: Path, *flags: str, **kwargs) -> SpawnedRunner:
    return SpawnedRunner(*flags, env={"OLLAMA_MODELS": str(models_dir)}, **kwargs)


def post_following_308(url: str, body: bytes) -> tuple[int, bytes, list[int]]:
    """Go's client re-sends the same method and body to a 308's Location."""
    statuses = []
    for _ in range(3):
        request = urllib.request.Request(url, data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                statuses.append(response.status)
                return response.status, response.read(), statuses
        except urllib.error.HTTPError as e:
            statuses.append(e.code)
            if e.code != 308:
                return e.code, e.read(), statuses
            url = urllib.parse.urljoin(url, e.headers["Location"])
    raise AssertionError("redirect loop")


@pytest.fixture(scope="module")
def ollama_store(tmp_path_factory, tiny_llama_dir):
    models = tmp_path_factory.mktemp("ollama-models")
    write_ollama_model(models, "tiny-llama:latest", tiny_llama_dir)
    return models


def test_supervisor_lifecycle(ollama_store, llama_runner):
    args = ("runner", "--mlx-engine", "--model", "tiny-llama")
    with spawned(ollama_store, *args) as process:
        status = process.wait_ready(timeout=120)
        port = process.port
        assert status["ContextLength"] == llama_runner.context_length
        prompt = "Is the sky blue?"
        tokens = llama_runner.tokenizer.encode(prompt)
        body = json.dumps(
            {"rows": [{"prompt": prompt, "candidates": ["?", "!"]}], "max_tokens": 64}
        ).encode()
        _, answer, statuses = post_following_308(f"http://127.0.0.1:{port}/score", body)
        assert statuses == [308, 200], answer
        result = json.loads(answer)
        assert result["input_tokens"] == len(tokens)
        assert len(result["logits"][0]) == 2
        process.send_signal(signal.SIGINT)
        started = time.monotonic()
        assert process.wait(timeout=5) == 0
        assert time.monotonic() - started < 5


def test_sigterm_during_a_long_request_exits_promptly(ollama_store, llama_runner):
    with spawned(ollama_store, "--model=tiny-llama", port_flag="-port") as process:
        process.wait_ready(timeout=120)
        port = process.port
        rows = [
            {"prompt": "Is the sky blue? " * 60 + f"Q{i}", "candidates": ["?"]} for i in range(64)
        ]
        body = json.dumps({"rows": rows, "max_tokens": 4096}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/score", data=body)
        threading.Thread(target=lambda: _ignore_errors(request), daemon=True).start()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0


def _ignore_errors(request) -> None:
    with contextlib.suppress(Exception):  # the runner is told to stop mid-request
        urllib.request.urlopen(request, timeout=30).read()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no-such-model"], "Error: "),
        (["--model", "bad-arch"], "Error: unsupported architecture: NoSuchForCausalLM"),
        (["--model", "bad-weights"], "Error: "),
    ],
)
def test_fatal_start_up_errors(tmp_path, tiny_llama_dir, args, message):
    import shutil

    models = tmp_path / "models"
    bad_arch = tmp_path / "bad-arch-src"
    shutil.copytree(tiny_llama_dir, bad_arch)
    config = json.loads((bad_arch / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (bad_arch / "config.json").write_text(json.dumps(config))
    write_ollama_model(models, "bad-arch", bad_arch)
    corrupt = tmp_path / "corrupt"  # its own store: blobs are shared by content
    write_ollama_model(corrupt, "bad-weights", tiny_llama_dir)
    for blob in (corrupt / "blobs").iterdir():
        if not blob.read_bytes()[:16].lstrip().startswith(b"{"):  # not a JSON layer
            blob.write_bytes(b"\x00garbage")
    if "bad-weights" in args:
        models = corrupt
    with spawned(models, *args) as process:
        assert process.wait(timeout=120) == 1
        output = process.output()
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, output
    assert errors[0].startswith(message)
