"""LagunaForCausalLM (model_type laguna) over mlx-lm's laguna: sliding-window and global
attention layers with per-head softplus output gates and per-layer head counts, dense and
MoE (sigmoid router, shared expert) MLPs.

Caches (docs/DESIGN.md §3.1): rotating on sliding layers, KV otherwise.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- `attention_bias` gives all four projections biases (mlx-lm: `qkv_bias` for q/k/v);
- the router scores with a sigmoid (transformers has no other score function);
- RoPE per layer kind from `rope_parameters[kind]` with its own `partial_rotary_factor`,
  and transformers' defaults (global: theta 500000 over half the head; sliding: 10000);
- masks per layer kind (mlx-lm needs a global layer to exist);
- defaults (context 131072) are transformers'.
Refused: gates other than per head (`gating` false or "per-element": transformers then gates
every channel, mlx-lm gates nothing), other activations, router weights applied on input.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import laguna
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.switch_layers import SwitchGLU

from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_layer_kinds,
    check_rope,
    flag,
    hf_rope_parameters,
    integer,
    json_object,
    number,
    require,
)
from runner.models.decoder import DecoderModel, Float32ExpertsOnCPU, run_layers
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

# transformers 5 LagunaConfig defaults, where mlx-lm's differ or are missing.
LAGUNA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 100352,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 40,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "sliding_window": 512,
    "attention_bias": False,
    "gating": True,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "moe_routed_scaling_factor": 1.0,
    "moe_apply_router_weight_on_input": False,
    "moe_router_logit_softcapping": 0.0,
}
_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    FULL: {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}
_ROPE_TYPES = ("default", "linear", "yarn")
_YARN_UNSUPPORTED = ("attention_factor", "mscale", "mscale_all_dim")


def _rope(c: dict[str, Any], kind: str) -> nn.Module:
    """The RoPE of one layer kind, rotating its `partial_rotary_factor` of each head."""
    where = f"rope_parameters.{kind}"
    nested = json_object(c.get("rope_parameters"), "rope_parameters")
    params = hf_rope_parameters(
        {"max_position_embeddings": c["max_position_embeddings"]},
        {**_DEFAULT_ROPE[kind], **json_object(nested.get(kind), where)},
        default_theta=_DEFAULT_ROPE[kind]["rope_theta"],
        where=where,
    )
    rope_type = params["rope_type"]
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(f"{where}.rope_type {rope_type!r} is not supported")
    if rope_type == "yarn":
        for key in _YARN_UNSUPPORTED:
            if params.get(key) is not None:
                raise ModelLoadError(f"{where}.{key} is not supported for yarn RoPE")
        if params.get("truncate", True) is not True:
            raise ModelLoadError(f"{where}.truncate=false is not supported for yarn RoPE")
    check_rope(params, where)
    dims = int(c["head_dim"] * params["partial_rotary_factor"])
    if dims <= 0 or dims % 2:
        raise ModelLoadError(
            f"config.json: {where} would rotate {dims} of the {c['head_dim']} dimensions of "
            "each head; it rotates pairs"
        )
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return initialize_rope(
        dims, float(params["rope_theta"]), False, scaling, c["max_position_embeddings"]
    )


def _check(c: dict[str, Any]) -> tuple[list[str], list[str], list[int]]:
    """The Laguna keys no model can have or mlx-lm cannot compute; returns the attention
    kinds, MLP kinds and head counts per layer."""
    check_decoder(c)
    require(c, "hidden_act", "silu")
    if c["gating"] not in (True, "per-head"):
        raise ModelLoadError(
            f'config.json: gating must be true or "per-head", not {show(c["gating"])}'
        )
    require(c, "moe_apply_router_weight_on_input", False)
    n = c["num_hidden_layers"]
    kinds = c.get("layer_types") or [FULL] * n
    kinds = check_layer_kinds(kinds, (FULL, SLIDING), n)
    if SLIDING in kinds:
        integer(c["sliding_window"], "sliding_window")
    mlp_kinds = c.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if (
        not isinstance(mlp_kinds, list)
        or len(mlp_kinds) != n
        or set(mlp_kinds) - {"dense", "sparse"}
    ):
        raise ModelLoadError(
            f"config.json: mlp_layer_types must give dense or sparse for each of the {n} "
            f"layers, not {show(mlp_kinds)}"
        )
    heads = c.get("num_attention_heads_per_layer") or [c["num_attention_heads"]] * n
    if not isinstance(heads, list) or len(heads) != n:
        raise ModelLoadError(
            f"config.json: num_attention_heads_per_layer must give the heads of each of the "
            f"{n} layers, not {show(heads)}"
        )
    for i, count in enumerate(heads):
        integer(count, f"num_attention_heads_per_layer[{i}]")
        if count % c["num_key_value_heads"]:
            raise ModelLoadError(
                f"config.json: layer {i}'s {count} attention heads are not a multiple of "
                f"num_key_value_heads {c['num_key_value_heads']}"
            )
    if "sparse" in mlp_kinds:
        experts = integer(c["num_experts"], "num_experts")
        integer(c["num_experts_per_tok"], "num_experts_per_tok", maximum=experts)
        integer(c["moe_intermediate_size"], "moe_intermediate_size")
        integer(c["shared_expert_intermediate_size"], "shared_expert_intermediate_size")
        number(c["moe_routed_scaling_factor"], "moe_routed_scaling_factor")
        cap = c["moe_router_logit_softcapping"]
        if cap != 0.0 and cap is not None:
            number(cap, "moe_router_logit_softcapping")
    return list(kinds), list(mlp_kinds), list(heads)


class _SwitchGLU(Float32ExpertsOnCPU, SwitchGLU):
    """mlx-lm's routed experts, computed in float32 on the CPU (see Float32ExpertsOnCPU)."""


class _LagunaModel(laguna.LagunaModel):
    def __init__(self, args: laguna.ModelArgs, kinds: list[str]):
        super().__init__(args)
        self.kinds = kinds

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        return self.norm(run_layers(self.layers, self.kinds, h, cache, self.sliding_window))


class _Model(laguna.Model):
    def __init__(self, args: laguna.ModelArgs, kinds: list[str], ropes: dict[str, nn.Module]):
        super().__init__(args)
        self.model = _LagunaModel(args, kinds)
        for layer, kind in zip(self.model.layers, kinds, strict=True):
            layer.self_attn.rope = ropes[kind]
            if isinstance(layer.mlp, laguna.MoE):
                layer.mlp.switch_mlp = _SwitchGLU(
                    args.hidden_size, args.moe_intermediate_size, args.num_experts
                )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if not self.args.tie_word_embeddings and not any(
            k.endswith("lm_head.weight") for k in weights
        ):
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        # mlx-lm moves the router's weight under gate.proj, not its quantization arrays
        weights = {
            (k.replace(".mlp.gate.", ".mlp.gate.proj.") if _router_quantization(k) else k): v
            for k, v in weights.items()
        }
        return super().sanitize(weights)


def _router_quantization(key: str) -> bool:
    return ".mlp.gate." in key and key.endswith((".gate.scales", ".gate.biases"))


@register("LagunaForCausalLM", "laguna")
class Laguna(DecoderModel):
    DEFAULT_CONTEXT = 131072
    KERNELS = Kernels(attention=(laguna.Attention,), swiglu=(laguna.MLP,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**LAGUNA_DEFAULTS, **config}
        kinds, mlp_kinds, heads = _check(c)
        flag(c["attention_bias"], "attention_bias")
        ropes = {kind: _rope(c, kind) for kind in set(kinds)}
        c |= {
            "layer_types": kinds,
            "mlp_layer_types": mlp_kinds,
            "num_attention_heads_per_layer": heads,
            "qkv_bias": c["attention_bias"],  # transformers: biases on all four or none
            "gating": True,
            "moe_router_score_func": "sigmoid",
            "moe_router_logit_softcapping": float(c["moe_router_logit_softcapping"] or 0.0),
            "rope_parameters": {},  # each layer's RoPE is set from `ropes`
        }
        return _Model(laguna.ModelArgs.from_dict(c), kinds, ropes)
