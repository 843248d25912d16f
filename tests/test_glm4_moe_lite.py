"""GLM-4 MoE Lite readings that the goldens cover only in part (runner/models/glm4_moe_lite.py):
which layers are MoE, the latent norms' eps, the head, and experts that arrive stacked."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import glm4_moe_lite as glm
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from runner.models import Model, build_model
from runner.sources.loader import load_local_dir
from runner.sources.ollama_store import load_store_model
from runner.sources.source import ModelLoadError
from tests.ollama_store import dequantized, write_ollama_model
from tests.tiny import load_tiny_model, write_tiny_model

ARCH = "Glm4MoeLiteForCausalLM"
IDS = mx.array([[5, 17, 42, 99, 23, 8, 61, 7, 19]], dtype=mx.int32)


def logits(model: Model) -> np.ndarray:
    return np.array(model.unembed(model.hidden(IDS, model.make_caches())).astype(mx.float32))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return load_tiny_model(ARCH, tmp_path_factory.mktemp("glm"))


def test_mlp_layer_types_decide_the_moe_layers(reference: Model) -> None:
    # mlx-lm's first_k_dense_replace (default 1) would make layer 1 an MoE layer
    layers = reference.module.model.layers  # type: ignore[attr-defined]
    assert [isinstance(layer.mlp, glm.Glm4MoeLiteMoE) for layer in layers] == [0, 0, 1, 1]


def test_without_mlp_layer_types_the_first_layer_is_dense() -> None:
    from runner.models.glm4_moe_lite import Glm4MoeLite

    config = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 4, "n_routed_experts": 4, "kv_lora_rank": 16}
    module = Glm4MoeLite.build_module(config)
    layers = module.model.layers
    assert [isinstance(layer.mlp, glm.Glm4MoeLiteMoE) for layer in layers] == [0, 1, 1]


def test_latent_norms_use_transformers_eps(reference: Model) -> None:
    attn = reference.module.model.layers[0].self_attn  # type: ignore[attr-defined]
    assert attn.kv_a_layernorm.eps == attn.q_a_layernorm.eps == 1e-6
    assert reference.module.model.layers[0].input_layernorm.eps == 1e-5  # type: ignore[attr-defined]


def test_the_head_is_tied_by_config(tmp_path: Path, reference: Model) -> None:
    source = load_local_dir(write_tiny_model(ARCH, tmp_path / "tied", tie_word_embeddings=True))
    model = build_model(source)
    assert "lm_head" not in model.module  # type: ignore[attr-defined]
    embed = np.array(model.module.model.embed_tokens.weight)  # type: ignore[attr-defined]
    hidden = np.array(model.hidden(IDS, model.make_caches()))
    assert np.allclose(logits(model), hidden @ embed.T, atol=1e-5)

    untied = load_local_dir(write_tiny_model(ARCH, tmp_path / "untied"))
    del untied.weights["lm_head.weight"]
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight is missing"):
        build_model(untied)


def _stacked(weights: dict[str, mx.array], fused: bool) -> dict[str, mx.array]:
    """The per-expert checkpoint as the Go runner imports it ([E, out, in] per projection)
    or as transformers holds it in memory (fused gate_up_proj, down_proj)."""
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for layer in (2, 3):
        p = f"model.layers.{layer}.mlp.experts"

        def stack(proj: str, p: str = p) -> mx.array:
            return mx.stack([weights[f"{p}.{e}.{proj}.weight"] for e in range(4)])

        if fused:
            out[f"{p}.gate_up_proj"] = mx.concatenate([stack("gate_proj"), stack("up_proj")], 1)
            out[f"{p}.down_proj"] = stack("down_proj")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}.{proj}.weight"] = stack(proj)
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_stacked_experts_load_as_per_expert_ones(
    tmp_path: Path, reference: Model, fused: bool
) -> None:
    source = load_local_dir(write_tiny_model(ARCH, tmp_path))
    source.weights = _stacked(dict(source.weights), fused)
    assert np.array_equal(logits(build_model(source)), logits(reference))


@pytest.mark.parametrize("quant_type", [None, "int8", "int4", "mxfp4", "mxfp8", "nvfp4"])
def test_from_an_ollama_store_as_from_the_directory(
    tmp_path: Path, reference: Model, quant_type: str | None
) -> None:
    """The Go importer's layout (experts pre-stacked, linear weights and experts quantized,
    routers dense) loads from a store and computes what the directory does when dense, and
    when quantized exactly what MLX's dequantization of the same tensors computes (the
    latent kv_b_proj and the experts included), with candidates equal to the full
    unembedding."""
    hf_dir = write_tiny_model(ARCH, tmp_path / "hf")
    weights = _stacked(mx.load(str(hf_dir / "model.safetensors")), fused=False)  # type: ignore[arg-type]
    mx.save_safetensors(str(hf_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    routers = {f"model.layers.{i}.mlp.gate.weight": None for i in (2, 3)}
    quantize = {"type": quant_type, "types": routers} if quant_type else None
    write_ollama_model(tmp_path / "store", "tiny-glm", hf_dir, quantize=quantize)
    source = load_store_model("tiny-glm", tmp_path / "store")
    model = build_model(source)
    got, want = logits(model), logits(reference)
    if quant_type is None:
        assert np.array_equal(got, want)
        return
    layers = model.module.model.layers  # type: ignore[attr-defined]
    q_b = layers[0].self_attn.q_b_proj
    assert isinstance(q_b, nn.QuantizedLinear) and q_b.bits == int(quant_type[-1])
    assert isinstance(layers[2].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert np.abs(got - logits(build_model(dequantized(source)))).max() <= 1e-4
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.9
    hidden = model.hidden(IDS, model.make_caches())[:, -1]
    ids = mx.array([3, 7, 11, 200], dtype=mx.int32)
    picked = np.array(model.unembed_candidates(hidden, ids))  # type: ignore[attr-defined]
    assert np.abs(picked - got[:, -1][:, [3, 7, 11, 200]]).max() <= 1e-4
