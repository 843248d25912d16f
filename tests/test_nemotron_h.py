"""Nemotron-H specifics (runner/models/nemotron_h.py): reading the layer kinds and the time
step's clamp, the caches they get, and stores that quantized the MoE router."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from runner.models import build_model
from runner.models.nemotron_h import NemotronH, layer_kinds, time_step_limit
from runner.sources.loader import load_local_dir
from runner.sources.source import ModelLoadError, config_json
from tests.tiny import tiny_config, write_tiny_model

ARCH = "NemotronHForCausalLM"
KINDS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]


@pytest.mark.parametrize(
    "spelling",
    [
        {"layers_block_type": KINDS},
        {"layer_types": KINDS},
        {"layers_block_type": ["mamba", "moe", "attention", "mlp", "conv"]},
        {"hybrid_override_pattern": "ME*-M"},
    ],
)
def test_layer_kinds_in_every_spelling(spelling: dict) -> None:
    assert layer_kinds(spelling) == KINDS


@pytest.mark.parametrize(
    "spelling",
    [{}, {"hybrid_override_pattern": "MA*"}, {"hybrid_override_pattern": ""}, {"layer_types": []}],
)
def test_bad_layer_kinds_are_refused(spelling: dict) -> None:
    with pytest.raises(ModelLoadError, match="layers_block_type"):
        layer_kinds(spelling)


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("{}", (0.0, math.inf)),
        ('{"time_step_limit": null}', (0.0, math.inf)),
        ('{"time_step_limit": [0.0, Infinity]}', (0.0, math.inf)),  # Python's json.dumps
        # transformers 5's own spelling
        ('{"time_step_limit": [0.0, {"__float__": "Infinity"}]}', (0.0, math.inf)),
        ('{"time_step_limit": [0.01, 2]}', (0.01, 2.0)),
        ('{"mamba_dt_limit": [0.01, 2]}', (0.01, 2.0)),  # legacy
        ('{"mamba_dt_limit": [0.01, 2], "time_step_limit": [0, 5]}', (0.01, 2.0)),
        ('{"time_step_min": 0.5}', (0.0, math.inf)),  # initialisation only
    ],
)
def test_the_time_step_limit_in_every_spelling(text: str, limit: tuple[float, float]) -> None:
    assert time_step_limit(config_json(text)) == limit


@pytest.mark.parametrize(
    "value", [[1.0, 0.5], [0.0], "0,inf", [math.nan, 1.0], [True, 1.0], [-math.inf, 1.0]]
)
def test_a_malformed_time_step_limit_is_refused(value: object) -> None:
    with pytest.raises(ModelLoadError, match="time_step_limit must be"):
        time_step_limit({"time_step_limit": value})


def test_the_time_step_is_clamped_to_the_limit_whatever_its_spelling(tmp_path: Path) -> None:
    """The legacy spelling computes what the current one does, and a clamp that bites
    changes the logits (tests/test_golden.py holds the default clamp to transformers)."""
    ids = mx.array([[5, 6, 7, 8, 9, 10]], dtype=mx.int32)

    def logits(edits: dict, name: str) -> np.ndarray:
        config = tiny_config(ARCH) | edits
        model = build_model(load_local_dir(write_tiny_model(ARCH, tmp_path / name, config=config)))
        return np.array(model.unembed(model.hidden(ids, model.make_caches())))

    current = logits({"time_step_limit": [0.3, 0.5]}, "current")
    legacy = logits({"mamba_dt_limit": [0.3, 0.5], "time_step_limit": None}, "legacy")
    assert np.array_equal(current, legacy)
    assert np.abs(current - logits({}, "default")).max() > 1e-3


def test_a_config_written_by_transformers_reads_its_infinity(tmp_path: Path) -> None:
    """tests/data's config holds transformers' `{"__float__": "Infinity"}`; read as a float."""
    config = tiny_config(ARCH)
    assert config["time_step_limit"][1] == {"__float__": "Infinity"}
    path = write_tiny_model(ARCH, tmp_path)
    assert load_local_dir(path).config["time_step_limit"] == [0.0, math.inf]
    assert json.loads((path / "config.json").read_text())["time_step_limit"][1] != math.inf


def test_stateless_layers_have_no_cache_and_attention_has_no_rope() -> None:
    """A slot per Mamba2 (recurrent) and attention (KV) layer, none for MLP / MoE layers;
    a pattern without attention layers builds its masks without an attention cache."""
    config = config_json(json.dumps(tiny_config(ARCH)))  # as the loaders read it
    module = NemotronH.build_module(config | {"layers_block_type": ["mamba", "moe"]})
    assert [type(c) for c in module.make_cache()] == [ArraysCache]
    caches = module.make_cache()
    h = module.backbone(mx.array([[1, 2, 3]], dtype=mx.int32), cache=caches)
    assert h.shape == (1, 3, 64) and caches[0][1] is not None
    module = NemotronH.build_module(config | {"layers_block_type": ["attention"]})
    assert [type(c) for c in module.make_cache()] == [KVCache]
    assert "rope" not in module.backbone.layers[0].mixer


def test_a_quantized_router_loads_dequantized(tmp_path: Path) -> None:
    """mlx-lm's router is a plain matrix; a store that quantized it loads it dequantized."""
    source = load_local_dir(write_tiny_model(ARCH, tmp_path))
    dense = build_model(source)
    name = "backbone.layers.1.mixer.gate"
    packed, scales, biases = mx.quantize(source.weights[f"{name}.weight"], 32, 8)
    source.weights |= {f"{name}.weight": packed, f"{name}.scales": scales, f"{name}.biases": biases}
    model = build_model(source)
    expected = mx.dequantize(packed, scales, biases, 32, 8)
    router = model.module.backbone.layers[1].mixer.gate.weight
    assert np.array_equal(np.array(router), np.array(expected))
    ids = mx.array([[5, 6, 7, 8]], dtype=mx.int32)
    got = model.unembed(model.hidden(ids, model.make_caches()))
    want = dense.unembed(dense.hidden(ids, dense.make_caches()))
    assert np.corrcoef(np.array(got).ravel(), np.array(want).ravel())[0, 1] > 0.99


@pytest.mark.parametrize(
    ("arch", "key"),
    [("NemotronH_Nano_VL_V2", "llm_config"), ("NemotronH_Nano_Omni_Reasoning_V3", "text_config")],
)
def test_multimodal_names_load_the_language_model(tmp_path: Path, arch: str, key: str) -> None:
    """The language model nested in a multimodal checkpoint (config and weights), beside media
    weights that are dropped, computes what the plain model computes. (Not checked against
    transformers: its tiny multimodal models need their own vision and audio configs.)"""
    plain = load_local_dir(write_tiny_model(ARCH, tmp_path))
    nested = load_local_dir(tmp_path)
    nested.config = {"architectures": [arch], key: plain.config, "vision_config": {}}
    nested.weights = {f"language_model.{k}": v for k, v in plain.weights.items()}
    nested.weights["vision_model.patch.weight"] = mx.zeros((4, 4))
    nested.weights["mlp1.0.weight"] = mx.zeros((4,))
    model, reference = build_model(nested), build_model(plain)
    assert model.architecture == arch and model.context_length == reference.context_length
    ids = mx.array([[5, 6, 7, 8, 9]], dtype=mx.int32)
    got = model.unembed(model.hidden(ids, model.make_caches()))
    want = reference.unembed(reference.hidden(ids, reference.make_caches()))
    assert np.array_equal(np.array(got), np.array(want))
