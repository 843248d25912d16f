"""A completion through the runner process, the way Ollama's Go client asks for one
(docs/PROTOCOL.md §5): POST the CompletionRequest to the legacy /completion path, follow the 308
with the same body, read the 200 stream with a line scanner (skipping lines that do not
parse, failing on an `Error`), and stop after the `Done` line. Then SIGINT: exit 0.
"""

from __future__ import annotations

import http.client
import json
import signal
from collections.abc import Iterator

import pytest

from tests.ollama_store import write_ollama_model
from tools.spawned import SpawnedRunner

pytestmark = pytest.mark.slow
MAX_LINE_BYTES = 64 << 10  # bufio.Scanner's default limit: a longer line fails the stream


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama_dir):
    models = tmp_path_factory.mktemp("ollama-models")
    write_ollama_model(models, "tiny-llama:latest", tiny_llama_dir)
    return models


def post_following_308(port: int, path: str, body: bytes) -> http.client.HTTPResponse:
    """Go's client repeats the method and body at a 308's Location."""
    for _ in range(3):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 308:
            return response
        response.read()
        path = response.headers["Location"]
    raise AssertionError("redirect loop")


def scan(response: http.client.HTTPResponse) -> Iterator[dict]:
    """The Go client's loop: one JSON object per line, unparsable lines skipped, an Error
    raised, nothing read after Done."""
    while line := response.readline(MAX_LINE_BYTES + 1):
        assert len(line) <= MAX_LINE_BYTES and line.endswith(b"\n")
        try:
            item = json.loads(line)
        except ValueError:
            continue
        assert item["Error"] is None, item["Error"]
        yield item
        if item["Done"]:
            return
    raise AssertionError("the stream ended without a Done line")


def test_completion_through_the_legacy_path(store, llama_runner):
    args = ("runner", "--mlx-engine", "--model", "tiny-llama")
    with SpawnedRunner(*args, env={"OLLAMA_MODELS": str(store)}) as process:
        process.wait_ready(timeout=120)
        port = process.port
        prompt = "Is the sky blue? Yes. The cat sat on"
        body = json.dumps(
            {
                "Prompt": prompt,
                "Media": None,
                "Options": {"num_predict": 8, "temperature": 0, "seed": -1, "stop": ["\n\n"]},
                "Logprobs": False,
                "TopLogprobs": 0,
            }
        ).encode()
        response = post_following_308(port, "/completion", body)
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/jsonl"
        *chunks, done = list(scan(response))
        assert chunks and all(c["Content"] and not c["Done"] for c in chunks)
        assert done["Done"] and done["PromptEvalCount"] == len(
            llama_runner.tokenizer.encode(prompt)
        )
        assert (done["DoneReason"], done["EvalCount"]) == (1, 8)  # no EOS on this prompt

        response = post_following_308(port, "/completion", b'{"Prompt":""}')
        assert (response.status, response.read()) == (400, b"empty prompt\n")

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=5) == 0
