"""NemotronHForCausalLM (model_type nemotron_h) over mlx-lm's nemotron_h: Mamba2 layers mixed
with attention (no RoPE), ReLU² MLP and MoE layers. The multimodal NemotronH_Nano_VL_V2 and
NemotronH_Nano_Omni_Reasoning_V3 load their language model only: its config under
`text_config` (or the older `llm_config`), its weights under `language_model.`; the vision and
audio weights are dropped, so media requests are refused as for any text model.

Caches (docs/DESIGN.md §3.1): a recurrent cache (conv and SSM state, mlx-lm's ArraysCache)
per Mamba2 layer and a KV cache per attention layer, in layer order; MLP and MoE layers keep
no state and have no slot (mlx-lm's model skips them when it hands caches to the layers).

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- the layer kinds come from `layers_block_type` (also spelled `layer_types`, with the legacy
  names "mamba" / "attention"), else the legacy `hybrid_override_pattern` string;
- the Mamba2 time step is clamped to `time_step_limit` (legacy spelling `mamba_dt_limit`,
  which wins where both are given, as transformers' config reads them; default [0, inf];
  released configs write `[0.0, Infinity]`, which Python's json reads). `time_step_min` only
  initialises weights in transformers and is ignored here: transformers up to 5.24 clamped
  below at it instead, a bug 5.25 fixed;
- the Mamba2 projections' biases follow `use_bias` (mlx-lm: `mamba_proj_bias`), the attention
  projections have none whatever `attention_bias` says, and MoE layers always have their
  shared expert (mlx-lm only when `n_shared_experts` is set);
- the head is never tied: transformers' NemotronH declares no tied weights, so it loads
  `lm_head.weight` whatever `tie_word_embeddings` says (as mlx-lm does).
Refused: expert-group routing (`n_group` > 1: mlx-lm zeroes the dropped groups' scores where
transformers excludes them), activations other than ReLU² / SiLU, sliding windows.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import nemotron_h
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.switch_layers import SwitchMLP

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.models.config import (
    check_decoder,
    flag,
    integer,
    json_object,
    number,
    require,
)
from runner.models.decoder import DecoderModel, Float32ExpertsOnCPU
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_LEGACY_KINDS = {"mamba": MAMBA, "conv": MAMBA, "attention": ATTENTION}
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_CHAR = {kind: char for char, kind in _PATTERN.items()}

# transformers 5 NemotronHConfig defaults (mlx-lm has none: every key is required there).
NEMOTRON_H_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "tie_word_embeddings": False,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "sliding_window": None,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "time_step_limit": (0.0, math.inf),
    "use_conv_bias": True,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "use_bias": False,
    "layer_norm_epsilon": 1e-5,
}
_MAMBA_SIZES = ("ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel")
_MOE_SIZES = (
    "n_routed_experts",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "num_experts_per_tok",
)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of the multimodal checkpoints, else `config`."""
    for key in ("text_config", "llm_config"):
        if key in config:
            return json_object(config[key], key)
    return config


def layer_kinds(c: dict[str, Any]) -> list[str]:
    """transformers' `layers_block_type`, from the list or the legacy pattern string."""
    kinds = c.get("layers_block_type")
    if kinds is None:
        kinds = c.get("layer_types")
    if kinds is None:
        pattern = c.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN):
            raise ModelLoadError(
                "config.json: layers_block_type is missing and hybrid_override_pattern must "
                f"be a string of {''.join(_PATTERN)}, not {show(pattern)}"
            )
        return [_PATTERN[char] for char in pattern]
    if isinstance(kinds, list):
        kinds = [_LEGACY_KINDS.get(k, k) if isinstance(k, str) else k for k in kinds]
    if not isinstance(kinds, list) or not kinds or not all(k in _CHAR for k in kinds):
        raise ModelLoadError(
            f"config.json: layers_block_type must be a list of {', '.join(_CHAR)}, "
            f"not {show(kinds)}"
        )
    return kinds


def time_step_limit(c: dict[str, Any]) -> tuple[float, float]:
    """The Mamba2 time step's clamp: `mamba_dt_limit`, else `time_step_limit`, else [0, inf];
    two numbers, low <= high (the high end may be infinite)."""
    key = "mamba_dt_limit" if c.get("mamba_dt_limit") is not None else "time_step_limit"
    value = c.get(key)
    if value is None:
        return NEMOTRON_H_DEFAULTS["time_step_limit"]
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        and not any(math.isnan(v) for v in value)
        and value[0] <= value[1]
        and math.isfinite(value[0])
    )
    if not ok:
        raise ModelLoadError(
            f"config.json: {key} must be [low, high] with low <= high, not {show(value)}"
        )
    return float(value[0]), float(value[1])


def _check(c: dict[str, Any], kinds: list[str]) -> None:
    """The Nemotron-H keys no model can have, or that mlx-lm's layers cannot compute."""
    if c.get("num_hidden_layers") is not None:  # deprecated; the kinds decide
        integer(c["num_hidden_layers"], "num_hidden_layers")
    c["num_hidden_layers"] = len(kinds)
    c["rms_norm_eps"] = number(c["layer_norm_epsilon"], "layer_norm_epsilon")
    check_decoder(c)
    require(c, "mlp_hidden_act", "relu2")
    require(c, "sliding_window", None)
    for key in ("use_bias", "mlp_bias", "use_conv_bias", "norm_topk_prob"):
        flag(c[key], key)
    if MAMBA in kinds:
        require(c, "mamba_hidden_act", "silu")
        for key in _MAMBA_SIZES:
            integer(c[key], key)
        if c["mamba_num_heads"] % c["n_groups"]:
            raise ModelLoadError(
                f"config.json: mamba_num_heads {c['mamba_num_heads']} is not a multiple of "
                f"n_groups {c['n_groups']}"
            )
        c["time_step_limit"] = time_step_limit(c)
    if MOE in kinds:
        for key in _MOE_SIZES:
            integer(c[key], key)
        if c["num_experts_per_tok"] > c["n_routed_experts"]:
            raise ModelLoadError(
                f"config.json: num_experts_per_tok {c['num_experts_per_tok']} is more than "
                f"n_routed_experts {c['n_routed_experts']}"
            )
        if c["moe_latent_size"] is not None:
            integer(c["moe_latent_size"], "moe_latent_size")
        number(c["routed_scaling_factor"], "routed_scaling_factor")
        if c["n_group"] != 1:
            raise ModelLoadError(f"n_group={c['n_group']!r} is not supported (expected 1)")


class _SwitchMLP(Float32ExpertsOnCPU, SwitchMLP):
    """mlx-lm's routed experts, computed in float32 on the CPU (see Float32ExpertsOnCPU)."""


class _Backbone(nemotron_h.NemotronHModel):
    """mlx-lm's backbone, masks made from the first cache of each kind wherever it is."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        h = self.embeddings(inputs)
        stateful = [layer for layer in self.layers if layer.block_type in ("M", "*")]
        caches = list(cache) if cache is not None else [None] * len(stateful)
        first: dict[str, Any] = {}
        for layer, c in zip(stateful, caches, strict=True):
            first.setdefault(layer.block_type, c)
        attention_mask = create_attention_mask(h, first.get("*"))
        ssm_mask = create_ssm_mask(h, first.get("M"))
        slots = iter(caches)
        for layer in self.layers:
            c = next(slots) if layer.block_type in ("M", "*") else None
            mask = attention_mask if layer.block_type == "*" else ssm_mask
            h = layer(h, mask=mask, cache=c)
        return self.norm_f(h)


class _Model(nemotron_h.Model):
    def __init__(self, args: nemotron_h.ModelArgs, nested: bool):
        super().__init__(args)
        self.nested = nested  # the language model's weights under language_model.
        self.backbone = _Backbone(args)
        for layer in self.backbone.layers:
            if layer.block_type == "E":
                switch = layer.mixer.switch_mlp
                layer.mixer.switch_mlp = _SwitchMLP(
                    switch.fc1.weight.shape[-1],
                    int(args.moe_intermediate_size or 0),
                    int(args.n_routed_experts or 0),
                    activation=nn.ReLU2(),
                )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.nested:
            prefix = "language_model."
            weights = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        weights = _dense_router(weights, self.args.hidden_size)
        return super().sanitize(_stack_quantized_experts(weights, self.args.n_routed_experts or 0))


def _dense_router(weights: dict[str, mx.array], hidden: int) -> dict[str, mx.array]:
    """The MoE router (`mixer.gate`) is a plain matrix in mlx-lm, not a Linear that can be
    quantized: a store that quantized it anyway (affine) loads it dequantized, with the group
    size and bits read off the shapes (each row has `hidden` values)."""
    out = dict(weights)
    for key in weights:
        if not key.endswith(".mixer.gate.scales"):
            continue
        base = key.removesuffix(".scales")
        packed, scales = out.pop(f"{base}.weight"), out.pop(key)
        biases = out.pop(f"{base}.biases", None)
        bits, group = packed.shape[-1] * 32 // hidden, hidden // max(scales.shape[-1], 1)
        if (
            biases is None
            or bits * hidden != packed.shape[-1] * 32
            or group * scales.shape[-1] != hidden
        ):
            raise ModelLoadError(f"cannot read the quantization of {base}.weight")
        out[f"{base}.weight"] = mx.dequantize(packed, scales, biases, group, bits)
    return out


def _stack_quantized_experts(weights: dict[str, mx.array], experts: int) -> dict[str, mx.array]:
    """Stack per-expert quantization scales and biases as mlx-lm's sanitize stacks the
    per-expert weights (it leaves `.scales` / `.biases` behind, so quantized experts would not
    load)."""
    out = dict(weights)
    for key in weights:
        if ".mixer.experts.0." not in key or not key.endswith((".scales", ".biases")):
            continue
        prefix, _, rest = key.partition(".experts.0.")
        projection, _, part = rest.rpartition(".")
        fused = {"up_proj": "fc1", "down_proj": "fc2"}.get(projection)
        if fused is None:
            continue
        names = [f"{prefix}.experts.{e}.{projection}.{part}" for e in range(experts)]
        if all(name in out for name in names):
            out[f"{prefix}.switch_mlp.{fused}.{part}"] = mx.stack([out.pop(n) for n in names])
    return out


@register(
    "NemotronHForCausalLM",
    "NemotronH_Nano_VL_V2",
    "NemotronH_Nano_Omni_Reasoning_V3",
    "nemotron_h",
)
class NemotronH(DecoderModel):
    DEFAULT_CONTEXT = 4096
    KERNELS = Kernels(attention=(nemotron_h.NemotronHAttention,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        text = text_config(config)
        c = {**NEMOTRON_H_DEFAULTS, **text}
        kinds = layer_kinds(c)
        _check(c, kinds)
        c["hybrid_override_pattern"] = [_CHAR[kind] for kind in kinds]
        c.pop("layers_block_type", None)
        c.pop("layer_types", None)
        c["mamba_proj_bias"] = c["use_bias"]
        c["attention_bias"] = False
        c["n_shared_experts"] = 1  # transformers' MoE always has the shared expert
        args = nemotron_h.ModelArgs.from_dict(c)
        return _Model(args, nested=text is not config)

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        self.module = module
        self.config = config = text_config(config)
        self.architecture = architecture
        self.backend = backend
        self._tied = False
        self._head = module.lm_head
        self.context_length = int(config.get("max_position_embeddings") or self.DEFAULT_CONTEXT)
        self.vocab_size = int(self._head["weight"].shape[0])

    def hidden(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        return self.module.backbone(tokens, cache=caches)
