"""Mistral text models: `MistralForCausalLM` (model_type mistral) over mlx-lm's llama,
`Ministral3ForCausalLM` (ministral3) over mlx-lm's ministral3, and the text model of the
image-text `Mistral3ForConditionalGeneration` (mistral3: Mistral Small 3.x, Ministral 3),
which is one of the two by its `text_config.model_type`.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- transformers' Mistral and Ministral3 window every layer when `sliding_window` is set
  (Mistral's default is 4096, Ministral3's null) and ignore `layer_types`; mlx-lm's llama
  follows `layer_types`, and its ministral3 needs a full-attention layer. Windowed layers
  cache in a rotating buffer;
- RoPE comes from `rope_parameters` (mlx-lm's llama reads `rope_theta`/`rope_scaling`);
  Ministral3's default is yarn with both mscales and the position-dependent query scale
  (`llama_4_scaling_beta` over `original_max_position_embeddings`);
- `tie_word_embeddings` defaults to false for the text models (mlx-lm: true) and to true
  for Mistral3ForConditionalGeneration, whose top level decides, as transformers reads it;
- Mistral's attention has no biases whatever `attention_bias` says (mlx-lm's llama adds them).
The image-text checkpoint's text weights are under `model.language_model.` (or, as transformers
5 saves it, `language_model.model.` and `language_model.lm_head.`); its vision tower and
projector are not loaded (images are refused as for every model without media).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama, ministral3
from mlx_lm.models.base import create_attention_mask

from runner.backend import Backend, native_step
from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    flag,
    hf_rope_parameters,
    integer,
    json_object,
    mlx_rope,
    require,
    rope_module,
)
from runner.models.decoder import DecoderModel, LayerKinds, layer_caches
from runner.models.registry import register
from runner.sources.source import ModelLoadError

# transformers 5 MistralConfig defaults where mlx-lm's llama differs (or has none).
MISTRAL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
}
# transformers 5 Ministral3Config defaults where mlx-lm's ministral3 differs (or has none).
MINISTRAL3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 34,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
}
# Ministral3Config.__post_init__'s rope when the config has none
MINISTRAL3_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
# keys of a text config that transformers' Mistral ignores and mlx-lm's llama would read
_NOT_MISTRAL = ("layer_types", "attention_bias", "mlp_bias")
# the image-text checkpoint's text weights, in transformers 5's layout and in the original
# one (which transformers 5 still writes), as the text model's names
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_NOT_TEXT = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


def _window(c: dict[str, Any]) -> int | None:
    """transformers: every layer windowed by `sliding_window` unless it is null."""
    window = c.get("sliding_window")
    return None if window is None else integer(window, "sliding_window")


# --- Mistral over mlx-lm's llama -------------------------------------------------------------


class _LlamaText(LayerKinds, llama.LlamaModel):
    pass


class _Llama(llama.Model):
    def __init__(self, args: llama.ModelArgs, kinds: list[str], window: int | None):
        super().__init__(args)
        self.model = _LlamaText(args, kinds, window)

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.model.window)


def _build_mistral(config: dict[str, Any]) -> nn.Module:
    c = {**MISTRAL_DEFAULTS, **config}
    check_decoder(c, nullable=("head_dim", "num_key_value_heads"))
    require(c, "hidden_act", "silu")  # mlx-lm's llama MLP is SwiGLU
    rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
    c["rope_theta"], c["rope_scaling"] = mlx_rope(rope)
    window = _window(c)
    for key in _NOT_MISTRAL:
        c.pop(key, None)
    c.pop("sliding_window", None)  # applied here, not by mlx-lm
    kinds = [SLIDING if window else FULL] * c["num_hidden_layers"]
    return _Llama(llama.ModelArgs.from_dict(c), kinds, window)


# --- Ministral3 over mlx-lm's ministral3 -----------------------------------------------------


class _Ministral3Text(ministral3.LanguageModel):
    def __init__(self, args: ministral3.ModelArgs, kinds: list[str], window: int | None):
        super().__init__(args)  # args' layer_types all full: mlx-lm needs a full layer
        self.kinds, self.window = kinds, window
        rope: dict[str, Any] = args.rope_parameters or {}
        # transformers' query scale 1 + beta * log(1 + floor(position / period))
        self.query_scale_beta = float(rope["llama_4_scaling_beta"])
        self.query_scale_period = int(rope["original_max_position_embeddings"])
        for layer, kind in zip(self.layers, kinds, strict=True):
            layer.use_sliding = kind == SLIDING

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        cache = cache or [None] * len(self.layers)
        offset = 0 if cache[0] is None else cache[0].offset
        size = self.window if self.kinds[0] == SLIDING else None  # one kind for all layers
        mask = create_attention_mask(h, cache[0], window_size=size)
        scale = ministral3._get_llama_4_attn_scale(
            h.shape[1], offset, self.query_scale_beta, self.query_scale_period
        ).astype(h.dtype)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, scale, mask, cache=c)
        return self.norm(h)


class _Ministral3(ministral3.Model):
    def __init__(self, args: ministral3.ModelArgs, kinds: list[str], window: int | None):
        super().__init__(args)
        self.model = _Ministral3Text(args, kinds, window)

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.model.window)


def _build_ministral3(config: dict[str, Any]) -> nn.Module:
    c = {**MINISTRAL3_DEFAULTS, **config}
    check_decoder(c, nullable=("head_dim", "num_key_value_heads"))
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    require(c, "hidden_act", "silu")  # mlx-lm's ministral3 MLP is SwiGLU
    params = c.get("rope_parameters") or c.get("rope_scaling") or MINISTRAL3_ROPE
    rope = hf_rope_parameters(c, params, default_theta=c.get("rope_theta", 10000.0))
    # the query scale by position, which transformers computes from these two on any rope
    beta = rope.get("llama_4_scaling_beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < math.inf:
        raise ModelLoadError(
            "config.json: rope_parameters.llama_4_scaling_beta must be a finite number of "
            "at least 0"
        )
    original = rope.get("original_max_position_embeddings")
    integer(original, "rope_parameters.original_max_position_embeddings")
    rope_layer = rope_module(rope, c["head_dim"], c["max_position_embeddings"])
    window = _window(c)
    n = c["num_hidden_layers"]
    kinds = [SLIDING if window else FULL] * n
    c["layer_types"] = [FULL] * n
    c["rope_parameters"] = {
        "rope_theta": rope["rope_theta"],
        "llama_4_scaling_beta": float(beta),
        "original_max_position_embeddings": original,
    }
    module = _Ministral3(ministral3.ModelArgs.from_dict(c), kinds, window)
    for layer in module.model.layers:
        layer.self_attn.rope = rope_layer
    return module


# --- the families ---------------------------------------------------------------------------


class _MistralBase(DecoderModel):
    KERNELS = Kernels(
        attention=(llama.Attention, ministral3.Attention), swiglu=(llama.MLP, ministral3.MLP)
    )
    NATIVE_STEP = True  # Ministral3's query scale by position: `native_shape`

    def native_shape(self) -> native_step.NativeShape:
        text = self.module.model
        if not isinstance(text, _Ministral3Text):
            return native_step.NativeShape()
        beta, period = text.query_scale_beta, text.query_scale_period

        def query_scale(offset: int, tokens: int) -> np.ndarray | None:
            if offset + tokens <= period:  # 1 + beta * log(1 + 0): every one 1
                return None
            scale = ministral3._get_llama_4_attn_scale(tokens, offset, beta, period)
            return np.array(scale.astype(mx.float32)).reshape(tokens)

        return native_step.NativeShape(query_scale=query_scale)


@register("MistralForCausalLM", "mistral")
class Mistral(_MistralBase):
    DEFAULT_CONTEXT = 131072

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        return _build_mistral(config)


@register("Ministral3ForCausalLM", "ministral3")
class Ministral3(_MistralBase):
    DEFAULT_CONTEXT = 262144

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        return _build_ministral3(config)


class _ImageTextModel(nn.Module):
    """The text model of a Mistral3ForConditionalGeneration checkpoint: its text weights as
    the text model's, vision tower and projector skipped."""

    def __init__(self, text: nn.Module):
        super().__init__()
        self.model = text.model
        if "lm_head" in text:
            self.lm_head = text.lm_head
        # the text model's own methods; bound methods are not parameters to mlx
        self._text_cache = text.make_cache
        self._text_sanitize = text.sanitize

    def make_cache(self) -> list[Any]:
        return self._text_cache()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        text = {}
        for name, value in weights.items():
            if name.startswith(_NOT_TEXT):
                continue
            for prefix, text_prefix in _TEXT_PREFIXES.items():
                if name.startswith(prefix):
                    name = text_prefix + name.removeprefix(prefix)
                    break
            text[name] = value
        return self._text_sanitize(text)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config, tied as the top level says (transformers' default: tied)."""
    text = dict(json_object(config.get("text_config"), "text_config"))
    text["tie_word_embeddings"] = flag(
        config.get("tie_word_embeddings", True), "tie_word_embeddings"
    )
    return text


@register("Mistral3ForConditionalGeneration", "mistral3")
class Mistral3(_MistralBase):
    DEFAULT_CONTEXT = 131072

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        super().__init__(module, _text_config(config), architecture, backend)

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        text = _text_config(config)
        kind = text.get("model_type", "mistral")  # transformers' default text model
        if kind == "ministral3":
            module = _build_ministral3(text)
        elif kind == "mistral":
            module = _build_mistral(text)
        else:
            raise ModelLoadError(f"config.json: text_config.model_type {kind!r} is not supported")
        return _ImageTextModel(module)
