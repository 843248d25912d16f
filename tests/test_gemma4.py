"""Gemma 4 specifics (runner/models/gemma4.py): suppress_tokens, KV sharing under batched
rows, the configs transformers wrote before `per_layer_config`, the unified text model's
defaults, and loading from an Ollama store."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from runner.models import build_model, gemma4
from runner.models.gemma4 import Gemma4
from runner.sources.loader import load_local_dir, load_model_source
from runner.sources.source import ModelLoadError
from tests.golden_logits import assert_matches, stored_golden
from tests.ollama_store import write_ollama_model
from tests.tiny import tiny_config, write_tiny_model

CAUSAL, NESTED = "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"
SUPPRESSED = [5, 17, 300]
IDS = mx.array([[12, 40, 7, 99, 250, 3, 61, 8, 19, 33, 71, 14]], dtype=mx.int32)


def with_generation_config(path: Path, generation_config: dict) -> Path:
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def last_hidden(model, ids: mx.array = IDS) -> mx.array:
    return model.hidden(ids, model.make_caches())[:, -1, :]


@pytest.mark.parametrize("arch", [CAUSAL, NESTED])
def test_suppress_tokens_are_minus_infinity(tmp_path: Path, arch: str) -> None:
    """generation_config.json's suppress_tokens are -inf after the soft-cap, in the full
    logits and the candidates' alike; every other logit is the plain model's."""
    plain = build_model(load_local_dir(write_tiny_model(arch, tmp_path / "plain")))
    path = with_generation_config(
        write_tiny_model(arch, tmp_path / "suppressed"), {"suppress_tokens": SUPPRESSED}
    )
    model = build_model(load_local_dir(path))
    h = last_hidden(model)
    full = np.array(model.unembed(h))
    expected = np.array(plain.unembed(last_hidden(plain)))
    assert np.isneginf(full[0, SUPPRESSED]).all()
    kept = np.setdiff1d(np.arange(model.vocab_size), SUPPRESSED)
    assert np.abs(full[0, kept] - expected[0, kept]).max() <= 1e-5
    ids = [3, 5, 17, 40, 300, 383]
    picked = np.array(model.unembed_candidates(h, mx.array(ids, dtype=mx.int32)))
    assert np.isneginf(picked[0, [1, 2, 4]]).all()
    assert np.abs(picked[0, [0, 3, 5]] - full[0, [3, 40, 383]]).max() <= 1e-5


@pytest.mark.parametrize(
    ("generation_config", "message"),
    [
        ({"suppress_tokens": [3, 384]}, "suppress_tokens must be a list of token ids below 384"),
        ({"suppress_tokens": "5"}, "suppress_tokens must be a list"),
        ({"suppress_tokens": [True]}, "suppress_tokens must be a list"),
    ],
)
def test_bad_suppress_tokens_are_refused(tmp_path: Path, generation_config, message) -> None:
    path = with_generation_config(write_tiny_model(CAUSAL, tmp_path), generation_config)
    with pytest.raises(ModelLoadError, match=message):
        build_model(load_local_dir(path))


def test_kv_sharing_layers_read_the_donors_batched_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV-sharing layers keep no K/V weights and no caches; over rows batched on a shared
    prefix they must attend to the donor's prefix: without the shared view the load-time check
    (runner/models/build.py) finds the batched rows wrong and refuses the model."""
    path = write_tiny_model(CAUSAL, tmp_path)
    model = build_model(load_local_dir(path))
    layers = model.module.model.layers
    assert [("k_proj" in layer.self_attn) for layer in layers] == [True] * 3 + [False] * 2
    assert model.module.model.donors == [0, 1, 2, 2, 1]
    assert len(model.make_caches()) == 3

    monkeypatch.setattr(gemma4, "_SharedView", lambda donor: None)
    with pytest.raises(ModelLoadError, match="rows batched over a shared prefix differ"):
        build_model(load_local_dir(path))


def test_global_head_dim_without_per_layer_config(tmp_path: Path) -> None:
    """A config written before transformers' per_layer_config (global_head_dim,
    num_global_key_value_heads with attention_k_eq_v) reads as the same model."""
    config = tiny_config(CAUSAL)
    del config["per_layer_config"]
    config |= {"global_head_dim": 32, "num_global_key_value_heads": 1}
    model = build_model(load_local_dir(write_tiny_model(CAUSAL, tmp_path, config=config)))
    for tokens, expected in stored_golden(CAUSAL):
        assert_matches(model, tokens, expected)


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"per_layer_config": {"9": {"head_dim": 32}}}, "per_layer_config key '9' is not a"),
        ({"per_layer_config": {"1": {"sliding_window": 4}}}, "sliding_window not supported"),
        ({"per_layer_config": {"1": {"head_dim": 0}}}, "layer 1 head_dim must be a positive"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers 5 leaves no layer"),
        ({"num_kv_shared_layers": 4}, "leaves no earlier full_attention layer"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope_type 'yarn'"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5}, "top_k_experts 5"),
    ],
)
def test_bad_gemma4_configs_are_refused(edits: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Gemma4.build_module(tiny_config(CAUSAL) | edits)


def test_unified_text_model_takes_transformers_defaults() -> None:
    """Gemma4UnifiedTextConfig: no per-layer inputs, window 1024, the last layer global;
    mlx-lm's defaults would give 256-wide per-layer inputs and a soft-cap of 30."""
    module = Gemma4.build_module(
        {"architectures": ["Gemma4UnifiedForCausalLM"], "model_type": "gemma4_unified_text"}
    )
    args = module.args
    assert args.hidden_size_per_layer_input == 0 and args.sliding_window == 1024
    assert args.final_logit_softcapping is None and not args.use_double_wide_mlp
    kinds = module.model.kinds
    assert kinds[-1] == "full_attention" and kinds[:5] == ["sliding_attention"] * 5
    attention = module.model.layers[5].self_attn
    assert (attention.head_dim, attention.n_kv_heads) == (512, 4)


def test_conditional_generation_loads_from_an_ollama_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MoE model nested under text_config, imported into an Ollama store with its media
    towers and generation_config.json: the same logits as from the directory, suppressed ids
    included."""
    path = with_generation_config(
        write_tiny_model(NESTED, tmp_path / "hf"), {"suppress_tokens": SUPPRESSED}
    )
    models = tmp_path / "ollama-models"
    write_ollama_model(models, "tiny-gemma4", path)
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    from_store = build_model(load_model_source("tiny-gemma4"))
    from_dir = build_model(load_local_dir(path))
    store_logits = np.array(from_store.unembed(last_hidden(from_store)))
    dir_logits = np.array(from_dir.unembed(last_hidden(from_dir)))
    assert np.isneginf(store_logits[0, SUPPRESSED]).all()
    finite = np.isfinite(dir_logits)
    assert np.array_equal(finite, np.isfinite(store_logits))
    assert np.abs(store_logits[finite] - dir_logits[finite]).max() <= 1e-6
