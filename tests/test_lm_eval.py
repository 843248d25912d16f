"""lm-evaluation-harness against a spawned `serve`, offline: a multiple-choice, a perplexity
and a generation task over local data (tests/data/lm_eval/), through its
`local-completions` model with the `remote` tokenizer (the runner's /tokenize). In the
reference tier the same tasks run on lm-eval's `hf` model over the same weights: every
per-sample loglikelihood within 1e-4, the same is_greedy, the same generations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.spawned import SpawnedRunner

pytestmark = pytest.mark.slow

# No hub: the tasks' data are local files, the hf model a local directory.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "data" / "lm_eval"
NAMES = ["runner_mc", "runner_ppl", "runner_gen"]


def evaluate(model: str, model_args: dict, batch_size: int = 1) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=NAMES,
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=batch_size,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def per_sample(results: dict) -> dict[str, list]:
    return {
        task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in results["samples"].items()
    }


def _pair(response) -> tuple[float, bool | None]:
    """(loglikelihood, is_greedy) of a multiple-choice answer; (loglikelihood, None) of a
    rolling one."""
    if isinstance(response, list | tuple):
        return float(response[0]), bool(response[1])
    return float(response), None


@pytest.fixture(scope="module")
def served_results(tiny_llama_dir, monkeypatch_module):
    monkeypatch_module.chdir(REPO)  # the task YAMLs name their data from the repository root
    with SpawnedRunner("serve", "--model", str(tiny_llama_dir)) as runner:
        runner.wait_ready(timeout=300)
        args = {
            "base_url": runner.url + "/v1/completions",
            "model": "tiny",
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "max_retries": 1,
            "max_length": 2048,
            # lm-eval's remote tokenizer takes `bos_token_id or eos_token_id`, so a BOS of id
            # 0 would give way to EOS; its hf model prefixes rolling windows with the BOS
            "custom_prefix_token_id": 0,
        }
        results = evaluate("local-completions", args, batch_size=4)
        assert runner.stop() == 0
    return results


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_lm_eval_runs_against_serve(served_results):
    metrics = served_results["results"]
    assert 0 <= metrics["runner_mc"]["acc,none"] <= 1
    assert metrics["runner_ppl"]["word_perplexity,none"] > 1
    assert "exact_match,remove_whitespace" in metrics["runner_gen"] or any(
        k.startswith("exact_match") for k in metrics["runner_gen"]
    )
    samples = per_sample(served_results)
    assert len(samples["runner_mc"]) == 8 and len(samples["runner_ppl"]) == 4


@pytest.mark.reference
def test_lm_eval_equals_its_hf_model(served_results, tiny_llama_dir, reference_libraries):
    pytest.importorskip("accelerate")
    hf = evaluate(
        "hf",
        {"pretrained": str(tiny_llama_dir), "dtype": "float32", "device": "cpu"},
        batch_size=1,
    )
    ours, theirs = per_sample(served_results), per_sample(hf)
    compared = 0
    for task in ("runner_mc", "runner_ppl"):
        for mine, reference in zip(ours[task], theirs[task], strict=True):
            for a, b in zip(mine, reference, strict=True):
                (ll, greedy), (ll_hf, greedy_hf) = _pair(a[0]), _pair(b[0])
                assert ll == pytest.approx(ll_hf, abs=1e-4)
                assert greedy == greedy_hf
                compared += 1
    assert compared == 8 * 4 + 4
    assert ours["runner_gen"] == theirs["runner_gen"]
    for task in ("runner_mc", "runner_ppl", "runner_gen"):
        mine_metrics, hf_metrics = served_results["results"][task], hf["results"][task]
        for key, value in hf_metrics.items():
            if isinstance(value, float) and "stderr" not in key:
                assert mine_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
