"""Regenerate the tiny-model configs and golden logits with Hugging Face transformers.

    python tests/golden/make_goldens.py            # goldens: tests/data/golden/<arch>.npz
    python tests/golden/make_goldens.py --configs  # also configs: tests/data/configs/<arch>.json
                                                   # and weight manifests (<arch>.weights.json)
    python tests/golden/make_goldens.py --only A   # one architecture

Configs are written by transformers' own config classes (`save_pretrained`), so they have the
shape transformers 5 writes. Goldens are the last-position logits of the transformers model
(CPU PyTorch, float32, eager attention) over fixed token sequences, on the weights of
tests/tiny.py. Needs torch and transformers; the everyday tests only read the files.
tests/test_golden.py imports `transformers_config` and `reference_logits` for its live tier.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py
from tiny import CONFIGS, GOLDEN, HAND_WRITTEN, TINY_ARCHITECTURES, manifest_path, write_tiny_model

SEQUENCE_LENGTHS = (5, 23, 40)  # 23 and 40 pass Gemma3's window of 8 several times
TOKENS = {"bos_token_id": 0, "eos_token_id": 2}  # <|endoftext|>, <|im_end|> in tiny.py
SHAPE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}

# (transformers config class, its arguments) per architecture. Each tiny model also reads
# something mlx-lm would read differently: llama3 RoPE under rope_parameters (Llama); tied
# embeddings with a 1e6 theta (Qwen3); layer_types that no sliding_window_pattern gives, a
# window of 8, per-kind RoPE with linear scaling on global layers, final soft-capping and
# query_pre_attn_scalar != head_dim (Gemma3); layer_types that no full_attention_interval
# gives and partial RoPE of half the head (Qwen3.5); mlp_layer_types that no
# first_k_dense_replace gives, grouped expert routing and latent norms (GLM-4 MoE Lite); a
# dense full-attention layer with forced RoPE beside a NoPE one, shared experts averaged with
# the routed ones and a logit scale (Cohere2-MoE, which mlx-lm lacks).
CONFIG_ARGS: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": (
        "LlamaConfig",
        {
            "num_hidden_layers": 2,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "Qwen3ForCausalLM": (
        "Qwen3Config",
        {
            "num_hidden_layers": 2,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 4,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 0.5,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "Qwen3_5ForCausalLM": (
        "Qwen3_5TextConfig",
        {
            "num_hidden_layers": 4,
            "layer_types": [
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
            ],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        },
    ),
    "Glm4MoeLiteForCausalLM": (
        "Glm4MoeLiteConfig",
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,  # MLA: transformers' keys have every head
            "mlp_layer_types": ["dense", "dense", "sparse", "sparse"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "moe_intermediate_size": 64,
            "kv_lora_rank": 64,
            "q_lora_rank": 64,
            "head_dim": 8,  # transformers' alias of qk_rope_head_dim: both, or SHAPE's wins
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "Cohere2MoeForCausalLM": (
        "Cohere2MoeConfig",
        {
            "num_hidden_layers": 4,
            # layer 0: full attention with forced RoPE (a dense layer of a pattern of 1);
            # layer 3: full attention without RoPE
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "sliding_window": 8,
            "intermediate_size": 64,
            "prefix_dense_intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_shared_experts": 1,
            "logit_scale": 0.25,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "Qwen3_5MoeForCausalLM": (
        "Qwen3_5MoeTextConfig",
        {
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        },
    ),
    "GptOssForCausalLM": (
        "GptOssConfig",
        {
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "swiglu_alpha": 1.2,
            "swiglu_limit": 0.05,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        },
    ),
    "MistralForCausalLM": (
        "MistralConfig",
        {
            "num_hidden_layers": 2,
            "sliding_window": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "Ministral3ForCausalLM": (
        "Ministral3Config",
        {
            "num_hidden_layers": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
        },
    ),
    # Gemma4: layer kinds S F S S F, the last two sharing the KV of layers 2 and 1, a wider
    # head and one K=V head on global layers (per_layer_config), per-layer inputs, double-wide
    # MLPs on the sharing layers, proportional partial RoPE, soft-capping.
    "Gemma4ForCausalLM": (
        "Gemma4TextConfig",
        {
            "num_hidden_layers": 5,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "sliding_window": 8,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 384,
            "global_head_dim": 32,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "use_double_wide_mlp": True,
            "final_logit_softcapping": 3.0,
            "max_position_embeddings": 4096,
        },
    ),
    # Gemma4 MoE, nested under text_config with a (tiny) vision tower whose weights the
    # runner drops: 4 experts, top-2, beside the dense MLP; the head tied at the top level.
    "Gemma4ForConditionalGeneration": (
        "Gemma4Config",
        {
            "text_config": {
                "num_hidden_layers": 3,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                "sliding_window": 8,
                "hidden_size_per_layer_input": 0,
                "global_head_dim": 32,
                "enable_moe_block": True,
                "num_experts": 4,
                "top_k_experts": 2,
                "moe_intermediate_size": 32,
                "final_logit_softcapping": 5.0,
                "max_position_embeddings": 4096,
            },
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "position_embedding_size": 64,
            },
            "audio_config": None,
        },
    ),
    # Gemma4 unified text model: its own defaults (no per-layer inputs), one sliding and one
    # global layer.
    "Gemma4UnifiedForCausalLM": (
        "Gemma4UnifiedTextConfig",
        {
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "global_head_dim": 32,
            "final_logit_softcapping": 3.0,
            "max_position_embeddings": 4096,
        },
    ),
    # Nemotron-H: Mamba2, MoE (4 experts, top-2, a shared expert), attention and MLP layers;
    # a time_step_min above most time steps, which transformers up to 5.24 (and the runner
    # then) clamped at, where the fixed reference clamps at time_step_limit only.
    "NemotronHForCausalLM": (
        "NemotronHConfig",
        {
            "time_step_min": 0.9,
            "layers_block_type": [
                "linear_attention",
                "moe",
                "full_attention",
                "mlp",
                "linear_attention",
            ],
            "mamba_num_heads": 8,
            "mamba_head_dim": 8,
            "n_groups": 2,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
        },
    ),
    # Laguna: sliding + global layers with 4 / 8 heads, partial RoPE on the global layer,
    # a dense MLP then MoE layers (4 experts, top-2, soft-capped router, scaled, shared).
    "LagunaForCausalLM": (
        "LagunaConfig",
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": 8,
            "num_attention_heads_per_layer": [4, 8, 4],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "moe_router_logit_softcapping": 2.0,
            "moe_routed_scaling_factor": 1.5,
            "max_position_embeddings": 4096,
        },
    ),
    # Glimmer: the text model under text_config, global NoPE layers counted back from the
    # last (transformers' default, not mlx-lm's), a small soft-cap, a tiny vision tower.
    "MuseGlimmerForConditionalGeneration": (
        "MuseGlimmerConfig",
        {
            "text_config": {
                "num_hidden_layers": 5,
                "sliding_window": 8,
                "final_logit_softcapping": 2.0,
                "max_position_embeddings": 4096,
            },
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "pos_emb_height": 4,
                "pos_emb_width": 4,
            },
            "out_hidden_size": 64,
            "projector_hidden_size": 32,
        },
    ),
    # Qwen2: windows of 8 from max_window_layers (1) on, which mlx-lm's qwen2 does not have;
    # rope_theta 1e4 under rope_parameters (mlx-lm: 1e6 when rope_theta is absent); q/k/v
    # biases; a tied head.
    "Qwen2ForCausalLM": (
        "Qwen2Config",
        {
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
            "tie_word_embeddings": True,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # Gemma2: layer_types that alternate otherwise than transformers' default, a window of 8
    # (mlx-lm's gemma2 has none), attention and final soft-caps that bite, and
    # query_pre_attn_scalar != head_dim (mlx-lm's default is 144).
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        {
            "num_hidden_layers": 4,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 0.5,
            "max_position_embeddings": 4096,
        },
    ),
    # Phi3 as Phi-3.5 mini has it: longrope with short factors other than the long ones
    # (transformers rotates by the short ones up to original_max_position_embeddings; mlx-lm
    # always by the long ones) and the attention factor of 131072 / 4096; a quarter of each
    # head left unrotated (partial_rotary_factor under rope_parameters); a window of 8 (which
    # mlx-lm's phi3 ignores).
    "Phi3ForCausalLM": (
        "Phi3Config",
        {
            "num_hidden_layers": 2,
            "pad_token_id": 0,  # Phi3's default, 32000, is past the tiny vocabulary
            "sliding_window": 8,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            },
        },
    ),
}


def transformers_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """config.json as transformers 5 writes it for the tiny `arch`, with `overrides` applied
    as constructor arguments (to `text_config` where the model nests its text model)."""
    import transformers

    class_name, args = CONFIG_ARGS[arch]
    config_class = getattr(transformers, class_name)
    if "text_config" in args:
        text = {**SHAPE, **TOKENS, **args["text_config"], **overrides}
        config = config_class(**{**args, "text_config": text}, architectures=[arch])
    else:
        config = config_class(**{**SHAPE, **TOKENS, **args, **overrides}, architectures=[arch])
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


# Per architecture: weight-name substring -> initialiser, ahead of `initialiser`'s rules.
# A router of std 0.02 gives near-uniform expert probabilities, where float32 rounding could
# flip the top-k choice between implementations; std 0.3 makes the routing decisive.
INIT_OVERRIDES: dict[str, dict[str, tuple[str, float]]] = {
    # a router of std 0.02 scores every expert ~0.5 and the keys' latent expansion would make
    # attention near uniform: both get weights that make choices
    "Glm4MoeLiteForCausalLM": {"mlp.gate.weight": ("normal", 0.5), "kv_b_proj": ("normal", 0.1)},
    "Cohere2MoeForCausalLM": {"mlp.gate.weight": ("normal", 0.5)},
    "Qwen3MoeForCausalLM": {"mlp.gate.weight": ("normal", 0.3)},
    "Qwen3_5MoeForCausalLM": {"mlp.gate.weight": ("normal", 0.3)},
    "Qwen3_5MoeForConditionalGeneration": {"mlp.gate.weight": ("normal", 0.3)},
    # GPT-OSS: its router, and attention sinks large enough to take a share of attention
    "GptOssForCausalLM": {"mlp.router.weight": ("normal", 0.3), "sinks": ("normal", 1.0)},
    # a router of std 0.02 scores experts almost alike: rounding would pick the top-2
    "Gemma4ForConditionalGeneration": {"router.proj": ("normal", 0.5)},
    "NemotronHForCausalLM": {"mixer.gate.weight": ("normal", 0.5)},
    "LagunaForCausalLM": {"mlp.gate.weight": ("normal", 0.5)},
    # the fused q/k/v projection: std 0.1 as q_proj and k_proj have, so attention is not uniform
    "Phi3ForCausalLM": {"qkv_proj": ("normal", 0.1)},
}


def initialiser(arch: str, name: str, value: Any) -> tuple[str, float]:
    """How tests/tiny.py draws a weight, from its name and transformers' own initial value:
    a constant vector (a norm's identity, a bias) keeps its constant plus noise, A_log is
    log(U(1, 16)), q/k projections and recurrent input projections get std 0.1 so attention
    and gates are not uniform, the rest std 0.02."""
    for key, init in INIT_OVERRIDES.get(arch, {}).items():
        if key in name:
            return init
    if name.endswith("A_log"):
        return ("log_uniform", 16.0)
    flat = value.detach().float().reshape(-1)
    if value.ndim == 1 and bool((flat == flat[0]).all()):
        return ("norm", float(flat[0]))
    if "conv1d" in name:
        return ("normal", 0.3)
    if any(k in name for k in ("q_proj", "k_proj", "in_proj", "q_a_proj", "q_b_proj", "kv_a_proj")):
        return ("normal", 0.1)
    return ("normal", 0.02)


def weight_manifest(arch: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Names, shapes and initialisers of the transformers model's weights for the tiny config
    (or `config`: a variant whose weights differ, for the live tier) (tied copies once: the
    name save_pretrained keeps)."""
    import torch
    import transformers

    if config is None:
        config = json.loads((CONFIGS / f"{arch}.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        hf_config = transformers.AutoConfig.from_pretrained(tmp)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(hf_config)
    manifest = {}
    with tempfile.TemporaryDirectory() as tmp:
        # the names and layout of a checkpoint, which save_pretrained may convert from the
        # module's own (transformers 5 stores some fused experts split, for example)
        model.save_pretrained(tmp, safe_serialization=True)
        from safetensors import safe_open

        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for name in st.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    value = st.get_tensor(name)
                    manifest[name] = [list(value.shape), list(initialiser(arch, name, value))]
    return dict(sorted(manifest.items()))


def golden_sequences(vocab_size: int = SHAPE["vocab_size"]) -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    return [rng.integers(0, vocab_size, n).astype(np.int32) for n in SEQUENCE_LENGTHS]


def reference_logits(model_dir: Path, sequences: list[np.ndarray]) -> list[np.ndarray]:
    """Last-position logits of the transformers model in `model_dir`, one per sequence."""
    import torch
    import transformers

    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, arch).from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}  # missing, unexpected, mismatched, errors
    if bad:
        raise RuntimeError(f"transformers did not load {model_dir} cleanly: {bad}")
    model.eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor(seq[None].astype(np.int64))
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
            out.append(logits.float().numpy())
    return out


def write_golden(arch: str) -> Path:
    sequences = golden_sequences()
    with tempfile.TemporaryDirectory() as tmp:
        logits = reference_logits(write_tiny_model(arch, Path(tmp)), sequences)
    arrays = {f"tokens_{i}": s for i, s in enumerate(sequences)}
    arrays |= {f"logits_{i}": x.astype(np.float32) for i, x in enumerate(logits)}
    GOLDEN.mkdir(parents=True, exist_ok=True)
    path = GOLDEN / f"{arch}.npz"
    np.savez_compressed(path, **arrays)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", action="store_true", help="rewrite the configs first")
    parser.add_argument("--only", action="append", help="this architecture (repeatable)")
    args = parser.parse_args()
    chosen = args.only or list(TINY_ARCHITECTURES)
    if args.configs:
        CONFIGS.mkdir(parents=True, exist_ok=True)
        for arch in chosen:
            text = json.dumps(transformers_config(arch), indent=2, sort_keys=True)
            (CONFIGS / f"{arch}.json").write_text(text + "\n")
            print("wrote", CONFIGS / f"{arch}.json")
            if json.loads(text)["model_type"] not in HAND_WRITTEN:
                manifest = json.dumps(weight_manifest(arch), indent=1, sort_keys=True)
                manifest_path(arch).write_text(manifest + "\n")
                print("wrote", manifest_path(arch))
    for arch in chosen:
        print("wrote", write_golden(arch))


if __name__ == "__main__":
    main()
