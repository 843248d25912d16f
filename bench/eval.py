"""`python -m bench.eval`: the *eval* workload, lm-evaluation-harness end to end.

A multiple-choice task of `--questions` questions with 4 choices each (arithmetic, seeded)
after a shared few-shot block of `--shots` solved examples (lm-eval's `description`, so
every context starts with the same ~400 tokens), written as a local task (no hub), timed
end to end through `lm_eval.simple_evaluate` on each system:

- `serve`: `python -m runner serve` through lm-eval's `local-completions` (remote
  tokenizer, `--batch-size` prompts a request);
- `hf`: lm-eval's `hf` model (transformers, float32, CPU, torch on the same threads);
- `llama.cpp`: llama-cpp-python with `logits_all` over the float32 GGUF, as an lm-eval
  model written here: each request reuses the KV cache's longest common prefix with the
  previous one (`kv_cache_seq_rm`), evaluates the rest, and reads the continuation's rows;
- `mlx-lm`: `mlx_lm.server` is sent the request lm-eval sends (`echo`, integer `logprobs`,
  `max_tokens` 1); what it answers is reported (it does not return prompt logprobs).

Reported per system: wall seconds of the evaluation (the model's load or spawn apart),
accuracy, and against `hf` the largest per-sample loglikelihood difference and the number
of is_greedy disagreements. `--json PATH` writes everything.

    python -m bench.eval --model default --questions 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK = "bench_eval"
SYSTEMS = ("serve", "hf", "llama.cpp", "mlx-lm")


def _question(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    right = a + b
    wrong = set()
    while len(wrong) < 3:
        candidate = right + rng.choice([-11, -10, -2, -1, 1, 2, 9, 10])
        if candidate > 0 and candidate != right:
            wrong.add(candidate)
    choices = [str(c) for c in [right, *sorted(wrong)]]
    rng.shuffle(choices)
    return f"What is {a} plus {b}?", choices, choices.index(str(right))


def write_task(directory: Path, questions: int, shots: int, seed: int) -> Path:
    """The task YAML and its data in `directory`; returns the directory."""
    rng = random.Random(seed)
    examples = []
    for _ in range(shots):
        q, choices, answer = _question(rng)
        examples.append(f"Question: {q}\nAnswer: {choices[answer]}\n\n")
    description = "Answer each question with the right number.\n\n" + "".join(examples)
    data = directory / "eval.jsonl"
    with data.open("w") as f:
        for _ in range(questions):
            q, choices, answer = _question(rng)
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    (directory / "eval.yaml").write_text(
        "\n".join(
            [
                f"task: {TASK}",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {json.dumps(str(data))}",
                "test_split: test",
                "output_type: multiple_choice",
                f"description: {json.dumps(description)}",
                'doc_to_text: "Question: {{question}}\\nAnswer:"',
                'doc_to_choice: "{{choices}}"',
                'doc_to_target: "{{answer}}"',
                "metric_list:",
                "  - metric: acc",
                "",
            ]
        )
    )
    return directory


def evaluate(model: Any, model_args: Any, tasks_dir: Path, batch_size: int) -> tuple[dict, float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir))
    started = time.perf_counter()
    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=manager,
        batch_size=batch_size,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return results, time.perf_counter() - started


def samples(results: dict) -> list[list[tuple[float, bool]]]:
    rows = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[(float(r[0][0]), bool(r[0][1])) for r in row["resps"]] for row in rows]


# --- systems ------------------------------------------------------------------------------
def run_serve(model_dir: Path, tasks: Path, batch_size: int) -> dict[str, Any]:
    from tools.spawned import SpawnedRunner

    began = time.perf_counter()
    with SpawnedRunner("serve", "--model", str(model_dir)) as runner:
        runner.wait_ready()
        setup = time.perf_counter() - began
        args = {
            "base_url": runner.url + "/v1/completions",
            "model": model_dir.name,
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "max_retries": 1,
            "max_length": 2048,
            "custom_prefix_token_id": 0,
        }
        results, seconds = evaluate("local-completions", args, tasks, batch_size)
        runner.stop()
    return {"results": results, "seconds": seconds, "setup_seconds": setup}


def run_hf(model_dir: Path, tasks: Path, batch_size: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    began = time.perf_counter()
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=batch_size)
    setup = time.perf_counter() - began
    results, seconds = evaluate(model, None, tasks, batch_size)
    return {"results": results, "seconds": seconds, "setup_seconds": setup}


def llama_cpp_model(gguf: Path, model_dir: Path, threads: int) -> Any:
    """lm-eval's model interface over llama-cpp-python with `logits_all`, reusing the KV
    cache's longest common prefix with the previous request."""
    import numpy as np
    from llama_cpp import Llama
    from lm_eval.api.model import TemplateLM
    from transformers import AutoTokenizer

    class LlamaCppLogits(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.llm = Llama(
                model_path=str(gguf),
                n_ctx=2048,
                n_batch=512,
                logits_all=True,
                n_threads=threads,
                verbose=False,
            )
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.eot_token_id

        def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
            return self.tokenizer(string, add_special_tokens=False).input_ids

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kw: Any):
            out = []
            llm = self.llm
            for _, context, continuation in requests:
                tokens = list(context) + list(continuation)
                held = list(llm.input_ids[: llm.n_tokens])
                keep = 0
                while keep < min(len(held), len(tokens) - 1) and held[keep] == tokens[keep]:
                    keep += 1
                keep = min(keep, len(context))  # the continuation's rows are computed anew
                if keep < llm.n_tokens:
                    llm._ctx.kv_cache_seq_rm(-1, keep, -1)
                    llm.n_tokens = keep
                llm.eval(tokens[keep:])
                rows = np.asarray(llm.scores[len(context) - 1 : len(tokens) - 1], dtype=np.float64)
                top = rows.max(axis=1, keepdims=True)
                logprobs = rows - (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))
                picked = logprobs[np.arange(len(continuation)), continuation]
                greedy = bool((rows.argmax(axis=1) == np.asarray(continuation)).all())
                out.append((float(picked.sum()), greedy))
            return out

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False):
            raise NotImplementedError

        def generate_until(self, requests: list, disable_tqdm: bool = False):
            raise NotImplementedError

    return LlamaCppLogits()


def run_llama_cpp(model_dir: Path, tasks: Path, threads: int) -> dict[str, Any]:
    from runner.sources.default_model import model_dir as default_dir

    gguf = default_dir().with_name(default_dir().name + ".gguf") / "f32.gguf"
    if not gguf.is_file():
        return {"error": f"no float32 GGUF at {gguf}"}
    began = time.perf_counter()
    model = llama_cpp_model(gguf, model_dir, threads)
    setup = time.perf_counter() - began
    results, seconds = evaluate(model, None, tasks, 1)
    return {"results": results, "seconds": seconds, "setup_seconds": setup, "gguf": str(gguf)}


def probe_mlx_lm(model_dir: Path, tasks: Path) -> dict[str, Any]:
    """What mlx_lm.server answers to lm-eval's loglikelihood request."""
    from tools.spawned import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="mlx-lm-", suffix=".log", delete=False)  # noqa: SIM115
    import subprocess

    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=1).read()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        body = {
            "model": str(model_dir),
            "prompt": "Question: What is 2 plus 2?\nAnswer: 4",
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                answer = json.loads(response.read())
            choice = (answer.get("choices") or [{}])[0]
            logprobs = choice.get("logprobs") or {}
            token_logprobs = logprobs.get("token_logprobs")
            return {
                "answer": "200",
                "prompt_logprobs": bool(token_logprobs) and len(token_logprobs) > 1,
                "choice": json.dumps(choice)[:400],
            }
        except urllib.error.HTTPError as e:
            return {"answer": f"HTTP {e.code}: {e.read()[:300]!r}"}
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            return {"answer": f"no answer: {e!r}"}
    finally:
        process.terminate()
        process.wait(10)


# --- report -------------------------------------------------------------------------------
def compare(reference: dict, other: dict) -> dict[str, Any]:
    ref, mine = samples(reference["results"]), samples(other["results"])
    worst, disagree, count = 0.0, 0, 0
    for a, b in zip(ref, mine, strict=True):
        for (ll_a, g_a), (ll_b, g_b) in zip(a, b, strict=True):
            worst = max(worst, abs(ll_a - ll_b))
            disagree += g_a != g_b
            count += 1
    return {"max_abs_loglikelihood_diff": worst, "is_greedy_disagreements": disagree, "n": count}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # no preload here: serve re-executes itself with it; hf and llama.cpp use their own BLAS
    p = argparse.ArgumentParser(prog="python -m bench.eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a model directory, or `default`")
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--shots", type=int, default=24, help="solved examples in the shared block")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per request to serve")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.model == "default":
        from runner.sources.default_model import resolve_default_model

        model_dir = resolve_default_model()
    else:
        model_dir = Path(args.model).expanduser()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    report: dict[str, Any] = {"model": str(model_dir), "questions": args.questions}
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        tasks = write_task(Path(tmp), args.questions, args.shots, args.seed)
        runs: dict[str, dict[str, Any]] = {}
        for name in systems:
            print(f"== {name}", flush=True)
            try:
                if name == "serve":
                    runs[name] = run_serve(model_dir, tasks, args.batch_size)
                elif name == "hf":
                    runs[name] = run_hf(model_dir, tasks, args.batch_size, args.threads)
                elif name == "llama.cpp":
                    runs[name] = run_llama_cpp(model_dir, tasks, args.threads)
                elif name == "mlx-lm":
                    runs[name] = probe_mlx_lm(model_dir, tasks)
            except Exception as e:  # a system that cannot run here is reported, not fatal
                runs[name] = {"error": repr(e)}
            print(json.dumps(_summary(runs[name]), default=str), flush=True)
    rows = {}
    for name, run in runs.items():
        row = _summary(run)
        if "results" in run and "hf" in runs and "results" in runs["hf"] and name != "hf":
            row.update(compare(runs["hf"], run))
        rows[name] = row
    for name, row in rows.items():
        if "seconds" in row and name != "serve" and "seconds" in rows.get("serve", {}):
            row["serve_speedup"] = row["seconds"] / rows["serve"]["seconds"]
    report["systems"] = rows
    print(json.dumps(report, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in run.items() if k != "results"}
    if "results" in run:
        out["acc"] = run["results"]["results"][TASK]["acc,none"]
    return out


if __name__ == "__main__":
    sys.exit(main())
