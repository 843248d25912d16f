"""Cohere2-MoE readings the stored goldens cover only in part (runner/models/cohere2_moe.py):
where RoPE applies, the tied head by default, and the logit scale on both unembeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runner.models import Model, build_model
from runner.sources.loader import load_local_dir
from runner.sources.ollama_store import load_store_model
from tests.ollama_store import dequantized, write_ollama_model
from tests.tiny import tiny_config, write_tiny_model

ARCH = "Cohere2MoeForCausalLM"
IDS = mx.array([[5, 17, 42, 99, 23, 8, 61, 7, 19, 33, 71, 12]], dtype=mx.int32)


def load(path: Path, **edits: Any) -> Model:
    config = tiny_config(ARCH)
    for key, value in edits.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return build_model(load_local_dir(write_tiny_model(ARCH, path, config=config)))


@pytest.mark.parametrize(("pattern", "roped"), [(1, [1, 1, 1, 0]), (2, [0, 1, 1, 0])])
def test_rope_on_sliding_layers_and_dense_ones_of_a_pattern_of_one(
    tmp_path: Path, pattern: int, roped: list[int]
) -> None:
    # layer kinds: full (dense), sliding, sliding, full
    model = load(tmp_path, prefix_dense_sliding_window_pattern=pattern)
    layers = model.module.model.layers  # type: ignore[attr-defined]
    assert [int(layer.self_attn.rope is not None) for layer in layers] == roped


def test_absent_tie_word_embeddings_ties_and_logits_are_scaled(tmp_path: Path) -> None:
    model = load(tmp_path, tie_word_embeddings=None, logit_scale=0.5)
    assert "lm_head" not in model.module  # type: ignore[operator]
    hidden = model.hidden(IDS, model.make_caches())[0, -1:]
    embed = np.array(model.module.model.embed_tokens.weight)  # type: ignore[attr-defined]
    expected = 0.5 * np.array(hidden) @ embed.T
    assert np.allclose(np.array(model.unembed(hidden)), expected, atol=1e-5)
    ids = mx.array([3, 7, 11, 300], dtype=mx.int32)
    picked = np.array(model.unembed_candidates(hidden, ids))  # type: ignore[attr-defined]
    assert np.allclose(picked, expected[:, [3, 7, 11, 300]], atol=1e-5)


@pytest.mark.parametrize("quant_type", [None, "nvfp4"])
def test_from_an_ollama_store(tmp_path: Path, quant_type: str | None) -> None:
    """Stacked experts from a store (the Go importer's layout); quantized, routers and
    experts included, it computes what MLX's dequantization of the same tensors computes."""
    hf = write_tiny_model(ARCH, tmp_path / "hf")
    weights = mx.load(str(hf / "model.safetensors"))
    assert isinstance(weights, dict)
    for layer in (1, 2, 3):
        p = f"model.layers.{layer}.mlp.experts"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            experts = [weights.pop(f"{p}.{e}.{proj}.weight") for e in range(4)]
            weights[f"{p}.{proj}.weight"] = mx.stack(experts)
    mx.save_safetensors(str(hf / "model.safetensors"), weights, metadata={"format": "pt"})
    quantize = {"type": quant_type} if quant_type else None
    write_ollama_model(tmp_path / "store", "tiny", hf, quantize=quantize)
    source = load_store_model("tiny", tmp_path / "store")
    model = build_model(source)
    got = np.array(model.unembed(model.hidden(IDS, model.make_caches())))
    want = dequantized(source) if quant_type else load_local_dir(write_tiny_model(ARCH, tmp_path))
    expected = build_model(want)
    hidden = expected.hidden(IDS, expected.make_caches())
    assert np.abs(got - np.array(expected.unembed(hidden))).max() <= 1e-4
    if quant_type:
        gate = model.module.model.layers[1].mlp.gate  # type: ignore[attr-defined]
        assert isinstance(gate, nn.QuantizedLinear) and gate.mode == "nvfp4"
