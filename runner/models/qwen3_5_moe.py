"""Qwen3.5-MoE: Qwen3.5's gated-delta and gated-attention layers (runner/models/qwen3_5.py)
with sparse mixture-of-experts MLPs (softmax router, top-k renormalised, plus a shared expert
behind a sigmoid gate) on every layer, over mlx-lm's qwen3_5 text model with MoE fields.

Served as the text model (`Qwen3_5MoeForCausalLM`, model_type qwen3_5_moe_text) and as the
image-text model (`Qwen3_5MoeForConditionalGeneration`, model_type qwen3_5_moe): its config
nests the text model's under `text_config`, its weights are under `model.language_model.`
and `model.visual.`, and its top-level `tie_word_embeddings` decides the tying, as
transformers reads it. Its images are dense Qwen3.5's (runner/models/qwen3_5_vision/:
transformers' two image-text models differ only in their text models, the vision config,
tower, processor and 3-channel rotary positions are the same). The cache layout is
Qwen3.5's: recurrent on linear-attention layers, KV on full-attention layers.

Where mlx-lm reads a transformers 5 config or checkpoint differently, this adapter follows
transformers (on top of what runner/models/qwen3_5.py fixes):
- transformers always renormalises the top-k weights; mlx-lm's `norm_topk_prob` is pinned
  to that;
- checkpoints store experts per expert (`experts.<e>.<proj>.weight`, as transformers 5
  saves them) or fused (`experts.gate_up_proj`, `experts.down_proj`); mlx-lm's text model
  stacks neither, so both are turned into its switch layers here (runner/models/moe.py);
- mlx-lm's defaults are replaced by transformers' Qwen3_5MoeTextConfig's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.models.config import integer
from runner.models.decoder import DecoderModel
from runner.models.moe import check_routing, gather_in_float32, split_gate_up, stack_experts
from runner.models.qwen3_5 import build_text_module, image_text_weights
from runner.models.qwen3_5_vision.model import Qwen3_5ImageModel, VisionWeights
from runner.models.registry import register

# transformers 5 Qwen3_5MoeTextConfig defaults, where mlx-lm's differ.
QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _TextModel(qwen3_5.TextModel):
    """mlx-lm's Qwen3.5 text model, reading the experts of a Hugging Face checkpoint."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = split_gate_up(weights)
        weights = stack_experts(weights, self.args.num_experts, _PROJECTIONS)
        return super().sanitize(weights)


class _ConditionalTextModel(_TextModel):
    """The text model of `Qwen3_5MoeForConditionalGeneration`'s checkpoint."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(image_text_weights(weights))


def _build(config: dict[str, Any], module_class: type[_TextModel]) -> nn.Module:
    c = {**QWEN3_5_MOE_DEFAULTS, **config}
    c["num_experts"], _ = check_routing(c)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        integer(c[key], key)
    c["norm_topk_prob"] = True  # transformers' router always renormalises
    c["decoder_sparse_step"] = 1  # every layer is MoE
    # no dense MLP anywhere: transformers' config has no intermediate_size
    return build_text_module(c, module_class, nullable=("intermediate_size",))


class _Qwen3_5MoeBase(DecoderModel):
    DEFAULT_CONTEXT = 32768
    KERNELS = Kernels(attention=(qwen3_5.Attention,), swiglu=(qwen3_next.Qwen3NextMLP,))

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        super().__init__(module, config, architecture, backend)
        gather_in_float32(module, backend)


@register("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")
class Qwen3_5Moe(_Qwen3_5MoeBase):
    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        return _build(config, _TextModel)


class _VisionTextModel(VisionWeights, _ConditionalTextModel):
    """The image-text checkpoint's text model beside the tower (`visual`)."""


@register("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")
class Qwen3_5MoeMultimodal(Qwen3_5ImageModel, _Qwen3_5MoeBase):
    """Qwen3.5-MoE with images: the image side's `__init__` hands the text config on to
    `_Qwen3_5MoeBase`'s (its experts gather in float32)."""

    KERNELS = _Qwen3_5MoeBase.KERNELS

    @classmethod
    def build_text_module(cls, text_config: dict[str, Any]) -> nn.Module:
        return _build(text_config, _VisionTextModel)
