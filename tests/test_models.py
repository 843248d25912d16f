"""The model registry and the family adapters, on the tiny models (no reference needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from runner.backend import Backend
from runner.models import Model, build_model, registered_architectures
from runner.models.glm4_moe_lite import LatentKVCache
from runner.models.registry import register
from runner.sources.loader import load_local_dir
from runner.sources.source import ModelLoadError, ModelSource
from tests.tiny import TINY_ARCHITECTURES, load_tiny_model, text_part, tiny_config, write_tiny_model

CACHE_KINDS = {
    "LlamaForCausalLM": [KVCache] * 2,
    "Qwen3ForCausalLM": [KVCache] * 2,
    "Gemma3ForCausalLM": [RotatingKVCache, KVCache, RotatingKVCache, RotatingKVCache],
    "Qwen3_5ForCausalLM": [ArraysCache, KVCache, ArraysCache, ArraysCache],
    "Glm4MoeLiteForCausalLM": [LatentKVCache] * 4,
    "Cohere2MoeForCausalLM": [KVCache, RotatingKVCache, RotatingKVCache, KVCache],
    "Qwen3MoeForCausalLM": [KVCache] * 3,
    "Qwen3_5MoeForCausalLM": [ArraysCache, KVCache, ArraysCache],
    "GptOssForCausalLM": [RotatingKVCache, KVCache],
    "MistralForCausalLM": [RotatingKVCache] * 2,
    "Ministral3ForCausalLM": [KVCache] * 2,
    # layers 3 and 4 share the KV of layers 2 and 1: no caches of their own
    "Gemma4ForCausalLM": [RotatingKVCache, KVCache, RotatingKVCache],
    "Gemma4ForConditionalGeneration": [RotatingKVCache, RotatingKVCache, KVCache],
    # Mamba2, attention, Mamba2: the MoE and MLP layers keep no state and have no cache
    "NemotronHForCausalLM": [ArraysCache, KVCache, ArraysCache],
    "LagunaForCausalLM": [RotatingKVCache, KVCache, RotatingKVCache],
    "MuseGlimmerForConditionalGeneration": [KVCache] + [RotatingKVCache] * 3 + [KVCache],
    "Gemma4UnifiedForCausalLM": [RotatingKVCache, KVCache],
    "Qwen2ForCausalLM": [KVCache, RotatingKVCache, RotatingKVCache],
    "Gemma2ForCausalLM": [RotatingKVCache, KVCache, RotatingKVCache, RotatingKVCache],
    "Phi3ForCausalLM": [RotatingKVCache] * 2,
}


# Context lengths other than max_position_embeddings: the tiny Phi3's longrope rotates by its
# short factors, which transformers uses up to original_max_position_embeddings only.
SHORTER_CONTEXT = {"Phi3ForCausalLM": 4096}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: load_tiny_model(arch, root / arch) for arch in TINY_ARCHITECTURES}


def source(path: Path, **config_edits: Any) -> ModelSource:
    s = load_local_dir(path)
    s.config.update(config_edits)
    return s


# --- registry -----------------------------------------------------------------------------


def test_registry_refuses_duplicate_names() -> None:
    before = registered_architectures()
    with pytest.raises(ValueError, match="already registered"):
        register("NewForCausalLM", "LlamaForCausalLM")(object)  # type: ignore[arg-type]
    assert registered_architectures() == before  # nothing half-registered


def test_every_registered_architecture_has_a_tiny_model() -> None:
    registered = set(registered_architectures())
    causal = {name for name in registered if name.endswith("ForCausalLM")}
    assert causal <= set(TINY_ARCHITECTURES) <= registered


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_model_type_is_the_fallback_key(tmp_path: Path, arch: str) -> None:
    s = source(write_tiny_model(arch, tmp_path))
    del s.config["architectures"]
    model = build_model(s)
    assert model.architecture == tiny_config(arch)["model_type"]


# --- facts and caches -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_facts(models: dict[str, Model], arch: str) -> None:
    model = models[arch]
    assert model.vocab_size == 384
    context = text_part(tiny_config(arch))["max_position_embeddings"]
    assert model.context_length == SHORTER_CONTEXT.get(arch, context)
    assert model.architecture == arch


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_cache_kind_per_layer(models: dict[str, Model], arch: str) -> None:
    caches = models[arch].make_caches()
    assert [type(c) for c in caches] == CACHE_KINDS[arch]
    for c in caches:
        if isinstance(c, RotatingKVCache):
            assert c.max_size == text_part(tiny_config(arch))["sliding_window"]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("chunk", [1, 3, 8, 13])
def test_chunked_hidden_equals_one_shot(models: dict[str, Model], arch: str, chunk: int) -> None:
    """Hidden states at every position, with chunks smaller than, equal to and larger than
    Gemma3's window of 8."""
    model = models[arch]
    ids = mx.array(np.random.default_rng(7).integers(0, 384, (1, 30)), dtype=mx.int32)
    one_shot = model.hidden(ids, model.make_caches())
    caches = model.make_caches()
    parts = [model.hidden(ids[:, s : s + chunk], caches) for s in range(0, 30, chunk)]
    # float32 rounding only: an optimised BLAS (OpenBLAS) blocks a 1-row and a 30-row matmul
    # differently, which moves hidden values of magnitude ~2 by up to ~3e-5.
    assert np.abs(np.array(mx.concatenate(parts, axis=1)) - np.array(one_shot)).max() < 1e-4


# --- loading ----------------------------------------------------------------------------------


def test_missing_unexpected_and_misshaped_weights_are_named(tmp_path: Path) -> None:
    s = source(write_tiny_model("LlamaForCausalLM", tmp_path))
    del s.weights["model.norm.weight"]
    s.weights["model.extra.weight"] = mx.zeros((2,))
    s.weights["lm_head.weight"] = mx.zeros((384, 32))
    with pytest.raises(ModelLoadError) as e:
        build_model(s)
    message = str(e.value)
    assert message.startswith("weights do not match LlamaForCausalLM: ")
    assert "missing model.norm.weight" in message
    assert "unexpected model.extra.weight" in message
    assert "lm_head.weight has shape (384, 32), expected (384, 64)" in message


@pytest.mark.parametrize("dtype", [mx.int32, mx.uint8, mx.int8, mx.bool_, mx.complex64])
def test_weights_of_a_non_floating_dtype_are_refused(tmp_path: Path, dtype: mx.Dtype) -> None:
    """Before: integer and boolean weights loaded and computed garbage, complex ones failed at
    the first request."""
    s = source(write_tiny_model("LlamaForCausalLM", tmp_path))
    name = "model.layers.0.self_attn.q_proj.weight"
    s.weights[name] = (s.weights[name] * 100).astype(dtype)
    want = f"weights do not match LlamaForCausalLM: {name} has dtype {str(dtype)[9:]}, expected"
    with pytest.raises(ModelLoadError, match=f"^{want} float32$"):
        build_model(s)


def test_packed_quantized_weights_must_keep_their_dtype(tmp_path: Path) -> None:
    s = source(write_tiny_model("LlamaForCausalLM", tmp_path))
    name = "model.layers.0.mlp.up_proj"
    packed, scales, biases = mx.quantize(s.weights[f"{name}.weight"], 64, 4)
    s.weights |= {f"{name}.weight": packed, f"{name}.scales": scales, f"{name}.biases": biases}
    s.quantization = {"group_size": 64, "bits": 4, "mode": "affine"}
    build_model(s)  # as written
    s.weights[f"{name}.weight"] = packed.astype(mx.float32)
    with pytest.raises(ModelLoadError, match=f"{name}.weight has dtype float32, expected uint32"):
        build_model(s)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_dtype_casts_floating_weights(tmp_path: Path, models: dict, arch: str) -> None:
    backend = Backend.for_device().replace(compute_dtype=mx.bfloat16)
    model = build_model(source(write_tiny_model(arch, tmp_path)), backend)
    for path, value in tree_flatten(model.module.parameters()):
        kept = getattr(model.module, "cast_predicate", None)  # mlx-lm's: A_log, router bias
        expected = mx.float32 if kept is not None and not kept(path) else mx.bfloat16
        assert value.dtype == expected, path
    ids = mx.array([[5, 6, 7, 8, 9, 10]], dtype=mx.int32)
    low = np.array(model.unembed(model.hidden(ids, model.make_caches())).astype(mx.float32))
    ref = models[arch]
    high = np.array(ref.unembed(ref.hidden(ids, ref.make_caches())))
    assert np.corrcoef(low.ravel(), high.ravel())[0, 1] > 0.99  # loose: bfloat16 rounding


# --- config reading ---------------------------------------------------------------------------


def test_llama_without_tie_word_embeddings_is_untied(tmp_path: Path) -> None:
    """transformers' LlamaConfig defaults to untied; mlx-lm's llama to tied."""
    s = source(write_tiny_model("LlamaForCausalLM", tmp_path, tie_word_embeddings=False))
    del s.config["tie_word_embeddings"]
    assert "lm_head" in build_model(s).module


def test_gemma3_absent_keys_take_transformers_defaults() -> None:
    from runner.models.gemma3 import Gemma3

    module = Gemma3.build_module({"model_type": "gemma3_text", "num_hidden_layers": 7})
    args = module.args
    assert (args.num_attention_heads, args.num_key_value_heads, args.hidden_size) == (8, 4, 2304)
    assert args.sliding_window == 4096 and args.vocab_size == 262208
    kinds = module.model.kinds  # sliding_window_pattern 6
    assert kinds == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]


def test_gemma3_embedding_scale_stays_in_float32(tmp_path: Path) -> None:
    """sqrt(48) = 6.9282 in float32; mlx-lm rounds it through bfloat16 to 6.9375."""
    config = tiny_config("Gemma3ForCausalLM") | {"hidden_size": 48}
    model = load_tiny_model("Gemma3ForCausalLM", tmp_path, config=config)
    seen = []

    class Probe(nn.Module):
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            seen.append(x)
            return x

    inner = model.module.model
    inner.layers, inner.kinds = [Probe()], ["full_attention"]
    ids = mx.array([[3, 4, 5]], dtype=mx.int32)
    model.hidden(ids, [KVCache()])
    expected = np.array(inner.embed_tokens(ids)) * np.float32(math.sqrt(48))
    assert np.array_equal(np.array(seen[0]), expected)


def test_gemma3_ties_by_config_not_by_weights(tmp_path: Path, models: dict) -> None:
    s = source(write_tiny_model("Gemma3ForCausalLM", tmp_path))
    s.weights["lm_head.weight"] = mx.zeros((384, 64))  # transformers would tie over this
    model = build_model(s)
    ids = mx.array([[1, 2, 3]], dtype=mx.int32)
    ref = models["Gemma3ForCausalLM"]
    got = model.unembed(model.hidden(ids, model.make_caches()))
    want = ref.unembed(ref.hidden(ids, ref.make_caches()))
    assert np.array_equal(np.array(got), np.array(want))

    s = source(write_tiny_model("Gemma3ForCausalLM", tmp_path), tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight is missing"):
        build_model(s)


def test_qwen2_biases_run_through_the_native_step(tmp_path: Path) -> None:
    """Without windows Qwen2's forwards take the native step (runner/backend/native_step.py),
    q/k/v biases included, and equal MLX's path."""
    from runner.native import preload

    if not preload.dispatch_active():
        pytest.skip("needs the runner's dispatch library preloaded")
    config = tiny_config("Qwen2ForCausalLM") | {"use_sliding_window": False, "layer_types": None}
    native = load_tiny_model("Qwen2ForCausalLM", tmp_path / "a", config=config)
    plain = load_tiny_model(
        "Qwen2ForCausalLM",
        tmp_path / "b",
        config=config,
        backend=Backend.cpu().replace(native_step_max_tokens=None),
    )
    assert native._native is not None
    ids = mx.array([[5, 9, 100, 7, 300, 11, 12]], dtype=mx.int32)
    caches = native.make_caches()
    assert native._native(ids, caches) is not None  # taken, not declined
    got = native.unembed(native.hidden(ids, native.make_caches()))
    want = plain.unembed(plain.hidden(ids, plain.make_caches()))
    assert np.abs(np.array(got) - np.array(want)).max() <= 1e-5


def test_phi3_context_ends_where_its_short_longrope_factors_do() -> None:
    """transformers rotates by longrope's short factors up to original_max_position_embeddings
    and by the long ones at every position of a longer sequence, which no cache can follow:
    the context ends there unless the two are the same. A window that spans the context
    hides nothing: full attention, a plain KV cache."""
    from runner.models.phi3 import Phi3

    config = tiny_config("Phi3ForCausalLM")
    rope = config["rope_parameters"]
    assert Phi3.build_module(config).context == 4096
    same = rope | {"short_factor": rope["long_factor"]}
    assert Phi3.build_module(config | {"rope_parameters": same}).context == 131072
    plain = {"rope_type": "default", "partial_rotary_factor": 0.75}
    assert Phi3.build_module(config | {"rope_parameters": plain}).context == 131072
    spanning = Phi3.build_module(config | {"sliding_window": 4096})
    assert [type(c) for c in spanning.make_cache()] == [KVCache] * 2
    shorter = Phi3.build_module(config | {"sliding_window": 4095})
    assert [type(c) for c in shorter.make_cache()] == [RotatingKVCache] * 2


def test_tied_heads_ignore_a_checkpoint_head(tmp_path: Path, models: dict) -> None:
    """transformers ties Gemma2's and Phi3's heads by config, over any lm_head.weight."""
    ids = mx.array([[1, 2, 3]], dtype=mx.int32)
    for arch in ("Gemma2ForCausalLM", "Phi3ForCausalLM"):
        path = write_tiny_model(arch, tmp_path / arch, tie_word_embeddings=True)
        tied = build_model(source(path))
        s = source(path)
        s.weights["lm_head.weight"] = mx.zeros((384, 64))
        model = build_model(s)
        assert "lm_head" not in model.module
        got = model.unembed(model.hidden(ids, model.make_caches()))
        want = tied.unembed(tied.hidden(ids, tied.make_caches()))
        assert np.array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize(
    ("arch", "edits", "field"),
    [
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_type",
        ),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.2}},
            "attention_factor",
        ),
        ("Qwen3ForCausalLM", {"rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary"),
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("Gemma3ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("Qwen3_5ForCausalLM", {"rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
        ("Glm4MoeLiteForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Cohere2MoeForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Cohere2MoeForCausalLM", {"expert_selection_fn": "relu"}, "expert_selection_fn"),
        (
            "Cohere2MoeForCausalLM",
            {"shared_expert_combination_strategy": "max"},
            "shared_expert_combination_strategy",
        ),
        (
            "Glm4MoeLiteForCausalLM",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
            "mscale_all_dim",
        ),
        ("Qwen3MoeForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        (
            "GptOssForCausalLM",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_type",
        ),
        ("MistralForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Qwen2ForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("Gemma2ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional"),
        ("Phi3ForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        (  # mlx-lm's phi3 scales linearly; transformers' Phi3 refuses it
            "Phi3ForCausalLM",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "rope_type",
        ),
        (
            "Qwen2ForCausalLM",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_type",
        ),
        (  # transformers: mscale over a default mscale_all_dim; mlx-lm: mscale over 1
            "Ministral3ForCausalLM",
            {
                "rope_parameters": tiny_config("Ministral3ForCausalLM")["rope_parameters"]
                | {"mscale": 0}
            },
            "mscale_all_dim is not supported for yarn RoPE without",
        ),
    ],
)
def test_unsupported_config_values_are_refused_by_name(
    tmp_path: Path, arch: str, edits: dict[str, Any], field: str
) -> None:
    with pytest.raises(ModelLoadError, match=field):
        build_model(source(write_tiny_model(arch, tmp_path), **edits))


@pytest.mark.reference
@pytest.mark.parametrize(
    ("family", "table", "config_class"),
    [
        ("llama", "LLAMA_DEFAULTS", "LlamaConfig"),
        ("qwen3", "QWEN3_DEFAULTS", "Qwen3Config"),
        ("gemma3", "GEMMA3_DEFAULTS", "Gemma3TextConfig"),
        ("qwen3_5", "QWEN3_5_DEFAULTS", "Qwen3_5TextConfig"),
        ("glm4_moe_lite", "GLM4_MOE_LITE_DEFAULTS", "Glm4MoeLiteConfig"),
        ("cohere2_moe", "COHERE2_MOE_DEFAULTS", "Cohere2MoeConfig"),
        ("qwen3_moe", "QWEN3_MOE_DEFAULTS", "Qwen3MoeConfig"),
        ("qwen3_5_moe", "QWEN3_5_MOE_DEFAULTS", "Qwen3_5MoeTextConfig"),
        ("gpt_oss", "GPT_OSS_DEFAULTS", "GptOssConfig"),
        ("mistral", "MISTRAL_DEFAULTS", "MistralConfig"),
        ("mistral", "MINISTRAL3_DEFAULTS", "Ministral3Config"),
        ("qwen2", "QWEN2_DEFAULTS", "Qwen2Config"),
        ("gemma2", "GEMMA2_DEFAULTS", "Gemma2Config"),
        ("phi3", "PHI3_DEFAULTS", "Phi3Config"),
    ],
)
def test_default_tables_are_transformers_defaults(
    family: str, table: str, config_class: str
) -> None:
    """The defaults each adapter fills in for absent keys are transformers' class defaults."""
    import importlib

    transformers = pytest.importorskip("transformers")
    defaults = getattr(importlib.import_module(f"runner.models.{family}"), table)
    config = getattr(transformers, config_class)()
    for key, value in defaults.items():
        assert getattr(config, key) == value, key
