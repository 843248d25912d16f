"""Tiny GGUF models for the GGUF loading tests, written as llama.cpp's converter
(convert_hf_to_gguf.py, its conversion/*.py classes) writes them: from a tiny checkpoint
directory (tests/tiny.py), its config as the converter's metadata keys, its tokenizer as
`tokenizer.ggml.*`, its tensors under GGUF names with the converter's changes (Q/K rows
permuted for llama and mistral3; norms stored as 1 + w and the embedding cut to the
tokenizer's vocabulary for Gemma; experts stacked [E, out, in] for Qwen3-MoE, split,
de-interleaved and transposed for GPT-OSS; Phi-3's fused projections as they are, its longrope
as factor tensors), each tensor stored in the GGML type a rule gives it (quantized by the gguf
package where it can quantize that type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4).
tests/test_gguf_convert.py holds these files to what the real converter writes.

`ollama=True` writes what Ollama's own converter published instead, where llama.cpp reads it
differently (ollama's llama/compat/llama-ollama-compat.cpp): gemma3 and mistral3 with their
vision tower embedded (`v.*`, `mm.*`) and their own key spellings, gpt-oss as `gptoss`.

`tiny_checkpoint(arch, path)` writes the tiny checkpoint of `arch` as a GGUF can say it
(`GGUF_CANNOT`: what the format has no key for, set to what llama.cpp assumes).
`checkpoint_of(gguf_path, like, out)` writes the checkpoint the GGUF's stored values are: the
dequantized tensors (gguf-py's values, llama.cpp's) with the converter's changes undone, in
Hugging Face's names and layouts, with `like`'s config and tokenizer: what the GGUF model must
compute.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file

from runner.sources.gguf.architectures import unpermute_rows
from tests.tiny import read_manifest, tiny_config, write_tiny_model

T = gguf.GGMLQuantizationType

# checkpoint name (under model.layers.N.) -> GGUF block name
ATTENTION = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
MLP = {
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
LLAMA_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **ATTENTION,
    **MLP,
}
GEMMA_BLOCK = {
    **LLAMA_BLOCK,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
PHI3_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
QWEN3MOE_BLOCK = {**LLAMA_BLOCK, "mlp.gate.weight": "ffn_gate_inp.weight"}
GPT_OSS_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    **ATTENTION,
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class Conversion:
    """What the converter's class for a checkpoint architecture does."""

    arch: str  # GGUF architecture
    block: dict[str, str]
    permuted: bool = False  # Q/K rows (LlamaModel.permute)
    plus_one: bool = False  # norms stored as 1 + w (Gemma)
    experts: str | None = None  # "stacked" (Qwen3-MoE) or "gpt-oss"
    metadata: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda c: {})


def _rope(c: dict[str, Any]) -> dict[str, Any]:
    """TextModel's reading of the rope dict (the full-attention one where it is per kind)."""
    params = c.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _base(c: dict[str, Any]) -> dict[str, Any]:
    """TextModel.set_gguf_parameters: the keys every text model writes (without the prefix)."""
    rope = _rope(c)
    kv: dict[str, Any] = {
        "block_count": c["num_hidden_layers"],
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
    }
    kind = rope.get("rope_type")
    if kind == "linear":
        kv |= {"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])}
    elif kind == "yarn":
        kv |= {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": float(rope["factor"]),
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        }
        for hf, key in (
            ("extrapolation_factor", "yarn_ext_factor"),
            ("attention_factor", "attn_factor"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ):
            if rope.get(hf) is not None:
                kv[f"rope.scaling.{key}"] = float(rope[hf])
    kv["rope.freq_base"] = float(rope["rope_theta"])
    sliding = (c.get("rope_parameters") or {}).get("sliding_attention")
    if sliding is not None:
        kv["rope.freq_base_swa"] = float(sliding["rope_theta"])
    kv["attention.layer_norm_rms_epsilon"] = float(c["rms_norm_eps"])
    if c.get("num_local_experts") is not None:
        kv["expert_count"] = c["num_local_experts"]
    if c.get("num_experts_per_tok") is not None:
        kv["expert_used_count"] = c["num_experts_per_tok"]
    if c.get("head_dim") is not None:
        kv["attention.key_length"] = kv["attention.value_length"] = c["head_dim"]
    return kv


def _llama(c: dict[str, Any]) -> dict[str, Any]:
    """LlamaModel.set_gguf_parameters (its llama3 RoPE goes into rope_freqs)."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return _base(c) | {"vocab_size": c["vocab_size"], "rope.dimension_count": head_dim}


def _ministral3(c: dict[str, Any]) -> dict[str, Any]:
    """Mistral3Model.Ministral3Model: llama's keys, yarn's log multiplier and the query
    temperature of a ministral3."""
    rope = c["rope_parameters"]
    return _llama(c) | {
        "rope.scaling.yarn_log_multiplier": float(rope["mscale_all_dim"]),
        "attention.temperature_scale": float(rope["llama_4_scaling_beta"]),
    }


def _qwen3moe(c: dict[str, Any]) -> dict[str, Any]:
    return _base(c) | {"expert_feed_forward_length": c["moe_intermediate_size"]}


def _gemma2(c: dict[str, Any]) -> dict[str, Any]:
    """Gemma2Model.set_gguf_parameters: no RoPE keys at all."""
    return {
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "block_count": c["num_hidden_layers"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "attn_logit_softcapping": float(c["attn_logit_softcapping"]),
        "final_logit_softcapping": float(c["final_logit_softcapping"]),
        "attention.sliding_window": c["sliding_window"],
    }


def _gemma3(c: dict[str, Any]) -> dict[str, Any]:
    kv = _base(c)
    if c.get("final_logit_softcapping"):
        kv["final_logit_softcapping"] = float(c["final_logit_softcapping"])
    if c.get("sliding_window_pattern") != 1:
        kv["attention.sliding_window"] = c["sliding_window"]
    return kv


def _phi3(c: dict[str, Any]) -> dict[str, Any]:
    """Phi3MiniModel.set_gguf_parameters and generate_extra_tensors' attention factor."""
    rope = c["rope_parameters"]
    original = rope["original_max_position_embeddings"]
    rotated = (
        int(rope.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // c["num_attention_heads"]
    )
    kv = {
        "context_length": c["max_position_embeddings"],
        "rope.scaling.original_context_length": original,
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "block_count": c["num_hidden_layers"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "rope.dimension_count": rotated,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.sliding_window": c.get("sliding_window") or 0,
    }
    if rope.get("long_factor"):
        scale = c["max_position_embeddings"] / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        kv["rope.scaling.attn_factor"] = factor
    return kv


def _gpt_oss(c: dict[str, Any]) -> dict[str, Any]:
    return _base(c) | {
        "attention.sliding_window": c["sliding_window"],
        "expert_feed_forward_length": c["intermediate_size"],
    }


CONVERSIONS: dict[str, Conversion] = {
    "LlamaForCausalLM": Conversion("llama", LLAMA_BLOCK, permuted=True, metadata=_llama),
    "MistralForCausalLM": Conversion("llama", LLAMA_BLOCK, permuted=True, metadata=_llama),
    "Ministral3ForCausalLM": Conversion(
        "mistral3", LLAMA_BLOCK, permuted=True, metadata=_ministral3
    ),
    "Qwen2ForCausalLM": Conversion("qwen2", LLAMA_BLOCK, metadata=_base),
    "Qwen3ForCausalLM": Conversion("qwen3", LLAMA_BLOCK, metadata=_base),
    "Qwen3MoeForCausalLM": Conversion(
        "qwen3moe", QWEN3MOE_BLOCK, experts="stacked", metadata=_qwen3moe
    ),
    "Gemma2ForCausalLM": Conversion("gemma2", GEMMA_BLOCK, plus_one=True, metadata=_gemma2),
    "Gemma3ForCausalLM": Conversion("gemma3", GEMMA_BLOCK, plus_one=True, metadata=_gemma3),
    "Phi3ForCausalLM": Conversion("phi3", PHI3_BLOCK, metadata=_phi3),
    "GptOssForCausalLM": Conversion("gpt-oss", GPT_OSS_BLOCK, experts="gpt-oss", metadata=_gpt_oss),
}
GGUF_ARCHITECTURES = tuple(CONVERSIONS)

# What a GGUF cannot say, set to what llama.cpp's loader assumes instead:
# - qwen2: llama.cpp's qwen2 has no sliding windows;
# - MistralForCausalLM converts to "llama", which has no sliding windows;
# - qwen3moe: llama.cpp's loader has no dense layers (the converter cannot map the MLP of a
#   layer in mlp_only_layers), so every layer has experts;
# - gemma2: layer kinds are llama.cpp's period of 2 (every other layer global, from the
#   second) and queries are scaled by 1/sqrt(head_dim) (no query_pre_attn_scalar key);
# - gemma3: the period is 6 (six layers, so that one is global), queries as gemma2's;
# - gpt-oss: llama.cpp's clamped SwiGLU has alpha 1.702 and limit 7 (no keys for them).
GGUF_CANNOT: dict[str, dict[str, Any]] = {
    "Qwen2ForCausalLM": {"use_sliding_window": False, "layer_types": ["full_attention"] * 3},
    "MistralForCausalLM": {"sliding_window": None},
    "Qwen3MoeForCausalLM": {"mlp_only_layers": []},
    "Gemma2ForCausalLM": {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 16,
    },
    "Gemma3ForCausalLM": {
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "query_pre_attn_scalar": 16,
    },
    "GptOssForCausalLM": {"swiglu_alpha": 1.702, "swiglu_limit": 7.0},
}


def tiny_checkpoint(arch: str, path: Path) -> Path:
    """The tiny checkpoint of `arch` (tests/tiny.py) with `GGUF_CANNOT`'s changes; Qwen3-MoE's
    first layer gets experts (drawn as the others') in place of its dense MLP."""
    config = tiny_config(arch) | GGUF_CANNOT.get(arch, {})
    specs = None
    if arch == "Qwen3MoeForCausalLM":
        specs = {k: v for k, v in read_manifest(arch).items() if ".layers.0.mlp." not in k}
        for name, spec in list(specs.items()):
            if name.startswith("model.layers.1.mlp."):
                specs[name.replace(".layers.1.", ".layers.0.")] = spec
    return write_tiny_model(arch, path, config=config, specs=specs)


Rule = Callable[[str, tuple[int, ...], str], T]


def float32(name: str, shape: tuple[int, ...], arch: str) -> T:
    return T.F32


def mixed(name: str, shape: tuple[int, ...], arch: str) -> T:
    """A quantized file's mix, as llama.cpp's quantizer makes one: norms, biases, sinks and
    routers F32, the embedding Q8_0, attention Q4_0 / Q5_0 / Q4_1, the MLP Q5_1 / Q4_0 / Q8_0,
    GPT-OSS's experts MXFP4 (as its released files), Qwen3-MoE's Q4_0 / Q5_1 / Q8_0, the head
    F16, each where its rows divide into the type's blocks (else F16)."""
    if len(shape) < 2 or "ffn_gate_inp" in name or not name.endswith(".weight"):
        return T.F32
    if arch in ("gpt-oss", "gptoss") and "_exps" in name:
        return T.MXFP4
    by_name = [
        ("token_embd", T.Q8_0),
        ("attn_q.", T.Q4_0),
        ("attn_k.", T.Q5_0),
        ("attn_v.", T.Q4_1),
        ("attn_qkv", T.Q5_0),
        ("attn_out", T.Q8_0),  # attn_output (attn_out in Ollama's gpt-oss)
        ("ffn_gate_exps", T.Q4_0),
        ("ffn_up_exps", T.Q5_1),
        ("ffn_down_exps", T.Q8_0),
        ("ffn_gate", T.Q5_1),
        ("ffn_up", T.Q4_0),
        ("ffn_down", T.Q8_0),
        ("output.", T.F16),
    ]
    chosen = next((q for key, q in by_name if key in name), T.F16)
    block = gguf.GGML_QUANT_SIZES[chosen][0]
    return chosen if shape[-1] % block == 0 else T.F16


def halves(name: str, shape: tuple[int, ...], arch: str) -> T:
    """A file in half precision, as Ollama's gpt-oss:20b is: GPT-OSS's experts MXFP4, every
    other matrix BF16 but the head F16 (both half types read), norms, biases, sinks and the
    router F32."""
    if len(shape) < 2 or "ffn_gate_inp" in name or not name.endswith(".weight"):
        return T.F32
    if arch in ("gpt-oss", "gptoss") and "_exps" in name:
        return T.MXFP4
    return T.F16 if name.startswith("output.") else T.BF16


def k_mixed(name: str, shape: tuple[int, ...], arch: str) -> T:
    """llama.cpp's Q4_K_M where a row is whole blocks of 256: Q6_K for the embedding, the
    head, `attn_v` and `ffn_down`, Q4_K for the other matrices; `mixed` elsewhere (gguf-py
    quantizes no K type: `quantize_q6_k` and `quantize_q4_k` do)."""
    q6_k = ("token_embd.", "attn_v.", "ffn_down.")
    chosen = name == "output.weight" or any(key in name for key in q6_k)
    if len(shape) == 2 and shape[-1] % 256 == 0:
        return T.Q6_K if chosen else T.Q4_K
    return mixed(name, shape, arch)


def k5_mixed(name: str, shape: tuple[int, ...], arch: str) -> T:
    """llama.cpp's Q5_K_M the same way: k_mixed with Q5_K for Q4_K."""
    chosen = k_mixed(name, shape, arch)
    return T.Q5_K if chosen == T.Q4_K else chosen


def k3_mixed(name: str, shape: tuple[int, ...], arch: str) -> T:
    """llama.cpp's Q3_K_M the same way: Q3_K for the embedding and most matrices, Q5_K for
    `attn_v`, Q4_K for `attn_output` and `ffn_down`, Q6_K for the head."""
    by_name = [("attn_v.", T.Q5_K), ("attn_output.", T.Q4_K), ("ffn_down.", T.Q4_K)]
    return _k_file(name, shape, arch, by_name, T.Q3_K)


def k2_mixed(name: str, shape: tuple[int, ...], arch: str) -> T:
    """llama.cpp's Q2_K the same way: Q2_K for the embedding and most matrices, Q3_K for
    `attn_v` and `ffn_down`, Q4_K for `attn_output`, Q6_K for the head."""
    by_name = [("attn_v.", T.Q3_K), ("ffn_down.", T.Q3_K), ("attn_output.", T.Q4_K)]
    return _k_file(name, shape, arch, by_name, T.Q2_K)


def iq4_mixed(name: str, shape: tuple[int, ...], arch: str) -> T:
    """An IQ4_XS file as llama.cpp's quantizer makes one: IQ4_XS for the embedding and the
    matrices, Q6_K for the head."""
    return _k_file(name, shape, arch, [], T.IQ4_XS)


def iq4_fallback(name: str, shape: tuple[int, ...], arch: str) -> T:
    """An IQ4_XS file of a model whose rows are not all whole 256s, as llama.cpp's quantizer
    makes one: IQ4_XS where they are, IQ4_NL (its fallback) where they are whole 32s, the head
    Q6_K (its fallback Q8_0); `mixed` elsewhere."""
    if len(shape) == 2 and shape[-1] % 256 and shape[-1] % 32 == 0:
        return T.Q8_0 if name == "output.weight" else T.IQ4_NL
    return iq4_mixed(name, shape, arch)


# Every grid i-quant in one file (grid_types): the GGUF names' parts that pick each
GRID_FILE = {
    "attn_q.": T.IQ2_XXS, "attn_k.": T.IQ2_XS, "attn_v.": T.IQ2_S, "attn_output.": T.IQ3_XXS,
    "ffn_gate.": T.IQ3_S, "ffn_up.": T.IQ1_S, "ffn_down.": T.IQ1_M, "token_embd.": T.IQ3_S,
}  # fmt: skip


def grid_types(name: str, shape: tuple[int, ...], arch: str) -> T:
    """A file of the grid i-quants (random blocks: grid_blocks): each of a layer's matrices
    one of the seven (GRID_FILE), the embedding IQ3_S, a head of its own IQ2_XS, where a row is
    whole blocks of 256; `mixed` elsewhere."""
    if len(shape) == 2 and shape[-1] % 256 == 0:
        if name == "output.weight":
            return T.IQ2_XS
        for part, kind in GRID_FILE.items():
            if name.startswith(part) or f".{part}" in name:
                return kind
    return mixed(name, shape, arch)


def expert_types(gate_up: T, down: T) -> Rule:
    """A rule storing stacked experts' gate and up projections as `gate_up` and their down
    projections as `down` (Qwen3-MoE's Q4_K_M: Q4_K and Q6_K), the router F32 (as llama.cpp's
    quantizer keeps it), the rest as k_mixed does."""

    def rule(name: str, shape: tuple[int, ...], arch: str) -> T:
        if "ffn_gate_inp" in name:
            return T.F32
        if len(shape) == 3 and "_exps." in name:
            return down if "ffn_down_exps" in name else gate_up
        return k_mixed(name, shape, arch)

    return rule


# A tiny Qwen3-MoE whose rows are whole blocks of 256 (K-quant and grid experts)
MOE_DIMS = {
    "hidden_size": 256, "moe_intermediate_size": 256, "num_local_experts": 6,
    "num_experts_per_tok": 2, "head_dim": 32, "num_attention_heads": 8,
    "num_key_value_heads": 4, "num_hidden_layers": 2, "mlp_only_layers": [],
}  # fmt: skip


def moe_checkpoint(path: Path, dims: dict[str, Any] = MOE_DIMS, dtype: str = "float32") -> Path:
    """A Qwen3-MoE checkpoint of tests/tiny.py's config with `dims` (experts in every layer
    but its `mlp_only_layers`), stored in `dtype`, the experts' weights large enough to move
    the logits."""
    config = tiny_config("Qwen3MoeForCausalLM") | dims
    h, v, d = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    inter, experts = config["moe_intermediate_size"], config["num_local_experts"]
    norm, small = ("norm", 1.0), ("normal", 0.02)
    specs: dict[str, Any] = {
        "model.embed_tokens.weight": ((v, h), small),
        "lm_head.weight": ((v, h), small),
        "model.norm.weight": ((h,), norm),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs |= {
            f"{p}.input_layernorm.weight": ((h,), norm),
            f"{p}.post_attention_layernorm.weight": ((h,), norm),
            f"{p}.self_attn.q_proj.weight": ((q, h), ("normal", 0.1)),
            f"{p}.self_attn.k_proj.weight": ((kv, h), ("normal", 0.1)),
            f"{p}.self_attn.v_proj.weight": ((kv, h), small),
            f"{p}.self_attn.o_proj.weight": ((h, q), small),
            f"{p}.self_attn.q_norm.weight": ((d,), norm),
            f"{p}.self_attn.k_norm.weight": ((d,), norm),
        }
        if i in config["mlp_only_layers"]:  # a dense gated MLP
            dense = config["intermediate_size"]
            specs[f"{p}.mlp.gate_proj.weight"] = ((dense, h), ("normal", 0.1))
            specs[f"{p}.mlp.up_proj.weight"] = ((dense, h), ("normal", 0.1))
            specs[f"{p}.mlp.down_proj.weight"] = ((h, dense), ("normal", 0.1))
            continue
        specs[f"{p}.mlp.gate.weight"] = ((experts, h), ("normal", 0.3))
        for e in range(experts):
            for proj, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
                specs[f"{p}.mlp.experts.{e}.{proj}_proj.weight"] = (shape, ("normal", 0.1))
    return write_tiny_model("Qwen3MoeForCausalLM", path, config=config, specs=specs, dtype=dtype)


def quantized_moe(
    checkpoint: Path,
    path: Path,
    bits: int,
    group: int,
    dtype: str = "float32",
    mode: str = "affine",
) -> Path:
    """`checkpoint` (moe_checkpoint's) quantized as mlx_lm.convert quantizes a Qwen3-MoE:
    `mode` (affine, or mxfp4: 4 bits, groups of 32), `bits` and `group`, every linear layer,
    the experts and the embedding, the router at 8 bits affine (mlx-lm's qwen3_moe
    `quant_predicate`), the weights cast to `dtype` first (the scales come out in it);
    written as a converted model's directory at `path`."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    from runner.backend import Backend
    from runner.models import build_model
    from runner.sources.loader import load_local_dir

    config = json.loads((checkpoint / "config.json").read_text())
    mlx_only = Backend.cpu().replace(native_step_max_tokens=None)
    module = build_model(load_local_dir(checkpoint), mlx_only).module
    module.update(tree_map(lambda a: a.astype(getattr(mx, dtype)), module.parameters()))

    def quantizable(name: str, layer: Any) -> bool | dict[str, Any]:
        if not hasattr(layer, "to_quantized") or layer.weight.shape[-1] % group:
            return False
        return {"group_size": 64, "bits": 8} if name.endswith("mlp.gate") else True

    nn.quantize(module, group, bits, mode=mode, class_predicate=quantizable)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(module.parameters())))
    config["quantization"] = {"group_size": group, "bits": bits, "mode": mode}
    config["quantization"] |= {
        name: {"group_size": 64, "bits": 8, "mode": "affine"}
        for name, layer in module.named_modules()
        if name.endswith("mlp.gate") and isinstance(layer, nn.QuantizedLinear)
    }
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((checkpoint / name).read_bytes())
    return path


def _k_file(
    name: str, shape: tuple[int, ...], arch: str, by_name: list[tuple[str, T]], rest: T
) -> T:
    """A K-quant file's type for a tensor whose rows are whole blocks of 256: Q6_K for the head,
    the first of `by_name` whose key the name holds, else `rest`; `mixed` elsewhere."""
    if len(shape) == 2 and shape[-1] % 256 == 0:
        if name == "output.weight":
            return T.Q6_K
        return next((kind for key, kind in by_name if key in name), rest)
    return mixed(name, shape, arch)


def _scale_min_codes(
    x: np.ndarray, top: int, scale_top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [blocks, groups, weights a group] as x = (d * sc) * q - (dmin * m) by round to
    nearest: float16 d and dmin [blocks, 1], a group's sc and m [blocks, groups] (uint8, at
    most scale_top), codes q (uint8, at most top) shaped as x."""
    low = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - low) / top
    d = (step.max(-1, keepdims=True) / scale_top).astype(np.float16)
    dmin = (-low.min(-1, keepdims=True) / scale_top).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.ceil(step / np.where(d32 > 0, d32, 1)), 0, scale_top).astype(np.uint8)
    m = np.clip(np.rint(-low / np.where(dmin32 > 0, dmin32, 1)), 0, scale_top).astype(np.uint8)
    scale = (d32 * sc.astype(np.float32))[..., None]
    offset = (dmin32 * m.astype(np.float32))[..., None]
    q = np.clip(np.rint((x + offset) / np.where(scale > 0, scale, 1)), 0, top).astype(np.uint8)
    return d, dmin, sc, m, q


def _k_quant(values: np.ndarray, top: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Q4_K's (top 15) or Q5_K's (top 31) plain round-to-nearest quantizer of `values` [..., k]
    (k a multiple of 256) as x = (d * sc_j) * q - (dmin * m_j): the codes q [blocks, 8
    sub-blocks, 32] (uint8), and each block's bytes before them: float16 d and dmin, then 12
    bytes of 6-bit scales and mins as llama.cpp's get_scale_min_k4 reads them."""
    x = values.reshape(-1, 8, 32).astype(np.float32)  # [blocks, 8 sub-blocks, 32]
    d, dmin, sc, m, q = _scale_min_codes(x, top, 63)
    packed = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            m[:, :4] | (m[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4,
        ],
        axis=1,
    ).astype(np.uint8)
    head = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed]
    return q, head


def _nibbles(q: np.ndarray) -> np.ndarray:
    """qs[128] of each block from codes [blocks, 8, 32] below 16: in chunk c, weight 64c + l
    in the low nibble of byte 32c + l, 64c + 32 + l in its high one."""
    q = q.reshape(-1, 4, 2, 32)  # [blocks, chunk c, half, l]
    return (q[:, :, 0] | q[:, :, 1] << 4).astype(np.uint8).reshape(-1, 128)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K blocks of `values` [..., k] (k a multiple of 256) as bytes [..., k / 256 * 144],
    laid out as llama.cpp's block_q4_K (float16 d and dmin, 12 bytes of 6-bit scales and
    mins, 128 bytes of nibbles): a plain round-to-nearest quantizer (`_k_quant`), which is all
    a test needs."""
    lead, k = values.shape[:-1], values.shape[-1]
    q, head = _k_quant(values, 15)
    return np.concatenate([*head, _nibbles(q)], axis=1).reshape(*lead, k // 256 * 144)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """Q5_K blocks of `values` [..., k] (k a multiple of 256) as bytes [..., k / 256 * 176],
    laid out as llama.cpp's block_q5_K: Q4_K's d, dmin and 6-bit scales and mins, then qh[32]
    (bit 2c of qh[l]: the fifth bit of weight 64c + l, bit 2c + 1: of weight 64c + 32 + l),
    then Q4_K's nibbles of the codes' low 4 bits; codes below 32, the same quantizer."""
    lead, k = values.shape[:-1], values.shape[-1]
    q, head = _k_quant(values, 31)
    qh = sum(((q[:, j] >> 4) & 1).astype(np.uint8) << j for j in range(8)).astype(np.uint8)
    out = np.concatenate([*head, qh, _nibbles(q & 15)], axis=1)
    return out.reshape(*lead, k // 256 * 176)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Q6_K blocks of `values` [..., k] (k a multiple of 256) as bytes [..., k / 256 * 210],
    laid out as llama.cpp's block_q6_K (ql, qh, int8 scales, float16 d): a plain
    round-to-nearest quantizer (not llama.cpp's search), which is all a test needs."""
    lead, k = values.shape[:-1], values.shape[-1]
    x = values.reshape(-1, 16, 16).astype(np.float32)  # [blocks, 16 groups, 16]
    group_scale = np.abs(x).max(-1) / 31  # weights in [-32, 31] * scale
    d = (group_scale.max(-1, keepdims=True) / 127).astype(np.float16)  # [blocks, 1]
    d32 = d.astype(np.float32)
    # rounded up, so that no weight needs a code past 31
    sc = np.where(d32 > 0, np.ceil(group_scale / np.where(d32 > 0, d32, 1)), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = (d32 * sc.astype(np.float32))[..., None]
    q = np.clip(np.rint(x / np.where(step != 0, step, 1)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [blocks, half, quarter s, l]: weight 128h + 32s + l
    low = q & 15  # ql[l]: quarter 0's low bits, quarter 2's above; ql[32 + l]: 1's and 3's
    ql = np.concatenate([low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4], -1)
    qh = sum((q[:, :, s] >> 4) << (2 * s) for s in range(4)).astype(np.uint8)
    out = np.concatenate(
        [
            ql.astype(np.uint8).reshape(-1, 128),
            qh.reshape(-1, 64),
            sc.view(np.uint8).reshape(-1, 16),
            d.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return out.reshape(*lead, k // 256 * 210)


def _two_bits(q: np.ndarray) -> np.ndarray:
    """qs[64] of each block from codes [blocks, 256] below 4: weight 128h + 32s + l in bits
    2s, 2s + 1 of byte 32h + l."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [blocks, half h, s, l]
    return sum(q[:, :, s] << (2 * s) for s in range(4)).astype(np.uint8).reshape(-1, 64)


def quantize_q3_k(values: np.ndarray) -> np.ndarray:
    """Q3_K blocks of `values` [..., k] (k a multiple of 256) as bytes [..., k / 256 * 110],
    laid out as llama.cpp's block_q3_K (hmask[32], qs[64], 12 bytes of sixteen 6-bit scales,
    float16 d): x = (d * (sc - 32)) * q, q in [-4, 3], stored as its low 2 bits and a third bit
    set where q >= 0; a plain round-to-nearest quantizer."""
    lead, k = values.shape[:-1], values.shape[-1]
    x = values.reshape(-1, 16, 16).astype(np.float32)  # [blocks, 16 groups, 16]
    group_scale = np.abs(x).max(-1) / 4  # weights in [-4, 3] * scale
    d = (group_scale.max(-1, keepdims=True) / 31).astype(np.float16)
    d32 = d.astype(np.float32)
    sc = np.clip(np.rint(group_scale / np.where(d32 > 0, d32, 1)), 0, 31).astype(np.int32)
    step = (d32 * sc.astype(np.float32))[..., None]
    q = np.clip(np.rint(x / np.where(step != 0, step, 1)), -4, 3).astype(np.int32) + 4
    q = q.reshape(-1, 256)  # q + 4 in [0, 7]
    high = (q >> 2).reshape(-1, 2, 4, 32)  # [blocks, h, s, l]: bit 4h + s of hmask[l]
    hmask = sum(high[:, h, s] << (4 * h + s) for h in range(2) for s in range(4))
    six = (sc + 32).astype(np.uint8)  # sc_j + 32, 6 bits
    low, top = six & 15, six >> 4
    packed = np.concatenate(
        [
            low[:, :8] | low[:, 8:] << 4,  # bytes 0-7: sc_j's low bits, j and j + 8
            sum(top[:, 4 * i : 4 * i + 4] << (2 * i) for i in range(4)),  # 8-11: high bits
        ],
        axis=1,
    ).astype(np.uint8)
    out = np.concatenate(
        [hmask.astype(np.uint8), _two_bits(q & 3), packed, d.view(np.uint8).reshape(-1, 2)],
        axis=1,
    )
    return out.reshape(*lead, k // 256 * 110)


def quantize_q2_k(values: np.ndarray) -> np.ndarray:
    """Q2_K blocks of `values` [..., k] (k a multiple of 256) as bytes [..., k / 256 * 84],
    laid out as llama.cpp's block_q2_K (scales[16]: a 4-bit scale and min each, qs[64],
    float16 d and dmin): x = (d * sc) * q - dmin * m, q in [0, 3]; a plain round-to-nearest
    quantizer."""
    lead, k = values.shape[:-1], values.shape[-1]
    x = values.reshape(-1, 16, 16).astype(np.float32)  # [blocks, 16 groups, 16]
    d, dmin, sc, m, q = _scale_min_codes(x, 3, 15)
    out = np.concatenate(
        [
            sc | m << 4,
            _two_bits(q.reshape(-1, 256)),
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return out.reshape(*lead, k // 256 * 84)


IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)  # llama.cpp's kvalues_iq4nl


def quantize_iq4_xs(values: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks of `values` [..., k] (k a multiple of 256) as bytes [..., k / 256 * 136],
    laid out as llama.cpp's block_iq4_xs (float16 d, scales_h, scales_l[4], qs[128]): x =
    (d * (ls - 32)) * IQ4_VALUES[index] per 32 weights, each index the nearest table value; a
    plain quantizer (not llama.cpp's search)."""
    lead, k = values.shape[:-1], values.shape[-1]
    x = values.reshape(-1, 8, 32).astype(np.float32)  # [blocks, 8 sub-blocks, 32]
    wanted = np.abs(x).max(-1) / 127  # each sub-block's step
    d = (wanted.max(-1, keepdims=True) / 31).astype(np.float16)
    d32 = d.astype(np.float32)
    ls = np.clip(np.rint(wanted / np.where(d32 > 0, d32, 1)), 0, 31).astype(np.int32) + 32
    step = (d32 * (ls - 32).astype(np.float32))[..., None]
    scaled = x / np.where(step != 0, step, 1)
    index = np.abs(scaled[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)  # [.., 8, 32]
    qs = (index[..., :16] | index[..., 16:] << 4).reshape(-1, 128)
    high = sum(((ls[:, b] >> 4) & 3) << (2 * b) for b in range(8)).astype("<u2")
    low = (ls & 15).astype(np.uint8)
    out = np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            high.reshape(-1, 1).view(np.uint8),
            low[:, 0::2] | low[:, 1::2] << 4,
            qs,
        ],
        axis=1,
    )
    return out.reshape(*lead, k // 256 * 136)


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of `values` [..., k] (k a multiple of 32) as bytes [..., k / 32 * 18], laid
    out as llama.cpp's block_iq4_nl (float16 d, qs[16]: weight l the low nibble of qs[l],
    16 + l its high one): x = d * IQ4_VALUES[index], d = max |x| / 127 of the block, each
    index the nearest table value; a plain quantizer (not llama.cpp's search)."""
    lead, k = values.shape[:-1], values.shape[-1]
    x = values.reshape(-1, 32).astype(np.float32)
    d = (np.abs(x).max(-1, keepdims=True) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    scaled = x / np.where(d32 > 0, d32, 1)
    index = np.abs(scaled[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    qs = index[:, :16] | index[:, 16:] << 4
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1)
    return out.reshape(*lead, k // 32 * 18)


# The grid i-quants: about the largest value a block holds, in units of its d
GRID_REACH = {
    T.IQ2_XXS: 160, T.IQ2_XS: 160, T.IQ2_S: 160, T.IQ3_XXS: 480, T.IQ3_S: 460, T.IQ1_S: 17,
    T.IQ1_M: 17,
}  # fmt: skip


def grid_blocks(values: np.ndarray, ggml_type: T) -> np.ndarray:
    """Blocks of a grid i-quant (GRID_REACH) the shape of `values` [..., k] (k a multiple of
    256) as bytes [..., k / 256 * bytes a block]: random grid indices, signs and scales
    (seeded by the values' bytes), each block's d sized to its largest |value|. Not a
    quantization of the values (llama.cpp's quantizers for these types want an importance
    matrix): the products and models are tested on whatever values the blocks hold, as
    llama.cpp's dequantization gives them."""
    size, reach = gguf.GGML_QUANT_SIZES[ggml_type][1], GRID_REACH[ggml_type]
    lead, k = values.shape[:-1], values.shape[-1]
    x = values.reshape(-1, 256).astype(np.float32)
    rng = np.random.default_rng(zlib.crc32(x.tobytes()))
    out = rng.integers(0, 256, size=(len(x), size), dtype=np.uint8)
    d = (np.abs(x).max(-1) / reach).astype(np.float16).view(np.uint16)
    if ggml_type == T.IQ1_M:  # d's nibbles the top ones of the four scale words
        words = out[:, 48:56].copy().view("<u2")
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 15) << 12)
        out[:, 48:56] = words.view(np.uint8)
    else:
        out[:, 0:2] = d.astype("<u2").reshape(-1, 1).view(np.uint8)
    return out.reshape(*lead, k // 256 * size)


QUANTIZERS = {
    T.Q6_K: quantize_q6_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k,
    T.Q3_K: quantize_q3_k, T.Q2_K: quantize_q2_k, T.IQ4_XS: quantize_iq4_xs,
    T.IQ4_NL: quantize_iq4_nl,
    **{t: functools.partial(grid_blocks, ggml_type=t) for t in GRID_REACH},
}  # fmt: skip


def gguf_metadata(model_dir: Path) -> tuple[str, dict[str, Any]]:
    """The GGUF architecture and the `{arch}.*` metadata (keys without the prefix) the
    converter writes for the checkpoint in `model_dir`."""
    config = json.loads((model_dir / "config.json").read_text())
    conversion = CONVERSIONS[config["architectures"][0]]
    return conversion.arch, conversion.metadata(config)


def gguf_tensors(model_dir: Path) -> list[tuple[str, np.ndarray]]:
    """The float32 tensors the converter writes for the checkpoint in `model_dir`, under
    their GGUF names, with its changes made."""
    config = json.loads((model_dir / "config.json").read_text())
    conversion = CONVERSIONS[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights = {
        k: v.astype(np.float32) for k, v in load_file(str(model_dir / "model.safetensors")).items()
    }
    out: list[tuple[str, np.ndarray]] = list(_extra_tensors(config))
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, values in sorted(weights.items()):
        if conversion.arch == "gemma2" and name == "lm_head.weight":
            continue  # Gemma2Model.filter_tensors: always tied
        if name == "model.embed_tokens.weight" and conversion.arch == "gemma3":
            values = values[: _tokenizer_size(model_dir)]  # Gemma3Model: OOV rows removed
        if conversion.plus_one and name.endswith("norm.weight"):
            values = values + np.float32(1)
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match and ".experts." in name:
            experts.setdefault(match.group(1), {})[match.group(2)] = values
            continue
        gname = _gguf_name(name, conversion)
        if conversion.permuted and gname.endswith(("attn_q.weight", "attn_q.bias")):
            values = _permute(values, heads)
        if conversion.permuted and gname.endswith(("attn_k.weight", "attn_k.bias")):
            values = _permute(values, kv_heads)
        out.append((gname, values))
    for layer, parts in sorted(experts.items(), key=lambda item: int(item[0])):
        out += _expert_tensors(int(layer), parts, conversion)
    return out


def _expert_tensors(
    layer: int, parts: dict[str, np.ndarray], conversion: Conversion
) -> list[tuple[str, np.ndarray]]:
    p = f"blk.{layer}"
    if conversion.experts == "stacked":  # Qwen2MoeModel: experts.e.proj stacked per proj
        n = 1 + max(int(k.split(".")[2]) for k in parts)
        return [
            (
                f"{p}.ffn_{proj}_exps.weight",
                np.stack([parts[f"mlp.experts.{e}.{proj}_proj.weight"] for e in range(n)]),
            )
            for proj in ("down", "gate", "up")
        ]
    # GptOssModel.modify_tensors: gate_up [E, H, 2I] transposed, gate rows ::2, up 1::2
    gate_up = parts["mlp.experts.gate_up_proj"].swapaxes(-1, -2)
    bias = parts["mlp.experts.gate_up_proj_bias"]
    return [
        (
            f"{p}.ffn_down_exps.weight",
            np.ascontiguousarray(parts["mlp.experts.down_proj"].swapaxes(-1, -2)),
        ),
        (f"{p}.ffn_down_exps.bias", parts["mlp.experts.down_proj_bias"]),
        (f"{p}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, ::2, :])),
        (f"{p}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, 1::2, :])),
        (f"{p}.ffn_gate_exps.bias", np.ascontiguousarray(bias[..., ::2])),
        (f"{p}.ffn_up_exps.bias", np.ascontiguousarray(bias[..., 1::2])),
    ]


def _extra_tensors(config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """generate_extra_tensors: llama's rope_freqs, Phi-3's rope factors."""
    rope = config.get("rope_parameters") or {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if rope.get("rope_type") == "llama3":
        return [("rope_freqs.weight", _llama3_factors(rope, head_dim))]
    if config["architectures"][0] == "Phi3ForCausalLM" and rope.get("long_factor"):
        return [
            ("rope_factors_long.weight", np.array(rope["long_factor"], np.float32)),
            ("rope_factors_short.weight", np.array(rope["short_factor"], np.float32)),
        ]
    return []


def _tokenizer_size(model_dir: Path) -> int:
    """Gemma3Model's n_vocab_real: the tokenizer.json's vocabulary plus its added tokens."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    return len(spec["model"]["vocab"]) + len(spec["added_tokens"])


Edit = Callable[
    [str, dict[str, Any], list[tuple[str, np.ndarray]]],
    tuple[str, dict[str, Any], list[tuple[str, np.ndarray]]],
]


def write_gguf(
    model_dir: Path,
    out: Path,
    rule: Rule = float32,
    *,
    ollama: bool = False,
    edit: Edit | None = None,
) -> Path:
    """The GGUF llama.cpp's converter would write for the tiny checkpoint in `model_dir`, each
    tensor stored as `rule` says; `ollama`: as Ollama's own converter published it; `edit`
    changes (architecture, metadata, float32 tensors) before they are written."""
    arch, metadata = gguf_metadata(model_dir)
    tensors = gguf_tensors(model_dir)
    if ollama:
        arch, metadata, tensors = _ollama(arch, metadata, tensors)
    if edit is not None:
        arch, metadata, tensors = edit(arch, metadata, tensors)
    writer = gguf.GGUFWriter(str(out), arch)
    for key, value in metadata.items():
        _add(writer, f"{arch}.{key}", value)
    _tokenizer(writer, model_dir)
    for name, values in tensors:
        kind = rule(name, values.shape, arch)
        if kind == T.F32:
            writer.add_tensor(name, values)
        elif kind == T.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            quantize = QUANTIZERS.get(kind)
            blocks = quantize(values) if quantize else gguf.quants.quantize(values, kind)
            writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and all(isinstance(v, bool) for v in value):
        writer.add_array(key, value)
    else:
        raise TypeError(f"{key}: {value!r}")


# Ollama's own spellings (llama-ollama-compat.cpp: what it renames for llama.cpp).
OLLAMA_KEYS = {
    "gemma3": {
        "rope.freq_base": "rope.global.freq_base",
        "rope.freq_base_swa": "rope.local.freq_base",
    },
    "mistral3": {
        "rope.scaling.yarn_beta_fast": "rope.scaling.beta_fast",
        "rope.scaling.yarn_beta_slow": "rope.scaling.beta_slow",
        "rope.scaling.yarn_log_multiplier": "rope.scaling.mscale_all_dim",
        "attention.temperature_scale": "rope.scaling_beta",
    },
}
# Keys Ollama's files lack, which llama.cpp then injects (gemma3: the epsilon 1e-6 and, at a
# context of 131072, linear scaling by 8; gpt-oss: the expert size and yarn).
OLLAMA_DROPPED = {
    "gemma3": ("attention.layer_norm_rms_epsilon", "rope.scaling.type", "rope.scaling.factor"),
    "gpt-oss": ("expert_feed_forward_length", "rope.scaling.type"),
}
OLLAMA_TENSORS = {
    "gpt-oss": {
        ".attn_output.": ".attn_out.",
        ".attn_sinks.weight": ".attn_sinks",
        ".post_attention_norm.": ".ffn_norm.",
    },
}


def _ollama(
    arch: str, metadata: dict[str, Any], tensors: list[tuple[str, np.ndarray]]
) -> tuple[str, dict[str, Any], list[tuple[str, np.ndarray]]]:
    """A converter-style file as Ollama published it: renamed keys and tensors, dropped keys,
    and (gemma3, mistral3) an embedded vision tower and projector."""
    renames = OLLAMA_KEYS.get(arch, {})
    dropped = OLLAMA_DROPPED.get(arch, ())
    metadata = {renames.get(k, k): v for k, v in metadata.items() if k not in dropped}
    if arch == "gpt-oss":  # converted from OpenAI's checkpoint, whose attn.qkv is one
        tensors = fuse_qkv(tensors)
    for old, new in OLLAMA_TENSORS.get(arch, {}).items():
        tensors = [(n.replace(old, new), v) for n, v in tensors]
    if arch in ("gemma3", "mistral3"):
        rng = np.random.default_rng(7)
        metadata |= {
            "vision.block_count": 1,
            "vision.embedding_length": 32,
            "mm.tokens_per_image": 4,
        }
        tensors += [
            ("v.patch_embd.weight", rng.normal(0, 0.02, (32, 3, 14, 14)).astype(np.float32)),
            ("v.blk.0.attn_q.weight", rng.normal(0, 0.02, (32, 32)).astype(np.float32)),
            ("v.blk.0.ln1.weight", np.ones(32, np.float32)),
            ("mm.mm_input_projection.weight", rng.normal(0, 0.02, (32, 64)).astype(np.float32)),
        ]
    return ("gptoss" if arch == "gpt-oss" else arch), metadata, tensors


def fuse_qkv(tensors: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's --fuse-qkv (ModelBase.modify_tensors): each layer's Q, K and V rows, as
    written (Q and K permuted for llama), in one attn_qkv; biases too where all three have
    them."""
    parts = dict(tensors)
    fused = []
    for name, values in tensors:
        match = re.fullmatch(r"(blk\.\d+\.)attn_([qkv])\.(weight|bias)", name)
        if match is None:
            fused.append((name, values))
            continue
        p, which, kind = match.groups()
        three = [parts.get(f"{p}attn_{x}.{kind}") for x in "qkv"]
        if any(t is None for t in three):
            fused.append((name, values))
        elif which == "q":
            fused.append((f"{p}attn_qkv.{kind}", np.concatenate(three)))
    return fused


def gguf_names(path: Path) -> list[str]:
    return [t.name for t in gguf.GGUFReader(str(path)).tensors]


def checkpoint_of(gguf_path: Path, like: Path, out: Path) -> Path:
    """The checkpoint whose weights are the GGUF's stored values (gguf-py's dequantization,
    the converter's changes undone, Hugging Face's names and layouts), with `like`'s config
    (its vocab_size the embedding's rows) and tokenizer. Reads the converter's files, with
    fused Q/K/V too, and Ollama's."""
    reader = gguf.GGUFReader(str(gguf_path))
    ollama = reader.fields["general.architecture"].contents() == "gptoss"
    config = json.loads((like / "config.json").read_text())
    conversion = CONVERSIONS[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    names = {v: k for k, v in TOP.items()}
    block = {v: k for k, v in conversion.block.items()}
    stored: list[tuple[str, np.ndarray]] = []
    for t in reader.tensors:
        if t.name.startswith(("rope_freqs", "rope_factors", "v.", "mm.")):
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        values = np.asarray(values, np.float32).reshape([int(d) for d in reversed(t.shape)])
        name = _from_ollama(t.name) if ollama else t.name
        fused = re.fullmatch(r"(blk\.\d+\.)attn_qkv\.(weight|bias)", name)
        if fused and "attn_qkv.weight" not in block:  # --fuse-qkv: Q, K, V rows in order
            q, k = heads * head_dim, kv_heads * head_dim
            for x, part in zip("qkv", np.split(values, [q, q + k]), strict=True):
                stored.append((f"{fused.group(1)}attn_{x}.{fused.group(2)}", part))
        else:
            stored.append((name, values))
    weights: dict[str, np.ndarray] = {}
    experts: dict[str, dict[str, np.ndarray]] = {}
    for gguf_name, values in stored:
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if match and "_exps." in match.group(2):
            experts.setdefault(match.group(1), {})[match.group(2)] = values
            continue
        if match:
            name = f"model.layers.{match.group(1)}.{block[match.group(2)]}"
        else:
            name = names[gguf_name]
        if conversion.permuted and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            values = values[unpermute_rows(heads * head_dim, heads)]
        if conversion.permuted and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            values = values[unpermute_rows(kv_heads * head_dim, kv_heads)]
        if conversion.plus_one and name.endswith("norm.weight"):
            values = values - np.float32(1)
        weights[name] = np.ascontiguousarray(values)
    for layer, parts in experts.items():
        weights |= _checkpoint_experts(f"model.layers.{layer}.mlp.experts", parts, conversion)
    config["vocab_size"] = int(weights["model.embed_tokens.weight"].shape[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like / file, out / file)
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
    return out


def _from_ollama(name: str) -> str:
    """Ollama's gpt-oss tensor names (OLLAMA_TENSORS) back to llama.cpp's."""
    name = re.sub(r"\.attn_out\.", ".attn_output.", name)
    name = re.sub(r"\.attn_sinks$", ".attn_sinks.weight", name)
    return re.sub(r"\.ffn_norm\.", ".post_attention_norm.", name)


def _checkpoint_experts(
    p: str, parts: dict[str, np.ndarray], conversion: Conversion
) -> dict[str, np.ndarray]:
    """A layer's experts as the checkpoint holds them: one tensor per expert (Qwen3-MoE), or
    transformers' GPT-OSS layout (gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H])."""
    if conversion.experts == "stacked":
        return {
            f"{p}.{e}.{proj}_proj.weight": np.ascontiguousarray(stacked[e])
            for proj in PROJECTIONS
            for stacked in [parts[f"ffn_{proj}_exps.weight"]]
            for e in range(stacked.shape[0])
        }
    gate, up = parts["ffn_gate_exps.weight"], parts["ffn_up_exps.weight"]
    gate_up = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
    gate_up[:, ::2], gate_up[:, 1::2] = gate, up
    bias = np.empty((gate.shape[0], 2 * gate.shape[1]), np.float32)
    bias[:, ::2], bias[:, 1::2] = parts["ffn_gate_exps.bias"], parts["ffn_up_exps.bias"]
    return {
        f"{p}.gate_up_proj": np.ascontiguousarray(gate_up.swapaxes(-1, -2)),
        f"{p}.gate_up_proj_bias": bias,
        f"{p}.down_proj": np.ascontiguousarray(parts["ffn_down_exps.weight"].swapaxes(-1, -2)),
        f"{p}.down_proj_bias": parts["ffn_down_exps.bias"],
    }


def _gguf_name(name: str, conversion: Conversion) -> str:
    if name in TOP:
        return TOP[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    assert match, name
    return f"blk.{match.group(1)}.{conversion.block[match.group(2)]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `LlamaModel.permute`."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _llama3_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's `rope_freqs` for a llama3 RoPE (LlamaModel.generate_extra_tensors),
    in its float32 torch arithmetic: `a / t` for a Python number a is torch's
    t.reciprocal() * a, every step rounded to float32."""
    f32 = np.float32
    base = rope["rope_theta"]
    freqs = f32(1.0) / (f32(base) ** (np.arange(0, head_dim, 2, dtype=np.float32) / f32(head_dim)))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.astype(np.float32):
        wavelen = (f32(1) / freq) * f32(2 * math.pi)
        if wavelen < context / high:
            out.append(f32(1))
        elif wavelen > context / low:
            out.append(f32(factor))
        else:
            smooth = ((f32(1) / wavelen) * f32(context) - f32(low)) / f32(high - low)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(out, np.float32)


def _tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """A byte-level BPE tokenizer.json as the converter's `_set_vocab_gpt2` writes it."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    size = max([*vocab.values(), *(t["id"] for t in added.values())]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for text, token in added.items():
        tokens[token["id"]] = text
        types[token["id"]] = (
            gguf.TokenType.CONTROL if token.get("special") else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_bos_token_id(ids[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(ids[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
