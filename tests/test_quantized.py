"""Quantized affine weights from an Ollama store load, run, and keep the candidate path exact."""

from __future__ import annotations

import mlx.nn as nn
import numpy as np
import pytest

from runner.score.validate import Row
from runner.service import Runner
from tests.candidates import full_vocab_logits
from tests.ollama_store import write_ollama_model

PROMPT = "Is the sky blue? Answer:"
IDS = list(range(0, 300, 7))


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama_dir):
    models = tmp_path_factory.mktemp("quantized-store")
    for kind in ("int4", "int8"):
        write_ollama_model(models, f"tiny-{kind}", tiny_llama_dir, quantize={"type": kind})
    return models


@pytest.mark.parametrize(("kind", "min_correlation"), [("int4", 0.98), ("int8", 0.999)])
def test_quantized_store_model_scores_like_the_dense_one(
    engine, llama_runner, store, monkeypatch, kind, min_correlation
):
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    runner = Runner.load(engine, f"tiny-{kind}")
    layer = runner.model.module.model.layers[0].self_attn.q_proj
    assert isinstance(layer, nn.QuantizedLinear)  # (computed by the library on the CPU)
    assert layer.bits == int(kind[-1])
    tokens = runner.tokenizer.encode(PROMPT)
    rows = [Row(tokens, IDS)]
    quantized = engine.call(lambda job: runner.scorer.score(rows, job.check)).logits[0]
    dense = engine.call(lambda job: llama_runner.scorer.score(rows, job.check)).logits[0]
    assert np.corrcoef(quantized, dense)[0, 1] > min_correlation
    # The candidate-only path is exact on the quantized model itself.
    full = full_vocab_logits(engine, runner, tokens, IDS)
    assert quantized == pytest.approx(full, abs=1e-4)
