"""Qwen3MoeForCausalLM (model_type qwen3_moe) over mlx-lm's qwen3_moe: Qwen3's attention (Q/K
norms) with sparse mixture-of-experts MLPs (softmax router, top-k, optional renormalisation),
dense MLPs on `mlp_only_layers` and off the `decoder_sparse_step`.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- transformers 5 writes the expert count as `num_local_experts`; mlx-lm requires
  `num_experts`;
- mlx-lm builds a plain RoPE from `rope_theta` alone; transformers 5 writes the theta and
  any scaling under `rope_parameters`, so the rope is rebuilt from them;
- `attention_bias` and `use_sliding_window` (every layer windowed) exist in transformers'
  Qwen3-MoE and not in mlx-lm's, so they are added (a windowed layer's cache is rotating);
- the checkpoint's per-expert weights are stacked into mlx-lm's switch layers with their
  quantization arrays, not the weights alone; stacked (Ollama) and fused (transformers'
  `gate_up_proj`) experts are read too (runner/models/moe.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_moe

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    flag,
    hf_rope_parameters,
    integer,
    require,
    rope_module,
)
from runner.models.decoder import DecoderModel, LayerKinds, add_attention_bias, layer_caches
from runner.models.moe import check_routing, gather_in_float32, split_gate_up, stack_experts
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

# transformers 5 Qwen3MoeConfig defaults for the keys mlx-lm requires or reads differently.
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_local_experts": 128,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
}
# transformers' class default, which it keeps only with use_sliding_window (else None).
_DEFAULT_WINDOW = 4096
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _TextModel(LayerKinds, qwen3_moe.Qwen3MoeModel):
    """mlx-lm's Qwen3-MoE text model, every layer full or (use_sliding_window) windowed."""


class _Model(qwen3_moe.Model):
    def __init__(self, args: qwen3_moe.ModelArgs, kinds: list[str], window: int | None):
        super().__init__(args)
        self.model = _TextModel(args, kinds, window)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        weights = split_gate_up(weights)
        return stack_experts(weights, self.args.num_experts, _PROJECTIONS)

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.model.window)


def _dense_layers(c: dict[str, Any]) -> list[int]:
    value = c["mlp_only_layers"]
    if value is None:
        return []
    if not isinstance(value, list):
        raise ModelLoadError(f"config.json: mlp_only_layers must be a list, not {show(value)}")
    n = c["num_hidden_layers"]
    return [integer(i, "mlp_only_layers[]", minimum=0, maximum=n - 1) for i in value]


@register("Qwen3MoeForCausalLM", "qwen3_moe")
class Qwen3Moe(DecoderModel):
    DEFAULT_CONTEXT = 32768
    KERNELS = Kernels(
        attention=(qwen3_moe.Attention,),
        swiglu=(qwen3_moe.MLP,),
        sparse_moe=(qwen3_moe.Qwen3MoeSparseMoeBlock,),
    )
    NATIVE_STEP = True  # its experts too (runner/backend/native_step.py)

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        super().__init__(module, config, architecture, backend)
        gather_in_float32(module, backend)

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**QWEN3_MOE_DEFAULTS, **config}
        if "num_local_experts" not in config and "num_experts" in config:
            c["num_local_experts"] = config["num_experts"]  # a transformers 4 config
        # transformers' Qwen3-MoE has no head_dim of its own: hidden_size // heads unless given
        check_decoder(c, nullable=("head_dim",))
        c["head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        require(c, "hidden_act", "silu")  # mlx-lm's MLP and experts are SwiGLU
        c["num_experts"], _ = check_routing(c, "num_local_experts")
        integer(c["moe_intermediate_size"], "moe_intermediate_size")
        integer(c["decoder_sparse_step"], "decoder_sparse_step")
        flag(c["norm_topk_prob"], "norm_topk_prob")
        c["mlp_only_layers"] = _dense_layers(c)
        rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        rope_layer = rope_module(rope, c["head_dim"], c["max_position_embeddings"])
        c["rope_theta"] = rope["rope_theta"]  # mlx-lm requires it; its rope is replaced below
        # transformers: with use_sliding_window every layer attends within sliding_window
        sliding = flag(c["use_sliding_window"], "use_sliding_window")
        window = c.get("sliding_window", _DEFAULT_WINDOW) if sliding else None
        if window is not None:
            integer(window, "sliding_window")
        n = c["num_hidden_layers"]
        kinds = [SLIDING if window is not None else FULL] * n
        module = _Model(qwen3_moe.ModelArgs.from_dict(c), kinds, window)
        for layer in module.model.layers:  # mlx-lm's rope ignores the scaling
            layer.self_attn.rope = rope_layer
        if c["attention_bias"]:
            add_attention_bias(module.model.layers)
        return module
