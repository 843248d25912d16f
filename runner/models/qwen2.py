"""Qwen2ForCausalLM (Qwen2, Qwen2.5) over mlx-lm's qwen2.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- sliding windows: transformers windows the `layer_types` layers marked sliding (by default
  those from `max_window_layers` on), and only with `use_sliding_window` (without it
  `sliding_window` is null, and a layer marked sliding fails in transformers: refused here);
  mlx-lm's qwen2 has no windows at all. Windowed layers cache in a rotating buffer;
- RoPE comes from `rope_parameters` (mlx-lm reads `rope_theta`, default 1e6 where
  transformers' is 1e4, and `rope_scaling`);
- `tie_word_embeddings` defaults to false (mlx-lm: true);
- mlx-lm's heads are hidden_size // num_attention_heads wide whatever `head_dim` says;
  transformers reads `head_dim`: another width is refused.
The q/k/v biases (and no o bias) are the same in both.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models import qwen2

from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_derived_head_dim,
    check_layer_kinds,
    flag,
    hf_rope_parameters,
    integer,
    mlx_rope,
    require,
)
from runner.models.decoder import DecoderModel, LayerKinds, layer_caches
from runner.models.registry import register
from runner.sources.source import ModelLoadError

# transformers 5 Qwen2Config defaults for keys mlx-lm requires or reads differently.
QWEN2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,  # mlx-lm's qwen2 defaults to True
    "use_sliding_window": False,
    "max_window_layers": 28,
}
# Qwen2Config's sliding_window when absent (its instances hold null without use_sliding_window)
QWEN2_WINDOW = 4096


def qwen2_layer_kinds(c: dict[str, Any]) -> tuple[list[str], int | None]:
    """transformers 5's reading: the window only with use_sliding_window; layer_types, else
    sliding from max_window_layers on (when there is a window)."""
    n = c["num_hidden_layers"]
    sliding = flag(c["use_sliding_window"], "use_sliding_window")
    window = c.get("sliding_window", QWEN2_WINDOW) if sliding else None
    if window is not None:
        integer(window, "sliding_window")
    kinds = c.get("layer_types")
    if kinds is None:
        first = integer(c["max_window_layers"], "max_window_layers", minimum=0)
        kinds = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    check_layer_kinds(kinds, (FULL, SLIDING), n)
    if SLIDING in kinds and window is None:
        raise ModelLoadError(
            "config.json: layer_types has sliding_attention layers but no window "
            "(sliding_window is null or use_sliding_window is false)"
        )
    return list(kinds), window


class _Qwen2Model(LayerKinds, qwen2.Qwen2Model):
    """mlx-lm's Qwen2 text model with transformers' per-layer sliding windows."""


class _Model(qwen2.Model):
    def __init__(self, args: qwen2.ModelArgs, kinds: list[str], window: int | None):
        super().__init__(args)
        self.model = _Qwen2Model(args, kinds, window)

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.model.window)


@register("Qwen2ForCausalLM", "qwen2")
class Qwen2(DecoderModel):
    DEFAULT_CONTEXT = 32768
    NATIVE_STEP = True
    KERNELS = Kernels(attention=(qwen2.Attention,), swiglu=(qwen2.MLP,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**QWEN2_DEFAULTS, **config}
        check_decoder(c, nullable=("head_dim", "num_key_value_heads"))
        if c["num_key_value_heads"] is None:  # transformers' meaning; mlx-lm needs the number
            c["num_key_value_heads"] = c["num_attention_heads"]
        check_derived_head_dim(c, "Qwen2")
        require(c, "hidden_act", "silu")  # mlx-lm's qwen2 MLP is SwiGLU
        rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        c["rope_theta"], c["rope_scaling"] = mlx_rope(rope)
        kinds, window = qwen2_layer_kinds(c)
        return _Model(qwen2.ModelArgs.from_dict(c), kinds, window)
