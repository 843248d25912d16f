"""LlamaForCausalLM over mlx-lm's llama.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
mlx-lm ignores `rope_parameters` (so a transformers 5 config got theta 10000 and no llama3
scaling), defaults `tie_word_embeddings` to true (transformers: false), and would apply
`layer_types`/`sliding_window` windows that transformers' Llama does not have.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models import llama

from runner.backend.install import Kernels
from runner.models.config import check_decoder, flag, hf_rope_parameters, mlx_rope, require
from runner.models.decoder import DecoderModel
from runner.models.registry import register

# transformers 5 LlamaConfig defaults for the keys mlx-lm reads with other defaults (or none).
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "tie_word_embeddings": False,  # mlx-lm's llama defaults to True
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
}


@register("LlamaForCausalLM", "llama")
class Llama(DecoderModel):
    DEFAULT_CONTEXT = 2048
    NATIVE_STEP = True
    KERNELS = Kernels(attention=(llama.Attention,), swiglu=(llama.MLP,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**LLAMA_DEFAULTS, **config}
        # transformers derives a null head_dim and num_key_value_heads, as mlx-lm does
        check_decoder(c, nullable=("head_dim", "num_key_value_heads"), hidden_by_heads=True)
        flag(c.get("mlp_bias", False), "mlp_bias")
        require(c, "hidden_act", "silu")  # mlx-lm's llama MLP is always SwiGLU
        rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        # mlx-lm's llama reads only rope_theta / rope_scaling, never rope_parameters
        c["rope_theta"], c["rope_scaling"] = mlx_rope(rope)
        # transformers' Llama has no sliding-window layers; mlx-lm would honour these keys
        c.pop("layer_types", None)
        c.pop("sliding_window", None)
        return llama.Model(llama.ModelArgs.from_dict(c))
