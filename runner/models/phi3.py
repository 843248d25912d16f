"""Phi3ForCausalLM (model_type phi3: Phi-3, Phi-3.5 mini, Phi-4 mini) over mlx-lm's phi3.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- RoPE comes from `rope_parameters` (the rotated fraction `partial_rotary_factor` in it);
  mlx-lm reads `rope_theta`, `rope_scaling` and a top-level `partial_rotary_factor`;
- longrope (also spelt "su" and "yarn", which transformers 5's Phi3 reads as longrope; mlx-lm
  drops "yarn" scaling altogether): transformers rotates by `short_factor` while the sequence
  is at most `original_max_position_embeddings` long, and by `long_factor` at every position
  once it is longer; mlx-lm always by `long_factor`. A cache cannot follow that switch (every
  cached position would turn), so the model rotates by the short factors, and where the two
  differ its context is `original_max_position_embeddings`: exactly transformers' numbers for
  every sequence it accepts. Where they are equal the whole context is served. The attention
  factor is transformers' (`attention_factor`, else from `factor`, else from the ratio of the
  contexts), and `original_max_position_embeddings` is the top-level key (default 4096) over
  the one in `rope_parameters`, as transformers 5's Phi3 reads it;
- transformers windows every layer by `sliding_window` when it is set; mlx-lm ignores it.
  Windowed layers cache in a rotating buffer (none where the window spans the context);
- the head is tied iff `tie_word_embeddings` (mlx-lm also loads a tied checkpoint's
  lm_head.weight, and fails); mlx-lm's heads are hidden_size // num_attention_heads wide
  whatever `head_dim` says: another width is refused;
- other RoPE types (linear, dynamic, ...) are refused: transformers' Phi3 refuses them too.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import phi3
from mlx_lm.models.rope_utils import SuScaledRoPE

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_derived_head_dim,
    hf_rope_parameters,
    integer,
    number,
    require,
)
from runner.models.decoder import DecoderModel, LayerKinds, layer_caches
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

# transformers 5 Phi3Config defaults for keys mlx-lm requires or reads differently.
PHI3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,  # mlx-lm: 131072
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
}
# transformers 5's Phi3Config reads these RoPE types as longrope
LONGROPE_SPELLINGS = ("longrope", "su", "yarn")


def _factors(params: dict[str, Any], key: str, pairs: int) -> list[float]:
    """longrope's per-pair factors: a list of positive numbers, one per rotated pair."""
    value = params.get(key)
    if not (
        isinstance(value, list)
        and len(value) == pairs
        and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf
            for x in value
        )
    ):
        raise ModelLoadError(
            f"config.json: rope_parameters.{key} must be a list of {pairs} positive numbers "
            f"(one per rotated pair), not {show(value)}"
        )
    return [float(x) for x in value]


def _rope(c: dict[str, Any]) -> tuple[nn.Module, int]:
    """The RoPE module transformers' Phi3 computes for `c` (checked by `check_decoder`), and
    the context it computes it for."""
    params = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
    theta = number(params["rope_theta"], "rope_parameters.rope_theta")
    fraction = params.get("partial_rotary_factor", 1.0)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    dims = int(head_dim * fraction)
    context = c["max_position_embeddings"]
    if params["rope_type"] == "default":
        return nn.RoPE(dims, traditional=False, base=theta), context
    if params["rope_type"] not in LONGROPE_SPELLINGS:
        raise ModelLoadError(
            f"rope_parameters.rope_type {params['rope_type']!r} is not supported "
            "(Phi3: default or longrope)"
        )
    # transformers 5's Phi3 always reads the top-level key (its class default 4096)
    original = integer(
        c["original_max_position_embeddings"], "original_max_position_embeddings", minimum=2
    )
    short = _factors(params, "short_factor", dims // 2)
    long = _factors(params, "long_factor", dims // 2)
    factor = params.get("factor")
    factor = context / original if factor is None else number(factor, "rope_parameters.factor")
    attention = params.get("attention_factor")
    if attention is not None:
        attention = number(attention, "rope_parameters.attention_factor")
    elif factor <= 1.0:
        attention = 1.0
    else:
        attention = math.sqrt(1 + math.log(factor) / math.log(original))
    rope = SuScaledRoPE(
        dims,
        base=theta,
        max_position_embeddings=context,
        original_max_position_embeddings=original,
        long_factor=short,  # the factors of every sequence this model accepts
        long_mscale=attention,
    )
    return rope, context if short == long else min(context, original)


def _fraction(c: dict[str, Any]) -> float:
    """The rotated fraction of each head, checked (before the sizes it multiplies)."""
    params = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
    fraction = number(
        params.get("partial_rotary_factor", 1.0), "rope_parameters.partial_rotary_factor"
    )
    if fraction > 1:
        raise ModelLoadError(
            f"config.json: rope_parameters.partial_rotary_factor {fraction} is above 1"
        )
    return fraction


class _Phi3Model(LayerKinds, phi3.Phi3Model):
    """mlx-lm's Phi3 text model with transformers' sliding windows."""


class _Model(phi3.Model):
    def __init__(
        self,
        args: phi3.ModelArgs,
        kinds: list[str],
        window: int | None,
        rope: nn.Module,
        context: int,
    ):
        super().__init__(args)
        self.model = _Phi3Model(args, kinds, window)
        for layer in self.model.layers:
            layer.self_attn.rope = rope
        self.context = context  # a plain int, not a parameter

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.args.tie_word_embeddings:  # transformers ties by config
            return {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.model.window)


@register("Phi3ForCausalLM", "phi3")
class Phi3(DecoderModel):
    DEFAULT_CONTEXT = 4096
    KERNELS = Kernels(attention=(phi3.Attention,), swiglu=(phi3.MLP,))
    NATIVE_STEP = True  # its fused projections are read as row ranges (native_step.py)

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        super().__init__(module, config, architecture, backend)
        self.context_length = module.context  # longrope's short factors end where it does

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**PHI3_DEFAULTS, **config}
        fraction = _fraction(c)
        check_decoder(c, nullable=("head_dim", "num_key_value_heads"), rotary_fraction=fraction)
        c["num_key_value_heads"] = c.get("num_key_value_heads") or c["num_attention_heads"]
        check_derived_head_dim(c, "Phi3")
        require(c, "hidden_act", "silu")  # mlx-lm's phi3 MLP is SwiGLU
        rope, context = _rope(c)
        window = c["sliding_window"]
        if window is not None:
            integer(window, "sliding_window")
        n = c["num_hidden_layers"]
        # a window as long as the context never hides a position: full attention
        kinds = [SLIDING if window is not None and window < context else FULL] * n
        c |= {"partial_rotary_factor": fraction, "rope_scaling": None}
        return _Model(phi3.ModelArgs.from_dict(c), kinds, window, rope, context)
