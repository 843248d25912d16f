"""Gemma3ForCausalLM (model_type gemma3_text) over mlx-lm's gemma3_text.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- layer kinds come from `layer_types` (else `sliding_window_pattern`, default 6); mlx-lm only
  knows the pattern, and assumes its first global layer is at index pattern - 1;
- RoPE comes from `rope_parameters[kind]` per layer kind; mlx-lm reads `rope_theta`,
  `rope_local_base_freq` and `rope_scaling`, which transformers 5 no longer writes;
- the embedding scale sqrt(hidden_size) is kept in the weight dtype (mlx-lm rounds it through
  bfloat16 first: 33.94 becomes 34.0 for hidden_size 1152);
- the head is tied iff `tie_word_embeddings` (default true), not iff `lm_head.weight` is absent;
- `final_logit_softcapping` is applied to the logits (mlx-lm ignores it);
- mlx-lm's defaults (hidden 1152, 4 heads, window 512, ...) are replaced by transformers'.
`attn_logit_softcapping` is ignored, as transformers' Gemma3 attention ignores it.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text
from mlx_lm.models.rope_utils import initialize_rope

from runner.backend import native_step
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
from runner.models.decoder import DecoderModel, add_attention_bias, layer_caches, run_layers
from runner.models.registry import register
from runner.sources.source import ModelLoadError

# transformers 5 Gemma3TextConfig defaults, where mlx-lm's differ or are missing.
GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attention_bias": False,
    "use_bidirectional_attention": False,
}
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def _rope_by_kind(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """transformers' per-kind rope dicts, also from the legacy keys it still converts."""
    nested = json_object(c.get("rope_parameters"), "rope_parameters")
    if FULL not in nested and SLIDING not in nested:
        legacy = json_object(c.get("rope_scaling"), "rope_scaling")
        nested = {
            FULL: {**legacy, "rope_theta": c.get("rope_theta", 1e6)},
            SLIDING: {"rope_theta": c.get("rope_local_base_freq", 1e4)},
        }
    return {
        kind: hf_rope_parameters(
            c, nested.get(kind) or {}, default_theta=theta, where=f"rope_parameters.{kind}"
        )
        for kind, theta in _DEFAULT_THETA.items()
    }


class _TextModel(gemma3_text.Gemma3Model):
    def __init__(self, args: gemma3_text.ModelArgs, kinds: list[str], ropes: dict[str, Any]):
        super().__init__(args)
        self.kinds = kinds
        for layer, kind in zip(self.layers, kinds, strict=True):
            layer.self_attn.is_sliding = kind == SLIDING
            layer.self_attn.rope = ropes[kind]

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        # transformers: the float32 sqrt(hidden) cast to the weight dtype, not via bfloat16
        h = h * mx.array(math.sqrt(self.args.hidden_size), mx.float32).astype(h.dtype)
        return self.norm(run_layers(self.layers, self.kinds, h, cache, self.window_size))


class _Model(gemma3_text.Model):
    def __init__(self, args: gemma3_text.ModelArgs, kinds: list[str], ropes: dict, tied: bool):
        super().__init__(args)
        self.model = _TextModel(args, kinds, ropes)
        self.hf_tied = tied

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.hf_tied:  # transformers ties by config; mlx-lm by whether lm_head.weight exists
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        elif "lm_head.weight" not in weights:
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        return super().sanitize(weights)

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.args.sliding_window)


@register("Gemma3ForCausalLM", "gemma3_text")
class Gemma3(DecoderModel):
    DEFAULT_CONTEXT = 131072
    KERNELS = Kernels(attention=(gemma3_text.Attention,), gelu_glu=(gemma3_text.MLP,))
    NATIVE_STEP = True

    def native_shape(self) -> native_step.NativeShape:
        """Gemma's norms scale by 1 + weight; its embeddings by the float32 sqrt(hidden)."""
        hidden = int(self.module.model.args.hidden_size)
        return native_step.NativeShape(
            plus_one_norms=(gemma3_text.RMSNorm,), embedding_scale=math.sqrt(hidden)
        )

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**GEMMA3_DEFAULTS, **config}
        check_decoder(c, hidden_by_heads=True)
        require(c, "hidden_activation", "gelu_pytorch_tanh")  # mlx-lm: tanh-approximate GELU
        require(c, "use_bidirectional_attention", False, None)  # mlx-lm is causal only
        n = c["num_hidden_layers"]
        # mlx-lm divides by the pattern even where layer_types decides
        pattern = integer(c.get("sliding_window_pattern", 6), "sliding_window_pattern")
        kinds = c.get("layer_types")
        if kinds is None:
            kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        check_layer_kinds(kinds, (SLIDING, FULL), n)
        if SLIDING in kinds:
            integer(c["sliding_window"], "sliding_window")
        number(c["query_pre_attn_scalar"], "query_pre_attn_scalar")
        if c.get("final_logit_softcapping") is not None:
            number(c["final_logit_softcapping"], "final_logit_softcapping")
        rope_params = _rope_by_kind(c)
        scaled = {kind: mlx_rope(p, f"rope_parameters.{kind}") for kind, p in rope_params.items()}
        c["rope_theta"], c["rope_scaling"] = scaled[FULL]
        c["rope_local_base_freq"] = scaled[SLIDING][0]
        ropes = {
            kind: initialize_rope(
                c["head_dim"], theta, False, scaling, c["max_position_embeddings"]
            )
            for kind, (theta, scaling) in scaled.items()
        }
        module = _Model(gemma3_text.ModelArgs.from_dict(c), kinds, ropes, c["tie_word_embeddings"])
        if c["attention_bias"]:
            add_attention_bias(module.layers)
        return module

    def postprocess(self, logits: mx.array) -> mx.array:
        cap = self.config.get("final_logit_softcapping")
        return mx.tanh(logits / cap) * cap if cap else logits

    def postprocess_is_identity(self) -> bool:
        cap = self.config.get("final_logit_softcapping")
        return not cap
