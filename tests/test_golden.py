"""Logits of our models vs Hugging Face transformers on the same tiny random weights.

Default tier: the stored goldens (tests/data/golden/<arch>.npz, written by
tests/golden/make_goldens.py) against `hidden` over the whole sequence, `hidden` in chunks of
7 through the same caches, `unembed`, and `unembed_candidates`; max abs difference <= 1e-4 in
float32. `-m reference` recomputes the goldens live with transformers (skipped without torch)
and also checks config variants the stored goldens do not cover. Also here: unknown
architectures, and quantized tiny models (affine 4 and 8 bit, group 32 and 64).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runner.backend import Backend
from runner.models import Model, build_model
from runner.sources.loader import load_local_dir
from runner.sources.source import ModelLoadError, ModelSource
from tests.golden.make_goldens import (
    golden_sequences,
    reference_logits,
    transformers_config,
    weight_manifest,
)
from tests.golden_logits import (
    CANDIDATES,
    TOLERANCE,
    assert_matches,
    stored_golden,
)
from tests.tiny import (
    HAND_WRITTEN,
    TINY_ARCHITECTURES,
    load_tiny_model,
    manifest_specs,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: load_tiny_model(arch, root / arch) for arch in TINY_ARCHITECTURES}


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_logits_match_stored_goldens(tiny_models: dict[str, Model], arch: str) -> None:
    """One-shot, chunked and candidate logits equal transformers' within 1e-4 (float32)."""
    for tokens, expected in stored_golden(arch):
        assert_matches(tiny_models[arch], tokens, expected)


# Families none of whose blocks the CPU kernels take: GPT-OSS's attention has sinks (mlx-lm's
# call computes them, runner/backend/attention.py) and its experts a clamped SwiGLU.
MLX_ONLY = ("GptOssForCausalLM",)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_goldens_hold_with_every_block_through_numpy(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny blocks normally stay in MLX; forced through numpy's activations and softmax and
    the blocked causal attention (as prefill of a real model is on the CPU) the logits still
    equal transformers'."""
    from runner.backend import host

    crossed = []
    for name in ("swiglu_host", "gelu_glu_host", "softmax_numerators_inplace"):
        kernel = getattr(host, name)
        monkeypatch.setattr(host, name, lambda *a, k=kernel: crossed.append(k) or k(*a))
    everything = Backend.cpu().replace(  # MLX's path: the native step would bypass numpy
        host_activation_min_elements=0,
        host_softmax_min_elements=0,
        blocked_causal_min_queries=1,
        native_step_max_tokens=None,
    )
    model = load_tiny_model(arch, tmp_path / arch, backend=everything)
    for tokens, expected in stored_golden(arch):
        assert_matches(model, tokens, expected)
    if arch in MLX_ONLY:
        assert not crossed
    else:
        assert crossed


def test_unknown_architecture_is_refused() -> None:
    source = ModelSource(name="x", config={"architectures": ["FooForCausalLM"]}, tokenizer_json="")
    with pytest.raises(ModelLoadError, match=r"^unsupported architecture: FooForCausalLM$"):
        build_model(source)


def test_config_without_architecture_is_refused() -> None:
    source = ModelSource(name="x", config={"hidden_size": 64}, tokenizer_json="")
    with pytest.raises(ModelLoadError, match=r"^no architectures found in config.json$"):
        build_model(source)


# --- quantized ------------------------------------------------------------------------


def quantized_sources(
    path: Path, group_size: int, bits: int, head: tuple[int, int] | None
) -> tuple[ModelSource, ModelSource]:
    """The tiny model in `path` with every 2-D weight quantized (affine; `head` = (group,
    bits) for the output rows, declared as a per-layer entry), and the same model dense with
    the dequantized weights."""
    quantized, dense = load_local_dir(path), load_local_dir(path)
    quantization: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    head_path = "lm_head" if "lm_head.weight" in dense.weights else "model.embed_tokens"
    weights = {}
    for name, w in dense.weights.items():
        # MoE routers stay dense: importers keep them so, and mlx-lm's are not quantizable
        if w.ndim != 2 or not name.endswith(".weight") or name.endswith(".mlp.gate.weight"):
            weights[name] = w
            continue
        p = name.removesuffix(".weight")
        g, b = head if head is not None and p == head_path else (group_size, bits)
        # as mlx-lm's quantization: rows too short for a group stay dense
        if w.ndim != 2 or not name.endswith(".weight") or w.shape[-1] % g:
            weights[name] = w
            continue
        if (g, b) != (group_size, bits):
            quantization[p] = {"group_size": g, "bits": b, "mode": "affine"}
        packed, scales, biases = mx.quantize(w, g, b)
        weights |= {name: packed, f"{p}.scales": scales, f"{p}.biases": biases}
        dense.weights[name] = mx.dequantize(packed, scales, biases, g, b)
    quantized.weights, quantized.quantization = weights, quantization
    return quantized, dense


QUANTIZED = [(64, 4, None), (32, 8, None), (64, 4, (32, 8))]


def last_logits(model: Model, ids: mx.array) -> np.ndarray:
    return np.array(model.unembed(model.hidden(ids, model.make_caches())[0]).astype(mx.float32))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize(("group_size", "bits", "head"), QUANTIZED)
def test_quantized_model(
    tmp_path: Path,
    tiny_models: dict[str, Model],
    arch: str,
    group_size: int,
    bits: int,
    head: tuple[int, int] | None,
) -> None:
    """A quantized tiny model builds with quantized layers; its candidate logits are its own
    full logits gathered (1e-3); it computes what the dense model with the dequantized
    weights computes (1e-4); and, as a loose sanity check only, its logits still correlate
    with the float model's (> 0.5 at 4 bits, > 0.95 at 8: the tiny Qwen3.5 is sensitive)."""
    quantized, dense = quantized_sources(write_tiny_model(arch, tmp_path), group_size, bits, head)
    model = build_model(quantized)
    out = model.module.get("lm_head") or model.module.model.embed_tokens
    assert isinstance(out, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    layers = [m for _, m in model.module.named_modules() if m is not out]
    assert any(isinstance(m, nn.QuantizedLinear) for m in layers)  # not only the head
    tokens, _ = stored_golden(arch)[1]
    ids = mx.array(tokens, dtype=mx.int32)[None]
    h = model.hidden(ids, model.make_caches())[0]
    full = np.array(model.unembed(h).astype(mx.float32))
    every = np.array(model.unembed_candidates(h, mx.arange(model.vocab_size, dtype=mx.int32)))
    assert np.abs(every - full).max() <= 1e-3
    picked = np.array(model.unembed_candidates(h, mx.array(CANDIDATES, dtype=mx.int32)))
    assert np.abs(picked - full[:, CANDIDATES]).max() <= 1e-3

    assert np.abs(full - last_logits(build_model(dense), ids)).max() <= TOLERANCE
    ref = last_logits(tiny_models[arch], ids)
    assert np.corrcoef(full.ravel(), ref.ravel())[0, 1] > (0.5 if bits == 4 else 0.95)


# --- reference tier: live transformers ----------------------------------------------------

# (arch, config-class overrides, then edits to the written config.json: value, or None to
# delete the key), each covering a reading the stored goldens do not.
VARIANTS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("LlamaForCausalLM", {"tie_word_embeddings": True}, {}),
    ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, {}),
    (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        {},
    ),
    (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        {},
    ),
    (  # a transformers 4 config: legacy rope keys and no tie_word_embeddings (mlx-lm: true)
        "LlamaForCausalLM",
        {},
        {
            "rope_parameters": None,
            "tie_word_embeddings": None,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    (
        "Qwen3ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
            "attention_bias": True,
            "tie_word_embeddings": False,
        },
        {},
    ),
    ("Gemma3ForCausalLM", {"tie_word_embeddings": False, "attention_bias": True}, {}),
    # sqrt(48) is not a bfloat16 number: mlx-lm's rounded embedding scale would show
    ("Gemma3ForCausalLM", {"hidden_size": 48}, {}),
    (  # no layer_types: the kinds come from sliding_window_pattern
        "Gemma3ForCausalLM",
        {"sliding_window_pattern": 2, "final_logit_softcapping": None},
        {"layer_types": None},
    ),
    (  # no layer_types: the kinds come from full_attention_interval
        "Qwen3_5ForCausalLM",
        {"tie_word_embeddings": True},
        {"layer_types": None, "full_attention_interval": 2},
    ),
    (  # every layer windowed, attention biases, tied, top-k weights not renormalised
        "Qwen3MoeForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "attention_bias": True,
            "tie_word_embeddings": True,
            "norm_topk_prob": False,
        },
        {},
    ),
    (  # MoE on every other layer; linear RoPE scaling; a transformers 4 expert count
        "Qwen3MoeForCausalLM",
        {
            "decoder_sparse_step": 2,
            "mlp_only_layers": [],
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        },
        {"num_local_experts": None, "num_experts": 4},
    ),
    (  # tied; no layer_types: the kinds come from full_attention_interval; top-3 of 4
        "Qwen3_5MoeForCausalLM",
        {"tie_word_embeddings": True, "num_experts_per_tok": 3},
        {"layer_types": None, "full_attention_interval": 3},
    ),
    (  # no attention biases, tied, no sliding layer; no rope_parameters: transformers' yarn
        "GptOssForCausalLM",
        {
            "attention_bias": False,
            "tie_word_embeddings": True,
            "layer_types": ["full_attention", "full_attention"],
        },
        {"rope_parameters": None},
    ),
    (  # sliding layers last; yarn truncated; top-1 routing
        "GptOssForCausalLM",
        {
            "layer_types": ["full_attention", "sliding_attention"],
            "num_experts_per_tok": 1,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
            },
        },
        {},
    ),
    (  # no window, tied, head_dim derived; attention_bias, which Mistral ignores
        "MistralForCausalLM",
        {"sliding_window": None, "tie_word_embeddings": True},
        {"attention_bias": True, "head_dim": None},
    ),
    (  # every layer windowed; plain RoPE with the position-dependent query scale
        "Ministral3ForCausalLM",
        {
            "sliding_window": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "llama_4_scaling_beta": 0.3,
                "original_max_position_embeddings": 8,
            },
        },
        {},
    ),
    (  # no rope_parameters: transformers' yarn with both mscales
        "Ministral3ForCausalLM",
        {"tie_word_embeddings": True},
        {"rope_parameters": None},
    ),
    (  # partial_rotary_factor absent: transformers' default 0.25
        "Qwen3_5ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        {},
    ),
    # mlx-lm always interleaves the rotated pairs and always has its own head
    ("Glm4MoeLiteForCausalLM", {"rope_interleave": False, "tie_word_embeddings": True}, {}),
    # one expert: transformers normalises its weight to 1 (mlx-lm only from two); every
    # group open
    ("Glm4MoeLiteForCausalLM", {"num_experts_per_tok": 1, "n_group": 1}, {}),
    # a large rms_norm_eps shows which eps the latent norms use (transformers: 1e-6)
    ("Glm4MoeLiteForCausalLM", {"rms_norm_eps": 0.5}, {}),
    # RMSNorm instead of LayerNorm; sigmoid routing, unnormalised; shared experts summed;
    # an untied head
    (
        "Cohere2MoeForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "expert_selection_fn": "sigmoid",
            "norm_topk_prob": False,
            "shared_expert_combination_strategy": "sum",
            "tie_word_embeddings": False,
        },
        {},
    ),
    # no forced RoPE on the dense full layer; sigmoid routing normalised
    (
        "Cohere2MoeForCausalLM",
        {"prefix_dense_sliding_window_pattern": 2, "expert_selection_fn": "sigmoid"},
        {},
    ),
    (  # no layer_types (sliding_window_pattern decides), no tie_word_embeddings (tied)
        "Cohere2MoeForCausalLM",
        {"sliding_window_pattern": 2},
        {"layer_types": None, "tie_word_embeddings": None},
    ),
    (
        "Glm4MoeLiteForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        {},
    ),
    # (variants of manifest-built tiny models keep the manifest's weights)
    ("NemotronHForCausalLM", {"tie_word_embeddings": True}, {}),
    # attention_bias and mamba_proj_bias, which transformers' layers ignore
    ("NemotronHForCausalLM", {"attention_bias": True, "mamba_proj_bias": True}, {}),
    (  # the legacy pattern string; the time step clamped at both ends, legacy spelling
        "NemotronHForCausalLM",
        {},
        {
            "layers_block_type": None,
            "hybrid_override_pattern": "ME*-M",
            "time_step_limit": None,
            "mamba_dt_limit": [0.3, 0.5],
        },
    ),
    (  # legacy block names
        "NemotronHForCausalLM",
        {},
        {"layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba"]},
    ),
    (  # Laguna: yarn over half of each global head
        "LagunaForCausalLM",
        {
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "partial_rotary_factor": 0.5,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            }
        },
        {},
    ),
    # transformers' default RoPE per kind; "per-head" spelled out
    ("LagunaForCausalLM", {"gating": "per-head"}, {"rope_parameters": None}),
    (  # Glimmer: layer kinds that do not follow layer_rope_theta's NoPE layers; linear RoPE
        "MuseGlimmerForConditionalGeneration",
        {
            "layer_types": ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"],
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "qk_scale_factor": 2.0,
        },
        {},
    ),
    (  # Gemma4's default RoPE (proportional, a quarter of the global head) and no soft-cap
        "Gemma4ForCausalLM",
        {"rope_parameters": None, "final_logit_softcapping": None},
        {},
    ),
    (  # Qwen2: no window (the native step runs it), untied
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        {},
    ),
    (  # a transformers 4 config as Qwen2.5 ships it: legacy rope keys, no layer_types, a
        # window that use_sliding_window turns off, no tie_word_embeddings (untied)
        "Qwen2ForCausalLM",
        {"tie_word_embeddings": False},
        {
            "rope_parameters": None,
            "rope_theta": 1000000.0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            "layer_types": None,
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 1,
            "tie_word_embeddings": None,
        },
    ),
    # windows from max_window_layers on (no layer_types)
    ("Qwen2ForCausalLM", {"max_window_layers": 2}, {"layer_types": None}),
    # layer_types that no max_window_layers gives
    (
        "Qwen2ForCausalLM",
        {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        {},
    ),
    # Gemma2: no soft-caps (the runner's attention call), untied, attention biases
    (
        "Gemma2ForCausalLM",
        {
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "tie_word_embeddings": False,
            "attention_bias": True,
        },
        {},
    ),
    (  # no layer_types (transformers alternates, sliding first); legacy linear RoPE
        "Gemma2ForCausalLM",
        {},
        {
            "layer_types": None,
            "rope_parameters": None,
            "rope_theta": 100000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
    ),
    # Phi3 as Phi-3 mini 4k and Phi-4 mini have it: plain RoPE over the whole head (no
    # windows), a tied head
    (
        "Phi3ForCausalLM",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": None,
            "tie_word_embeddings": True,
        },
        {},
    ),
    (  # equal factors: sequences past original_max_position_embeddings (16) are served
        "Phi3ForCausalLM",
        {
            "original_max_position_embeddings": 16,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            },
        },
        {},
    ),
    (  # a transformers 4 config: "su" under rope_scaling, the top-level theta and fraction
        "Phi3ForCausalLM",
        {},
        {
            "rope_parameters": None,
            "rope_theta": 500000.0,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {
                "type": "su",
                "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            },
        },
    ),
    (  # the "yarn" spelling, with the factor that sets the attention factor
        "Phi3ForCausalLM",
        {},
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "factor": 8.0,
                "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            }
        },
    ),
    (  # an explicit attention factor
        "Phi3ForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "attention_factor": 1.5,
                "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            }
        },
        {},
    ),
]


@pytest.mark.reference
@pytest.mark.usefixtures("reference_libraries")
class TestReference:
    @pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
    def test_live_transformers_matches(self, tmp_path: Path, arch: str) -> None:
        """Goldens recomputed now agree with ours and with the stored ones."""
        model = load_tiny_model(arch, tmp_path)
        sequences = golden_sequences()
        live = reference_logits(tmp_path, sequences)
        for tokens, expected, (stored_tokens, stored) in zip(
            sequences, live, stored_golden(arch), strict=True
        ):
            assert np.array_equal(tokens, stored_tokens)
            assert np.abs(expected - stored).max() <= TOLERANCE, "transformers drifted"
            assert_matches(model, tokens, expected)

    @pytest.mark.parametrize(("arch", "overrides", "edits"), VARIANTS)
    def test_config_variant_matches(
        self, tmp_path: Path, arch: str, overrides: dict[str, Any], edits: dict[str, Any]
    ) -> None:
        config = transformers_config(arch, **overrides)
        for key, value in edits.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        specs = None  # the first four families' weights follow from the config
        if config["model_type"] not in HAND_WRITTEN:  # the variant's own checkpoint layout
            specs = manifest_specs(weight_manifest(arch, config))
        model = load_tiny_model(arch, tmp_path, config=config, specs=specs)
        sequences = golden_sequences()
        for tokens, expected in zip(sequences, reference_logits(tmp_path, sequences), strict=True):
            assert_matches(model, tokens, expected)
