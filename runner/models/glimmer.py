"""MuseGlimmerForConditionalGeneration (model_type muse_glimmer): the text model of
`text_config` over mlx-lm's muse_glimmer; the vision tower's weights are dropped, so media
requests are refused as for any text model.

Caches (docs/DESIGN.md §3.1): rotating on sliding layers, KV on global layers (which run
without RoPE where `layer_rope_theta` is 0).

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- without `layer_types`, the global layers are every fourth counted back from the last
  (mlx-lm counts from the first), and without `layer_rope_theta` those layers are NoPE;
- RoPE comes from `rope_parameters` (its type included; mlx-lm reads the theta only);
- `attention_bias` gives q/k/v/o biases (mlx-lm has none);
- the head is tied iff the text config's `tie_word_embeddings` (default false);
- logits: in float32, times `output_multiplier`, then soft-capped by
  `final_logit_softcapping`, in `unembed` and `unembed_candidates` alike.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import muse_glimmer
from mlx_lm.models.rope_utils import initialize_rope

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_layer_kinds,
    hf_rope_parameters,
    integer,
    json_object,
    mlx_rope,
    number,
    require,
)
from runner.models.decoder import DecoderModel, add_attention_bias
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

# transformers 5 MuseGlimmerTextConfig defaults.
GLIMMER_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048,
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "hidden_activation": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "sliding_window": 2048,
    "final_logit_softcapping": 20.0,
    "qk_scale_factor": 3.87,
    "output_multiplier": 0.19611613513818404,
    "post_norm_eps": 1e-8,
}
# Weights of the vision tower and its adapter (text only here).
_MEDIA_PREFIXES = ("model.vision_", "vision_")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` of the multimodal checkpoint."""
    if "text_config" in config or config.get("model_type") == "muse_glimmer":
        return json_object(config.get("text_config"), "text_config")
    return config


def _global(i: int, n: int) -> bool:
    """transformers' default: every fourth layer counted back from the last is global."""
    return (n - 1 - i) % 4 == 0


def _layer_rope_theta(c: dict[str, Any], theta: float, n: int) -> list[float]:
    values = c.get("layer_rope_theta")
    if values is None:
        return [0.0 if _global(i, n) else theta for i in range(n)]
    if not isinstance(values, list) or len(values) != n:
        raise ModelLoadError(
            f"config.json: layer_rope_theta must give a RoPE base (0: none) for each of the "
            f"{n} layers, not {show(values)}"
        )
    for i, value in enumerate(values):
        if value != 0:
            number(value, f"layer_rope_theta[{i}]")
    return [float(v) for v in values]


class _Model(muse_glimmer.Model):
    def __init__(self, args: muse_glimmer.ModelArgs, rope: nn.Module):
        super().__init__(args)
        for layer in self.model.layers:
            if layer.self_attn.use_rope:
                layer.self_attn.rope = rope  # type: ignore[assignment]  # any RoPE type

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if not k.startswith(_MEDIA_PREFIXES)}
        weights = super().sanitize(weights)
        if self.tie_word_embeddings:  # transformers ties by config
            weights.pop("lm_head.weight", None)
        elif "lm_head.weight" not in weights:
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        return weights


@register("MuseGlimmerForConditionalGeneration", "muse_glimmer")
class Glimmer(DecoderModel):
    DEFAULT_CONTEXT = 131072
    KERNELS = Kernels(attention=(muse_glimmer.Attention,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**GLIMMER_DEFAULTS, **text_config(config)}
        check_decoder(c, hidden_by_heads=True)
        require(c, "hidden_activation", "silu")
        for key in ("post_norm_eps", "qk_scale_factor", "output_multiplier"):
            number(c[key], key)
        number(c["final_logit_softcapping"], "final_logit_softcapping")
        n = c["num_hidden_layers"]
        kinds = c.get("layer_types")
        if kinds is None:
            kinds = [FULL if _global(i, n) else SLIDING for i in range(n)]
        kinds = check_layer_kinds(kinds, (FULL, SLIDING), n)
        if SLIDING in kinds:
            integer(c["sliding_window"], "sliding_window")
        params = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        theta, scaling = mlx_rope(params)
        rope = initialize_rope(c["head_dim"], theta, False, scaling, c["max_position_embeddings"])
        layer_theta = _layer_rope_theta(c, theta, n)
        c |= {"layer_types": list(kinds), "layer_rope_theta": layer_theta, "rope_theta": theta}
        c.pop("rope_parameters", None)  # mlx-lm would read its theta again
        c.pop("text_config", None)
        module = _Model(muse_glimmer.ModelArgs.from_dict(c), rope)
        if c["attention_bias"]:
            add_attention_bias(module.layers)
        return module

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        super().__init__(module, {**GLIMMER_DEFAULTS, **text_config(config)}, architecture, backend)

    def postprocess(self, logits: mx.array) -> mx.array:
        """transformers: logits × output_multiplier, then cap × tanh(· / cap), in float32."""
        cap = float(self.config["final_logit_softcapping"])
        scaled = logits.astype(mx.float32) * float(self.config["output_multiplier"])
        return mx.tanh(scaled / cap) * cap
