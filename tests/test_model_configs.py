"""Impossible config values are refused at load (runner/models/config.py), for every family.

Each case edits the family's tiny config (tests/data/configs) and expects `build_model` to
raise a ModelLoadError naming the key, before any weight is looked at: before these checks
such configs raised TypeError or ZeroDivisionError inside mlx-lm, or built a model that failed
at the first request or answered with a context length of 0 or less.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner.models import build_model
from runner.models.gemma3 import Gemma3
from runner.models.llama import Llama
from runner.models.qwen3 import Qwen3
from runner.models.qwen3_5_moe import Qwen3_5Moe
from runner.models.qwen3_moe import Qwen3Moe
from runner.sources.source import ModelLoadError, ModelSource, config_json
from tests.tiny import TINY_ARCHITECTURES, edit_text_config, tiny_config, write_tiny_model
from tools.spawned import SpawnedRunner


def refused(arch: str, edits: dict[str, Any]) -> str:
    """The one-line message `build_model` refuses `arch`'s tiny config with, once edited."""
    config = config_json(json.dumps(edit_text_config(tiny_config(arch), edits)))  # as loaded
    with pytest.raises(ModelLoadError) as err:
        build_model(ModelSource(name="x", config=config, tokenizer_json=""))
    message = str(err.value)
    assert "\n" not in message
    return message


# What every family refuses: (edits, the start of the message after "config.json: ").
EVERY_FAMILY: list[tuple[dict[str, Any], str]] = [
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, not 0"),
    ({"max_position_embeddings": -4096}, "max_position_embeddings must be a positive integer"),
    ({"max_position_embeddings": None}, "max_position_embeddings must be a positive integer"),
    ({"max_position_embeddings": "4096"}, "max_position_embeddings must be a positive integer"),
    ({"max_position_embeddings": 2**31}, "max_position_embeddings 2147483648 is more than"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer, not 0"),
    ({"hidden_size": -64}, "hidden_size must be a positive integer, not -64"),
    ({"hidden_size": 64.0}, "hidden_size must be a positive integer, not 64.0"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, not '64'"),
    ({"hidden_size": True}, "hidden_size must be a positive integer, not True"),
    ({"hidden_size": None}, "hidden_size must be a positive integer, not None"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"num_attention_heads": [4]}, "num_attention_heads must be a positive integer"),
    ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive integer"),
    (
        {"num_key_value_heads": 3},
        "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"vocab_size": -384}, "vocab_size must be a positive integer"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer"),
    ({"intermediate_size": {"size": 128}}, "intermediate_size must be a positive integer"),
    ({"head_dim": 0}, "head_dim must be a positive integer"),
    ({"head_dim": "16"}, "head_dim must be a positive integer"),
    ({"head_dim": 15}, "RoPE would rotate "),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive number, not nan"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"attention_bias": 1}, "attention_bias must be true or false"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of names"),
    ({"architectures": [None]}, "architectures must be a list of names"),
    ({"architectures": {"0": "LlamaForCausalLM"}}, "architectures must be a list of names"),
    ({"architectures": None, "model_type": 3}, "model_type must be a name"),
    ({"rope_parameters": ["rope_theta", 10000.0]}, "rope_parameters must be an object"),
]


# Keys of EVERY_FAMILY a family never reads (its transformers config has no such key: Nemotron-H
# has layer_norm_epsilon and no RoPE): the config passes the checks; the (absent) weights fail.
NOT_READ = {"NemotronHForCausalLM": ("rms_norm_eps", "rope_parameters")}


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize(("edits", "message"), EVERY_FAMILY)
def test_every_family_refuses(arch: str, edits: dict[str, Any], message: str) -> None:
    if set(edits) & set(NOT_READ.get(arch, ())):
        assert not refused(arch, edits).startswith("config.json")
    else:
        assert refused(arch, edits).startswith(f"config.json: {message}")


GLIMMER = "MuseGlimmerForConditionalGeneration"
FAMILY: list[tuple[str, dict[str, Any], str]] = [
    (GLIMMER, {"output_multiplier": 0}, "output_multiplier must be a positive number"),
    (GLIMMER, {"final_logit_softcapping": None}, "final_logit_softcapping must be a positive"),
    (GLIMMER, {"qk_scale_factor": "3.87"}, "qk_scale_factor must be a positive number"),
    (GLIMMER, {"layer_rope_theta": [0, 1e4]}, "layer_rope_theta must give a RoPE base"),
    (GLIMMER, {"layer_rope_theta": [0, -1, 1e4, 1e4, 0]}, "layer_rope_theta[1] must be a"),
    (GLIMMER, {"layer_types": ["full_attention"] * 4}, "layer_types must give one of"),
    ("Gemma4ForCausalLM", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("Gemma4ForCausalLM", {"per_layer_config": {"1": {"head_dim": 7}}}, "RoPE would rotate"),
    ("LagunaForCausalLM", {"gating": False}, 'gating must be true or "per-head", not False'),
    ("LagunaForCausalLM", {"num_attention_heads_per_layer": [4, 5, 4]}, "layer 1's 5 attention"),
    ("LagunaForCausalLM", {"num_attention_heads_per_layer": [4]}, "num_attention_heads_per_layer"),
    ("LagunaForCausalLM", {"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ("LagunaForCausalLM", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than"),
    (
        "LagunaForCausalLM",
        {"rope_parameters": {"full_attention": {"partial_rotary_factor": 0.1}}},
        "rope_parameters.full_attention would rotate 1 ",
    ),
    ("NemotronHForCausalLM", {"layer_norm_epsilon": 0}, "layer_norm_epsilon must be a positive"),
    ("NemotronHForCausalLM", {"mamba_num_heads": 7}, "mamba_num_heads 7 is not a multiple of"),
    ("NemotronHForCausalLM", {"layers_block_type": ["mamba2"]}, "layers_block_type must be"),
    ("NemotronHForCausalLM", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than"),
    # transformers' LlamaConfig and Gemma3TextConfig: hidden_size a multiple of the heads
    ("LlamaForCausalLM", {"hidden_size": 66}, "hidden_size 66 is not a multiple of"),
    ("LlamaForCausalLM", {"mlp_bias": "no"}, "mlp_bias must be true or false"),
    # a null head_dim is hidden_size // heads, here 9: odd
    ("LlamaForCausalLM", {"head_dim": None, "hidden_size": 36}, "RoPE would rotate 9 "),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor"),
    (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "factor": 0}},
        "rope_parameters.factor must be a positive number, not 0",
    ),
    (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
        "rope_parameters.rope_theta must be a positive number, not -1.0",
    ),
    (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
        "rope_parameters.rope_theta must be a positive number",
    ),
    (
        "LlamaForCausalLM",
        {"rope_theta": None, "rope_parameters": None},
        "rope_parameters.rope_theta must be a positive number, not None",
    ),
    (
        "LlamaForCausalLM",
        {
            "rope_parameters": tiny_config("LlamaForCausalLM")["rope_parameters"]
            | {"high_freq_factor": 1.0}
        },
        "rope_parameters.low_freq_factor and high_freq_factor are both 1.0",
    ),
    (
        "LlamaForCausalLM",
        {
            "rope_parameters": tiny_config("LlamaForCausalLM")["rope_parameters"]
            | {"original_max_position_embeddings": 0}
        },
        "rope_parameters.original_max_position_embeddings must be a positive integer",
    ),
    (
        "LlamaForCausalLM",
        {"rope_scaling": "linear", "rope_parameters": None},
        "rope_scaling must be an object",
    ),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention"]}, "layer_types must give one of"),
    ("Qwen3ForCausalLM", {"layer_types": "full_attention"}, "layer_types must give one of"),
    (
        "Qwen3ForCausalLM",
        {"layer_types": ["full_attention", "linear_attention"]},
        "layer_types must give one of full_attention, sliding_attention for each of the 2",
    ),
    ("Qwen3ForCausalLM", {"use_sliding_window": "true"}, "use_sliding_window must be true"),
    (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 0},
        "sliding_window must be a positive integer, not 0",
    ),
    (
        "Qwen3ForCausalLM",
        {"layer_types": None, "max_window_layers": -1},
        "max_window_layers must be an integer of at least 0, not -1",
    ),
    ("Gemma3ForCausalLM", {"hidden_size": 66}, "hidden_size 66 is not a multiple of"),
    ("Gemma3ForCausalLM", {"layer_types": ["sliding_attention"] * 5}, "layer_types must give"),
    ("Gemma3ForCausalLM", {"layer_types": [None] * 4}, "layer_types must give"),
    ("Gemma3ForCausalLM", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("Gemma3ForCausalLM", {"sliding_window": None}, "sliding_window must be a positive integer"),
    (
        "Gemma3ForCausalLM",
        {"sliding_window_pattern": 0},
        "sliding_window_pattern must be a positive integer",
    ),
    ("Gemma3ForCausalLM", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a"),
    (
        "Gemma3ForCausalLM",
        {"final_logit_softcapping": "30"},
        "final_logit_softcapping must be a positive number",
    ),
    (
        "Gemma3ForCausalLM",
        {"final_logit_softcapping": 0.0},
        "final_logit_softcapping must be a positive number",
    ),
    (
        "Gemma3ForCausalLM",
        {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": -8.0}}},
        "rope_parameters.full_attention.factor must be a positive number, not -8.0",
    ),
    (
        "Gemma3ForCausalLM",
        {"rope_parameters": {"sliding_attention": ["default"]}},
        "rope_parameters.sliding_attention must be an object",
    ),
    (
        "Qwen3_5ForCausalLM",
        {"layer_types": ["linear_attention"] * 3},
        "layer_types must give one of full_attention, linear_attention for each of the 4",
    ),
    (
        "Qwen3_5ForCausalLM",
        {"layer_types": ["sliding_attention"] * 4},
        "layer_types must give one of",
    ),
    (
        "Qwen3_5ForCausalLM",
        {"full_attention_interval": 0},
        "full_attention_interval must be a positive integer",
    ),
    (
        "Qwen3_5ForCausalLM",
        {"linear_num_value_heads": 3},
        "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2",
    ),
    ("Qwen3_5ForCausalLM", {"linear_num_key_heads": 0}, "linear_num_key_heads must be a"),
    ("Qwen3_5ForCausalLM", {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim must be a"),
    ("Qwen3_5ForCausalLM", {"linear_value_head_dim": "16"}, "linear_value_head_dim must be a"),
    (
        "Qwen3_5ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0}},
        "rope_parameters.partial_rotary_factor must be a positive number, not 0",
    ),
    (
        "Qwen3_5ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}},
        "rope_parameters.partial_rotary_factor 1.5 is above 1",
    ),
    # RoPE rotates head_dim * partial_rotary_factor dimensions, in pairs
    ("Qwen3_5ForCausalLM", {"head_dim": 6}, "RoPE would rotate 3 of the 6 dimensions"),
    ("Glm4MoeLiteForCausalLM", {"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
    ("Glm4MoeLiteForCausalLM", {"q_lora_rank": -1}, "q_lora_rank must be a positive integer"),
    ("Glm4MoeLiteForCausalLM", {"n_routed_experts": 0}, "n_routed_experts must be a positive"),
    ("Glm4MoeLiteForCausalLM", {"v_head_dim": "16"}, "v_head_dim must be a positive integer"),
    (
        "Glm4MoeLiteForCausalLM",
        {"num_key_value_heads": 2},
        "num_key_value_heads 2 must equal num_attention_heads 4",
    ),
    (
        "Glm4MoeLiteForCausalLM",
        {"n_group": 3},
        "n_routed_experts 4 must be a multiple of n_group 3",
    ),
    ("Glm4MoeLiteForCausalLM", {"topk_group": 3}, "topk_group 3 is more than n_group 2"),
    (
        "Glm4MoeLiteForCausalLM",
        {"num_experts_per_tok": 3},
        "num_experts_per_tok 3 is more than the 2 experts of the chosen groups",
    ),
    ("Glm4MoeLiteForCausalLM", {"routed_scaling_factor": 0}, "routed_scaling_factor must be"),
    ("Glm4MoeLiteForCausalLM", {"rope_interleave": "yes"}, "rope_interleave must be true"),
    ("Glm4MoeLiteForCausalLM", {"norm_topk_prob": 1}, "norm_topk_prob must be true or false"),
    (
        "Glm4MoeLiteForCausalLM",
        {"mlp_layer_types": ["dense", "sparse"]},
        "mlp_layer_types must give dense or sparse for each of the 4 layers",
    ),
    (
        "Glm4MoeLiteForCausalLM",
        {"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]},
        "mlp_layer_types must give dense or sparse",
    ),
    ("Cohere2MoeForCausalLM", {"layer_norm_eps": 0}, "layer_norm_eps must be a positive number"),
    ("Cohere2MoeForCausalLM", {"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive"),
    ("Cohere2MoeForCausalLM", {"logit_scale": None}, "logit_scale must be a positive number"),
    ("Cohere2MoeForCausalLM", {"num_experts": 0}, "num_experts must be a positive integer"),
    (
        "Cohere2MoeForCausalLM",
        {"num_experts_per_tok": 5},
        "num_experts_per_tok 5 is more than num_experts 4",
    ),
    ("Cohere2MoeForCausalLM", {"num_shared_experts": -1}, "num_shared_experts must be an"),
    ("Cohere2MoeForCausalLM", {"sliding_window": None}, "sliding_window must be a positive"),
    (
        "Cohere2MoeForCausalLM",
        {"prefix_dense_intermediate_size": 0},
        "prefix_dense_intermediate_size must be a positive integer",
    ),
    (
        "Cohere2MoeForCausalLM",
        {"layer_types": ["full_attention"] * 3},
        "layer_types must give one of full_attention, sliding_attention for each of the 4",
    ),
    (
        "Cohere2MoeForCausalLM",
        {"layer_types": None, "sliding_window_pattern": 0},
        "sliding_window_pattern must be a positive integer",
    ),
    (
        "Cohere2MoeForCausalLM",
        {"mlp_layer_types": ["dense"] * 5},
        "mlp_layer_types must give dense or sparse for each of the 4 layers",
    ),
    ("Qwen3MoeForCausalLM", {"num_local_experts": 0}, "num_local_experts must be a positive"),
    (
        "Qwen3MoeForCausalLM",
        {"num_experts_per_tok": 5},
        "num_experts_per_tok 5 is more than num_local_experts 4",
    ),
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive"),
    ("Qwen3MoeForCausalLM", {"moe_intermediate_size": None}, "moe_intermediate_size must be a"),
    ("Qwen3MoeForCausalLM", {"mlp_only_layers": [3]}, "mlp_only_layers[] 3 is more than 2"),
    ("Qwen3MoeForCausalLM", {"mlp_only_layers": 0}, "mlp_only_layers must be a list"),
    ("Qwen3MoeForCausalLM", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    (
        "Qwen3MoeForCausalLM",
        {"use_sliding_window": True, "sliding_window": 0},
        "sliding_window must be a positive integer, not 0",
    ),
    ("Qwen3_5MoeForCausalLM", {"num_experts": 0}, "num_experts must be a positive integer"),
    (
        "Qwen3_5MoeForCausalLM",
        {"num_experts_per_tok": 5},
        "num_experts_per_tok 5 is more than num_experts 4",
    ),
    (
        "Qwen3_5MoeForCausalLM",
        {"shared_expert_intermediate_size": 0},
        "shared_expert_intermediate_size must be a positive integer",
    ),
    ("Qwen3_5MoeForCausalLM", {"moe_intermediate_size": "64"}, "moe_intermediate_size must be"),
    ("Qwen3_5MoeForCausalLM", {"linear_num_key_heads": 0}, "linear_num_key_heads must be a"),
    (
        "Qwen3_5MoeForCausalLM",
        {"layer_types": ["full_attention"] * 4},
        "layer_types must give one of full_attention, linear_attention for each of the 3",
    ),
    ("GptOssForCausalLM", {"num_local_experts": None}, "num_local_experts must be a positive"),
    (
        "GptOssForCausalLM",
        {"num_experts_per_tok": 8},
        "num_experts_per_tok 8 is more than num_local_experts 4",
    ),
    ("GptOssForCausalLM", {"swiglu_limit": 0}, "swiglu_limit must be a positive number"),
    ("GptOssForCausalLM", {"swiglu_alpha": "1.7"}, "swiglu_alpha must be a positive number"),
    ("GptOssForCausalLM", {"sliding_window": None}, "sliding_window must be a positive integer"),
    ("GptOssForCausalLM", {"layer_types": ["full_attention"]}, "layer_types must give one of"),
    (
        "GptOssForCausalLM",
        {"rope_parameters": {"rope_type": "yarn", "factor": 0}},
        "rope_parameters.factor must be a positive number, not 0",
    ),
    ("MistralForCausalLM", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    (
        "Ministral3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "original_max_position_embeddings": 16}},
        "rope_parameters.llama_4_scaling_beta must be a finite number of at least 0",
    ),
    (
        "Ministral3ForCausalLM",
        {
            "rope_parameters": tiny_config("Ministral3ForCausalLM")["rope_parameters"]
            | {"llama_4_scaling_beta": float("inf")}
        },
        "rope_parameters.llama_4_scaling_beta must be a finite number",
    ),
    (
        "Ministral3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "llama_4_scaling_beta": 0.1}},
        "rope_parameters.original_max_position_embeddings must be a positive integer",
    ),
    ("Ministral3ForCausalLM", {"sliding_window": "8"}, "sliding_window must be a positive"),
    # mlx-lm's qwen2 heads are hidden_size // num_attention_heads wide
    ("Qwen2ForCausalLM", {"head_dim": 32}, "head_dim 32 is not hidden_size // num_attention"),
    ("Qwen2ForCausalLM", {"use_sliding_window": "true"}, "use_sliding_window must be true"),
    ("Qwen2ForCausalLM", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("Qwen2ForCausalLM", {"layer_types": ["full_attention"] * 2}, "layer_types must give one"),
    (
        "Qwen2ForCausalLM",
        {"layer_types": None, "max_window_layers": -1},
        "max_window_layers must be an integer of at least 0, not -1",
    ),
    (  # transformers fails on a sliding layer without a window
        "Qwen2ForCausalLM",
        {"use_sliding_window": False},
        "layer_types has sliding_attention layers but no window",
    ),
    (
        "Qwen2ForCausalLM",
        {"sliding_window": None},
        "layer_types has sliding_attention layers but no window",
    ),
    ("Gemma2ForCausalLM", {"hidden_size": 66}, "hidden_size 66 is not a multiple of"),
    ("Gemma2ForCausalLM", {"attn_logit_softcapping": 0}, "attn_logit_softcapping must be a"),
    ("Gemma2ForCausalLM", {"attn_logit_softcapping": "50"}, "attn_logit_softcapping must be"),
    ("Gemma2ForCausalLM", {"final_logit_softcapping": -30.0}, "final_logit_softcapping must"),
    ("Gemma2ForCausalLM", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a"),
    ("Gemma2ForCausalLM", {"sliding_window": None}, "sliding_window must be a positive integer"),
    ("Gemma2ForCausalLM", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("Gemma2ForCausalLM", {"layer_types": ["full_attention"] * 3}, "layer_types must give"),
    ("Phi3ForCausalLM", {"head_dim": 32}, "head_dim 32 is not hidden_size // num_attention"),
    ("Phi3ForCausalLM", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    (
        "Phi3ForCausalLM",
        {"original_max_position_embeddings": 1},
        "original_max_position_embeddings must be an integer of at least 2",
    ),
    (
        "Phi3ForCausalLM",
        {"rope_parameters": {"rope_type": "longrope", "partial_rotary_factor": 0.75}},
        "rope_parameters.short_factor must be a list of 6 positive numbers",
    ),
    (
        "Phi3ForCausalLM",
        {
            "rope_parameters": tiny_config("Phi3ForCausalLM")["rope_parameters"]
            | {"long_factor": [1.0, 2.0]}
        },
        "rope_parameters.long_factor must be a list of 6 positive numbers",
    ),
    (
        "Phi3ForCausalLM",
        {
            "rope_parameters": tiny_config("Phi3ForCausalLM")["rope_parameters"]
            | {"short_factor": [0.0] * 6}
        },
        "rope_parameters.short_factor must be a list of 6 positive numbers",
    ),
    (
        "Phi3ForCausalLM",
        {"rope_parameters": tiny_config("Phi3ForCausalLM")["rope_parameters"] | {"factor": "8"}},
        "rope_parameters.factor must be a positive number",
    ),
    (
        "Phi3ForCausalLM",
        {
            "rope_parameters": tiny_config("Phi3ForCausalLM")["rope_parameters"]
            | {"attention_factor": 0}
        },
        "rope_parameters.attention_factor must be a positive number",
    ),
    (
        "Phi3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}},
        "rope_parameters.partial_rotary_factor 1.5 is above 1",
    ),
]


@pytest.mark.parametrize(("arch", "edits", "message"), FAMILY)
def test_family_refuses(arch: str, edits: dict[str, Any], message: str) -> None:
    assert refused(arch, edits).startswith(f"config.json: {message}")


def test_null_sizes_that_transformers_derives_are_accepted() -> None:
    """transformers 5 reads a null head_dim and num_key_value_heads of Llama, and a null
    num_key_value_heads of Qwen3, as derived values; so do the adapters."""
    llama = tiny_config("LlamaForCausalLM") | {"head_dim": None, "num_key_value_heads": None}
    args = Llama.build_module(llama).args
    assert (args.head_dim or 64 // 4, args.num_key_value_heads) == (16, 4)
    qwen3 = tiny_config("Qwen3ForCausalLM") | {"num_key_value_heads": None}
    assert Qwen3.build_module(qwen3).args.num_key_value_heads == 4
    # transformers' Qwen3-MoE derives head_dim; Qwen3.5-MoE has no dense intermediate_size
    qwen3_moe = tiny_config("Qwen3MoeForCausalLM")
    del qwen3_moe["head_dim"]
    assert Qwen3Moe.build_module(qwen3_moe).args.head_dim == 16
    qwen3_5_moe = tiny_config("Qwen3_5MoeForCausalLM")
    del qwen3_5_moe["intermediate_size"]
    Qwen3_5Moe.build_module(qwen3_5_moe)


def test_unused_keys_are_not_checked() -> None:
    """Keys a family does not read stay its own business: Llama has no sliding window, and
    Gemma3's flat `rope_parameters` without per-kind entries is what transformers ignores."""
    Llama.build_module(tiny_config("LlamaForCausalLM") | {"sliding_window": "none"})
    flat = {"rope_type": "default", "rope_theta": "ignored"}
    Gemma3.build_module(tiny_config("Gemma3ForCausalLM") | {"rope_parameters": flat})


@pytest.mark.slow
def test_an_impossible_config_is_one_error_line(tmp_path: Path) -> None:
    path = write_tiny_model("LlamaForCausalLM", tmp_path / "bad")
    config = json.loads((path / "config.json").read_text()) | {"hidden_size": "64"}
    (path / "config.json").write_text(json.dumps(config))
    with SpawnedRunner("--model", str(path)) as process:
        assert process.wait(timeout=120) == 1
        output = process.output()
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert errors == ["Error: config.json: hidden_size must be a positive integer, not '64'"], (
        output
    )
