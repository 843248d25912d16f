"""Qwen3_5ForCausalLM (model_type qwen3_5_text) over mlx-lm's qwen3_5 text model: gated-delta
(linear attention, recurrent cache) layers mixed with gated full-attention layers.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- layer kinds come from `layer_types` (else `full_attention_interval`, default 4); mlx-lm
  only knows the interval, so the layers are rebuilt per kind;
- RoPE: only `rope_type` "default" is accepted (transformers would use another type's
  frequencies; mlx-lm would not); `mrope_section` / `mrope_interleaved` change nothing for
  text, where the three position streams are equal, so the rope is plain partial RoPE over
  `partial_rotary_factor` (default 0.25) of head_dim;
- mlx-lm's defaults (rope_theta 100000, 64 value heads, head_dim hidden/heads, ...) are
  replaced by transformers' (rope_theta 10000, 32 value heads, head_dim 256, ...).
mlx-lm's `sanitize` turns the zero-centred RMSNorm weights of a Hugging Face checkpoint
(detected by its conv1d layout) into plain scales, and keeps `A_log` float32 on casts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5

from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    check_decoder,
    check_layer_kinds,
    check_rope,
    hf_rope_parameters,
    integer,
    json_object,
    require,
)
from runner.models.decoder import DecoderModel
from runner.models.registry import register
from runner.sources.source import ModelLoadError

LINEAR = "linear_attention"
# The gated-delta layers' sizes.
LINEAR_SIZES = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)

# transformers 5 Qwen3_5TextConfig defaults, where mlx-lm's differ.
QWEN3_5_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
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
}


def _rebuild_layers(module: nn.Module, args: qwen3_5.TextModelArgs, kinds: list[str]) -> None:
    """mlx-lm decides a layer's kind by `full_attention_interval`; build each from `kinds`."""
    n = len(kinds)
    as_full = dataclasses.replace(args, full_attention_interval=1)  # every index is full
    as_linear = dataclasses.replace(args, full_attention_interval=n + 1)  # every index linear
    inner = module.model
    inner.layers = [
        qwen3_5.DecoderLayer(as_full if kind == FULL else as_linear, i)
        for i, kind in enumerate(kinds)
    ]
    # the layer whose cache builds the mask for each kind (mlx-lm assumes interval positions)
    inner.fa_idx = kinds.index(FULL) if FULL in kinds else None
    inner.ssm_idx = kinds.index(LINEAR) if LINEAR in kinds else None


@register("Qwen3_5ForCausalLM", "qwen3_5_text")
class Qwen3_5(DecoderModel):
    DEFAULT_CONTEXT = 32768
    KERNELS = Kernels(attention=(qwen3_5.Attention,), swiglu=(qwen3_5.MLP,))

    @classmethod
    def build_module(
        cls, config: dict[str, Any], module_class: type[qwen3_5.TextModel] = qwen3_5.TextModel
    ) -> nn.Module:
        c = {**QWEN3_5_DEFAULTS, **config}
        if c.get("num_experts"):
            raise ModelLoadError("num_experts: Qwen3.5 MoE is a different architecture")
        return build_text_module(c, module_class)


# The image-text checkpoints' prefixes: the text model's, and the parts that are not text
# (the vision tower, the multi-token-prediction head), which are not loaded.
IMAGE_TEXT_PREFIX = "model.language_model."
NOT_TEXT = ("model.visual.", "mtp.")


def image_text_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """An image-text checkpoint's text weights, named as the text model's."""
    text = {}
    for name, value in weights.items():
        if name.startswith(NOT_TEXT):
            continue
        if name.startswith(IMAGE_TEXT_PREFIX):
            name = "model." + name.removeprefix(IMAGE_TEXT_PREFIX)
        text[name] = value
    return text


def image_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The image-text config's text model config, tied as its top level says (transformers'
    default: untied)."""
    text = dict(json_object(config.get("text_config"), "text_config"))
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", False)
    return text


class ImageTextModel(qwen3_5.TextModel):
    """The text model of `Qwen3_5ForConditionalGeneration`'s checkpoint (the tower is
    runner/models/qwen3_5_vision/vision.py's)."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(image_text_weights(weights))


def build_text_module(
    c: dict[str, Any], module_class: type[qwen3_5.TextModel], nullable: tuple[str, ...] = ()
) -> qwen3_5.TextModel:
    """The mlx-lm text model of `module_class` for `c` (a config with its family's defaults
    filled in), checked first; `nullable` as `check_decoder`'s. Qwen3.5-MoE builds on it."""
    require(c, "hidden_act", "silu")  # MLP and the gated-delta conv activation
    rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
    if rope["rope_type"] != "default":
        raise ModelLoadError(f"rope_parameters.rope_type {rope['rope_type']!r} not supported")
    rope.setdefault("partial_rotary_factor", 0.25)
    check_rope(rope)
    check_decoder(c, nullable=nullable, rotary_fraction=rope["partial_rotary_factor"])
    for key in LINEAR_SIZES:
        integer(c[key], key)
    if c["linear_num_value_heads"] % c["linear_num_key_heads"]:
        raise ModelLoadError(
            f"config.json: linear_num_value_heads {c['linear_num_value_heads']} is not a "
            f"multiple of linear_num_key_heads {c['linear_num_key_heads']}"
        )
    n = c["num_hidden_layers"]
    # mlx-lm divides by the interval even where layer_types decides
    interval = integer(c.get("full_attention_interval", 4), "full_attention_interval")
    kinds = c.get("layer_types")
    if kinds is None:
        kinds = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    check_layer_kinds(kinds, (FULL, LINEAR), n)
    c["rope_parameters"] = {
        "type": "default",
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
    }
    args = qwen3_5.TextModelArgs.from_dict(c)
    module = module_class(args)
    _rebuild_layers(module, args, list(kinds))
    return module
