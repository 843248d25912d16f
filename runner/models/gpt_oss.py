"""GptOssForCausalLM (model_type gpt_oss) over mlx-lm's gpt_oss: attention with learned sinks
and biases, sliding-window layers alternating with full ones, and a mixture of experts on
every layer (router with a bias, top-k then softmax, experts with biases and GPT-OSS's clamped
SwiGLU). Caches: rotating on sliding layers, KV on full layers.

Where mlx-lm reads a transformers 5 config or checkpoint differently, this adapter follows
transformers:
- RoPE comes from `rope_parameters` (transformers' default: yarn, factor 32, truncate=false);
  mlx-lm reads `rope_theta`/`rope_scaling` and always truncates yarn's correction range
  (runner/models/config.py `rope_module`);
- the experts' `swiglu_alpha` and `swiglu_limit` come from the config (mlx-lm: fixed 1.702, 7);
- `attention_bias` false drops the attention biases (mlx-lm always has them);
  `tie_word_embeddings` true ties the head (mlx-lm never does);
- layer kinds come from `layer_types` as given, any mix (mlx-lm needs both kinds present);
- a transformers checkpoint stores the experts dense and input-major (`gate_up_proj`
  [E, H, 2I], gate and up interleaved; `down_proj` [E, I, H]); mlx-lm's sanitize reads only
  the original MXFP4 blocks, output-major. Both are read here; Ollama's stacked
  `experts.<proj>.weight` pass through.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss
from mlx_lm.models.activations import SwigluOAI

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_layer_kinds,
    flag,
    hf_rope_parameters,
    integer,
    number,
    rope_module,
)
from runner.models.decoder import DecoderModel, LayerKinds, layer_caches
from runner.models.moe import check_routing, gather_in_float32
from runner.models.registry import register

# transformers 5 GptOssConfig defaults for the keys mlx-lm reads differently (or not at all).
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
}
# transformers' rope when the config has none (GptOssConfig.__post_init__)
DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta


def _both_kinds(args: gpt_oss.ModelArgs) -> gpt_oss.ModelArgs:
    """`args` that mlx-lm's constructor takes: it looks up the first layer of each kind and
    fails unless both are present (the kinds themselves are applied by `_TextModel`)."""
    return dataclasses.replace(args, layer_types=[SLIDING, FULL])


class _TextModel(LayerKinds, gpt_oss.GptOssMoeModel):
    """mlx-lm's GPT-OSS model with the layer kinds as given."""

    def __init__(self, args: gpt_oss.ModelArgs, kinds: list[str], window: int | None):
        super().__init__(_both_kinds(args), kinds, window)
        self.layer_types = kinds


def _expert_weights(name: str, value: mx.array) -> dict[str, mx.array]:
    """One transformers expert tensor as mlx-lm's switch-layer weights (output-major, gate and
    up de-interleaved: views, made contiguous by `_Model.sanitize`); other names unchanged."""
    prefix, _, last = name.rpartition(".experts.")
    if not prefix.endswith(".mlp"):
        return {name: value}
    p = f"{prefix}.experts"
    if last == "gate_up_proj":
        v = value.swapaxes(-1, -2)  # [E, 2I, H]
        return {f"{p}.gate_proj.weight": v[..., ::2, :], f"{p}.up_proj.weight": v[..., 1::2, :]}
    if last == "gate_up_proj_bias":
        return {f"{p}.gate_proj.bias": value[..., ::2], f"{p}.up_proj.bias": value[..., 1::2]}
    if last == "down_proj":
        return {f"{p}.down_proj.weight": value.swapaxes(-1, -2)}
    if last == "down_proj_bias":
        return {f"{p}.down_proj.bias": value}
    return {name: value}


class _Model(gpt_oss.Model):
    def __init__(self, args: gpt_oss.ModelArgs, kinds: list[str], window: int | None, tied: bool):
        super().__init__(_both_kinds(args))
        self.model = _TextModel(args, kinds, window)
        self.hf_tied = tied
        if tied:
            del self["lm_head"]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.hf_tied:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        if any("_blocks" in k for k in weights):  # the original MXFP4 checkpoint: mlx-lm's
            return super().sanitize(weights)
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            out |= _expert_weights(name, value)
        # the experts contiguous, as mlx-lm's sanitize makes them: the native step reads them
        # in place (the views above; an import's; a no-op for a file's arrays)
        return {k: mx.contiguous(v) if ".experts." in k else v for k, v in out.items()}

    def make_cache(self) -> list[Any]:
        m = self.model
        return layer_caches(m.kinds, m.window)


def _drop_attention_bias(layers: list[Any]) -> None:
    """transformers' attention without biases (`attention_bias` false)."""
    for layer in layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out_dims, in_dims = getattr(attn, name).weight.shape
            setattr(attn, name, nn.Linear(in_dims, out_dims, bias=False))


@register("GptOssForCausalLM", "gpt_oss")
class GptOss(DecoderModel):
    DEFAULT_CONTEXT = 131072
    # the sinks go through mlx-lm's attention call (runner/backend/attention.py); no swiglu
    # kernel: GPT-OSS's experts use their own clamped activation
    KERNELS = Kernels(attention=(gpt_oss.AttentionBlock,))
    NATIVE_STEP = True  # its attention with sinks, its experts (runner/backend/native_step.py)

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        super().__init__(module, config, architecture, backend)
        gather_in_float32(module, backend)

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**GPT_OSS_DEFAULTS, **config}
        # transformers derives a null head_dim and num_key_value_heads
        check_decoder(c, nullable=("head_dim", "num_key_value_heads"))
        c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
        c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
        check_routing(c, "num_local_experts")
        alpha = number(c["swiglu_alpha"], "swiglu_alpha")
        limit = number(c["swiglu_limit"], "swiglu_limit")
        n = c["num_hidden_layers"]
        kinds = c.get("layer_types")
        if kinds is None:  # transformers: sliding first, then alternating
            kinds = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
        check_layer_kinds(kinds, (SLIDING, FULL), n)
        window = None
        if SLIDING in kinds:
            window = integer(c["sliding_window"], "sliding_window")
        params = c.get("rope_parameters") or c.get("rope_scaling") or DEFAULT_ROPE
        rope = hf_rope_parameters(c, params, default_theta=c.get("rope_theta", _DEFAULT_THETA))
        rope_layer = rope_module(rope, c["head_dim"], c["max_position_embeddings"])
        c.pop("rope_scaling", None)  # built here; mlx-lm would build its own from it
        tied = flag(c["tie_word_embeddings"], "tie_word_embeddings")
        args = gpt_oss.ModelArgs.from_dict({**c, "layer_types": list(kinds)})
        module = _Model(args, list(kinds), window, tied)
        for layer in module.model.layers:
            layer.self_attn.rope = rope_layer
            layer.mlp.experts.activation = SwigluOAI(alpha=alpha, limit=limit)
        if not flag(c["attention_bias"], "attention_bias"):
            _drop_attention_bias(module.model.layers)
        return module
