"""Glm4MoeLiteForCausalLM (model_type glm4_moe_lite) over mlx-lm's glm4_moe_lite: multi-head
latent attention (MLA) and a mixture of experts with a shared expert after dense layers.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- which layers are MoE comes from `mlp_layer_types` ("dense" / "sparse"; default one dense
  layer, then sparse); mlx-lm reads `first_k_dense_replace` / `moe_layer_freq`, which
  transformers 5 does not write;
- the q and kv latent norms use RMSNorm's own eps (1e-6), not `rms_norm_eps`;
- RoPE is interleaved only with `rope_interleave` (default true; mlx-lm always interleaves),
  from `rope_parameters`;
- routing is transformers' in float32: the top `topk_group` groups by the sum of their two
  best corrected scores, the others excluded (mlx-lm sets them to 0, which a negative
  correction bias can still beat), and the weights normalised also for a single expert;
- the head is tied iff `tie_word_embeddings` (mlx-lm always has `lm_head`).

The KV cache holds the latent keys ([latent] as keys, [rope part] as values) as the Go runner
does (docs/DESIGN.md §3.1 snapshots them like any KV cache). mlx-lm's attention scores the
rope part against every cached position itself, so rows cannot run over a shared prefix that
keeps only their suffixes: the cache's kind says it does not batch, and scoring runs such
rows one by one (runner/score/scorer.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import glm4_moe_lite as glm
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from runner.backend.install import Kernels
from runner.cache.kinds import KVKind
from runner.models.config import (
    check_decoder,
    flag,
    hf_rope_parameters,
    integer,
    mlx_rope,
    number,
    require,
)
from runner.models.decoder import DecoderModel, FloatSwitchGLU, switch_mlp_weights
from runner.models.quantized import dequantize_weight
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

# transformers 5 Glm4MoeLiteConfig defaults (mlx-lm's agree except where keys are new).
GLM4_MOE_LITE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.8,
    "kv_lora_rank": 512,
    "q_lora_rank": 768,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
}
_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default
_MLP_KINDS = ("dense", "sparse")
_SIZES = (
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
)


class LatentKVKind(KVKind):
    """The KV kind of an MLA cache: snapshots and restores as KV, never batched."""

    name = "latent kv"
    batches = False

    def broadcast(self, cache: Any, batch: int) -> Any:
        raise NotImplementedError("latent (MLA) caches cannot be batched over a shared prefix")


LATENT_KV = LatentKVKind()


class LatentKVCache(KVCache):
    """mlx-lm's KVCache holding [latent] as keys and the roped key part as values."""

    prefix_kind = LATENT_KV


class _Router(glm.MoEGate):
    """transformers' Glm4MoeLiteTopkRouter, in float32."""

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self.n_group > 1 and self.topk_group < self.n_group:
            grouped = mx.unflatten(choice, -1, (self.n_group, -1))
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [..., n_group]
            k = self.n_group - self.topk_group
            dropped = mx.argpartition(group_scores, kth=k - 1, axis=-1)[..., :k]
            keep = mx.put_along_axis(
                mx.ones_like(group_scores), dropped, mx.array(0.0, mx.float32), axis=-1
            )
            keep = mx.repeat(keep, choice.shape[-1] // self.n_group, axis=-1)
            choice = mx.where(keep > 0, choice, mx.array(-mx.inf, mx.float32))
        inds = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, weights * self.routed_scaling_factor


class _Model(glm.Model):
    def __init__(self, args: glm.ModelArgs, mlp_kinds: list[str], interleave: bool, tied: bool):
        super().__init__(args)
        rope = initialize_rope(
            args.qk_rope_head_dim,
            args.rope_theta,
            interleave,
            args.rope_scaling,
            args.max_position_embeddings,
        )
        for layer, kind in zip(self.model.layers, mlp_kinds, strict=True):
            attn = layer.self_attn
            attn.rope = rope
            attn.kv_a_layernorm = nn.RMSNorm(args.kv_lora_rank, eps=_LATENT_NORM_EPS)
            if args.q_lora_rank is not None:
                attn.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=_LATENT_NORM_EPS)
            layer.mlp = glm.Glm4MoeLiteMoE(args) if kind == "sparse" else glm.Glm4MoeLiteMLP(args)
            if kind == "sparse":
                layer.mlp.gate = _Router(args)
                experts = int(args.n_routed_experts or 0)  # checked positive at build
                layer.mlp.switch_mlp = FloatSwitchGLU(
                    args.hidden_size, args.moe_intermediate_size, experts
                )
        self.hf_tied = tied
        if tied:
            del self.lm_head

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.hf_tied:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        elif "lm_head.weight" not in weights:
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        return super().sanitize(self._dense_kv_b(switch_mlp_weights(weights)))

    def _dense_kv_b(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A quantized `kv_b_proj`, dequantized: mlx-lm would split it into per-head key and
        value parts quantized again along other axes, which no longer computes the same."""
        for i in range(self.args.num_hidden_layers):
            p = f"model.layers.{i}.self_attn.kv_b_proj"
            if f"{p}.scales" in weights:
                weights[f"{p}.weight"] = dequantize_weight(weights, p, self.args.kv_lora_rank)
        return weights

    def make_cache(self) -> list[Any]:
        return [LatentKVCache() for _ in self.model.layers]

    @property
    def cast_predicate(self) -> Any:
        # transformers keeps the router's weight and correction bias in float32
        return lambda k: "e_score_correction_bias" not in k and not k.endswith("mlp.gate.weight")


def _mlp_kinds(c: dict[str, Any]) -> list[str]:
    n = c["num_hidden_layers"]
    kinds = c.get("mlp_layer_types")
    if kinds is None:
        return ["dense"] + ["sparse"] * (n - 1)
    if (
        not isinstance(kinds, list)
        or len(kinds) != n
        or not all(isinstance(k, str) and k in _MLP_KINDS for k in kinds)
    ):
        raise ModelLoadError(
            f"config.json: mlp_layer_types must give dense or sparse for each of the {n} "
            f"layers, not {show(kinds)}"
        )
    return kinds


def _check_experts(c: dict[str, Any]) -> None:
    experts, groups = c["n_routed_experts"], c["n_group"]
    if experts % groups or experts // groups < 2:
        raise ModelLoadError(
            f"config.json: n_routed_experts {experts} must be a multiple of n_group {groups} "
            "with at least 2 experts in each group"
        )
    if c["topk_group"] > groups:
        raise ModelLoadError(
            f"config.json: topk_group {c['topk_group']} is more than n_group {groups}"
        )
    if c["num_experts_per_tok"] > c["topk_group"] * (experts // groups):
        raise ModelLoadError(
            f"config.json: num_experts_per_tok {c['num_experts_per_tok']} is more than the "
            f"{c['topk_group'] * (experts // groups)} experts of the chosen groups"
        )


@register("Glm4MoeLiteForCausalLM", "GLM4MoeLite", "glm4_moe_lite")
class Glm4MoeLite(DecoderModel):
    DEFAULT_CONTEXT = 202752
    KERNELS = Kernels(swiglu=(glm.Glm4MoeLiteMLP,))  # the MLA attention is not sdpa-shaped

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**GLM4_MOE_LITE_DEFAULTS, **config}
        # transformers' head_dim is an alias of qk_rope_head_dim (the rotated part), and
        # wins when a config has both
        c["qk_rope_head_dim"] = c["head_dim"] = c.get("head_dim", c["qk_rope_head_dim"])
        check_decoder(c)
        for key in _SIZES:
            integer(c[key], key)
        if c.get("q_lora_rank") is not None:
            integer(c["q_lora_rank"], "q_lora_rank")
        if c["num_key_value_heads"] != c["num_attention_heads"]:
            # every head has its own expanded key; transformers cannot repeat them
            raise ModelLoadError(
                f"config.json: num_key_value_heads {c['num_key_value_heads']} must equal "
                f"num_attention_heads {c['num_attention_heads']} (latent attention)"
            )
        number(c["routed_scaling_factor"], "routed_scaling_factor")
        flag(c["norm_topk_prob"], "norm_topk_prob")
        interleave = flag(c["rope_interleave"], "rope_interleave")
        require(c, "hidden_act", "silu")
        _check_experts(c)
        kinds = _mlp_kinds(c)
        rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        c["rope_theta"], c["rope_scaling"] = mlx_rope(rope)
        c.pop("rope_parameters", None)
        args = glm.ModelArgs.from_dict(c)
        return _Model(args, kinds, interleave, c["tie_word_embeddings"])
