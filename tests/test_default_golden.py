"""The real default model (SmolLM2-135M-Instruct, loaded from its Q4_1 GGUF) gives
transformers' candidate logits on the same values.

transformers runs a float32 checkpoint of the GGUF's dequantized values; the goldens were
written by `python -m tests.golden.default_model` and the reference tier recomputes them live.
"""

from __future__ import annotations

import json

import pytest

from runner.score.validate import Row
from runner.service import Runner
from tests.golden.default_model import GOLDEN, exact_checkpoint, reference_rows, rows_spec

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4  # measured: at most 3e-5 on these rows


@pytest.fixture(scope="module")
def default_runner(engine, default_model_dir):
    return Runner.load(engine, "default")


def score_rows(engine, runner, golden_rows):
    rows = [Row(r["tokens"], r["ids"]) for r in golden_rows]
    return engine.call(lambda job: runner.scorer.score(rows, job.check)).logits


def test_tokenization_matches_the_goldens(default_runner):
    for row in json.loads(GOLDEN.read_text())["rows"]:
        assert default_runner.tokenizer.encode(row["prompt"]) == row["tokens"]


def test_candidate_logits_equal_transformers(engine, default_runner):
    golden = json.loads(GOLDEN.read_text())["rows"]
    ours = score_rows(engine, default_runner, golden)
    for row, logits in zip(golden, ours, strict=True):
        assert logits == pytest.approx(row["logits"], abs=TOLERANCE), row["prompt"][-40:]
    # The capital of France is... Paris.
    assert max(zip(ours[0], golden[0]["candidates"], strict=True))[1] == " Paris"


@pytest.mark.reference
def test_candidate_logits_equal_transformers_live(engine, default_runner, tmp_path):
    pytest.importorskip("torch")
    live = reference_rows(exact_checkpoint(tmp_path), rows_spec(), default_runner.tokenizer)
    ours = score_rows(engine, default_runner, live)
    for row, logits in zip(live, ours, strict=True):
        assert logits == pytest.approx(row["logits"], abs=TOLERANCE)
