"""Qwen3ForCausalLM over mlx-lm's qwen3 (Q/K norms), with transformers' optional extras.

mlx-lm's Qwen3 has neither attention biases nor sliding-window layers; transformers' has both
(`attention_bias`, and `layer_types` with `use_sliding_window`), so this adapter adds them.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models import qwen3

from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_layer_kinds,
    flag,
    hf_rope_parameters,
    integer,
    mlx_rope,
    require,
)
from runner.models.decoder import DecoderModel, LayerKinds, add_attention_bias, layer_caches
from runner.models.registry import register

# transformers 5 Qwen3Config defaults for keys mlx-lm requires or reads differently.
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "head_dim": 128,  # transformers' default, not hidden_size // heads
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "max_window_layers": 28,
}


class _Qwen3Model(LayerKinds, qwen3.Qwen3Model):
    """mlx-lm's Qwen3 text model with transformers' per-layer sliding windows."""


class _Model(qwen3.Model):
    def __init__(self, args: qwen3.ModelArgs, kinds: list[str], window: int | None):
        super().__init__(args)
        self.model = _Qwen3Model(args, kinds, window)

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.model.window)


@register("Qwen3ForCausalLM", "qwen3")
class Qwen3(DecoderModel):
    DEFAULT_CONTEXT = 32768
    NATIVE_STEP = True
    KERNELS = Kernels(attention=(qwen3.Attention,), swiglu=(qwen3.MLP,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**QWEN3_DEFAULTS, **config}
        check_decoder(c, nullable=("num_key_value_heads",))
        if c["num_key_value_heads"] is None:  # transformers' meaning; mlx-lm needs the number
            c["num_key_value_heads"] = c["num_attention_heads"]
        require(c, "hidden_act", "silu")
        rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        c["rope_theta"], c["rope_scaling"] = mlx_rope(rope)
        c.pop("rope_parameters", None)  # mlx-lm would re-read it as the scaling config
        # transformers: a window only with use_sliding_window, on layer_types' sliding layers
        # (by default those from max_window_layers on); mlx-lm's Qwen3 has no windows at all
        sliding = flag(c["use_sliding_window"], "use_sliding_window")
        window = c.get("sliding_window") if sliding else None
        if window is not None:
            integer(window, "sliding_window")
        n = c["num_hidden_layers"]
        kinds = c.get("layer_types")
        if kinds is None:
            first_sliding = integer(c["max_window_layers"], "max_window_layers", minimum=0)
            kinds = [SLIDING if i >= first_sliding else FULL for i in range(n)]
        check_layer_kinds(kinds, (FULL, SLIDING), n)
        if window is None:
            kinds = [FULL] * n
        module = _Model(qwen3.ModelArgs.from_dict(c), list(kinds), window)
        if c["attention_bias"]:
            add_attention_bias(module.layers)
        return module
