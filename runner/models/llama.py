"""LlamaForCausalLM over mlx-lm's llama, and the pieces the other families reuse.

`DecoderModel` is the adapter every family here extends: the mlx-lm module's inner `model`
gives the final-normed hidden states, the output head is `lm_head` or the tied
`embed_tokens`, and `unembed_candidates` gathers only the requested rows of that head.

Config reading: transformers 5 is the reference. Its configs nest `rope_theta` and the
scaling under `rope_parameters` and rely on class defaults for absent keys; mlx-lm's
`ModelArgs` read `rope_theta`/`rope_scaling` and have defaults of their own. Each family's
`build_module` turns the transformers config into the dict mlx-lm should see (patching the
mlx-lm module where a dict cannot say it), and refuses with a ModelLoadError naming the field
what neither can express.

Llama itself: mlx-lm ignores `rope_parameters` (so a transformers 5 config got theta 10000 and
no llama3 scaling), defaults `tie_word_embeddings` to true (transformers: false), and would
apply `layer_types`/`sliding_window` windows that transformers' Llama does not have.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from runner.models import cpu_gemv
from runner.models.base import RunnerModel
from runner.models.registry import register
from runner.source import ModelLoadError

# RoPE types whose mlx-lm implementation matches transformers' (checked by the reference tests).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# yarn keys where mlx-lm's formula differs from transformers' (mscale without mscale_all_dim,
# an explicit attention_factor, truncate=False); refused rather than computed differently.
_YARN_UNSUPPORTED = ("attention_factor", "mscale", "mscale_all_dim")
SLIDING = "sliding_attention"


def hf_rope_parameters(
    config: dict[str, Any], params: dict[str, Any] | None = None, *, default_theta: float
) -> dict[str, Any]:
    """transformers 5's standardized rope dict: `rope_parameters`, else the legacy
    `rope_scaling` + `rope_theta`, with its defaults filled in."""
    if params is None:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.pop("type", None)
    params.setdefault("rope_theta", default_theta)
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn"):
        # transformers falls back to the model's own context; mlx-lm to 8192 / 4096
        params.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", config.get("max_position_embeddings")),
        )
    return params


def mlx_rope(params: dict[str, Any], where: str = "rope_parameters") -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for mlx-lm's `initialize_rope`, from a transformers rope dict."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{where}.rope_type {rope_type!r} is not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{where}.partial_rotary_factor is not supported for this model")
    if rope_type == "yarn":
        for key in _YARN_UNSUPPORTED:
            if params.get(key) is not None:
                raise ModelLoadError(f"{where}.{key} is not supported for yarn RoPE")
        if params.get("truncate", True) is not True:
            raise ModelLoadError(f"{where}.truncate=false is not supported for yarn RoPE")
    scaling = None if rope_type == "default" else params
    return float(params["rope_theta"]), scaling


def require(config: dict[str, Any], key: str, *allowed: Any) -> None:
    """Refuse a config value that mlx-lm's implementation would silently ignore."""
    if config.get(key) not in allowed:
        value = config.get(key)
        raise ModelLoadError(f"{key}={value!r} is not supported (expected {allowed[0]!r})")


def gather_rows(layer: nn.Module, ids: mx.array) -> mx.array:
    """Rows `ids` of a Linear/Embedding weight as float32, dequantizing only those rows."""
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        scales, biases = layer["scales"][ids], layer.get("biases")
        if mx.issubdtype(scales.dtype, mx.floating):  # affine: dequantize in float32
            scales = scales.astype(mx.float32)
        if biases is not None:
            biases = biases[ids].astype(mx.float32)
        rows = mx.dequantize(
            layer["weight"][ids],
            scales=scales,
            biases=biases,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
        )
        return rows.astype(mx.float32)
    return layer["weight"][ids].astype(mx.float32)


def run_layers(
    layers: list[Any], kinds: list[str], h: mx.array, cache: list[Any] | None, window: int | None
) -> mx.array:
    """Run decoder layers with one attention mask per layer kind (full or sliding)."""
    cache = cache or [None] * len(layers)
    masks: dict[str, Any] = {}
    for kind, c in zip(kinds, cache, strict=True):
        if kind not in masks:
            size = window if kind == SLIDING else None
            masks[kind] = create_attention_mask(h, c, window_size=size)
    for layer, kind, c in zip(layers, kinds, cache, strict=True):
        h = layer(h, masks[kind], c)
    return h


def add_attention_bias(layers: list[Any]) -> None:
    """Give q/k/v/o biases, as transformers does for `attention_bias`, where mlx-lm has none."""
    for layer in layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out_dims, in_dims = getattr(attn, name).weight.shape
            setattr(attn, name, nn.Linear(in_dims, out_dims, bias=True))


class DecoderModel(RunnerModel):
    """A decoder-only mlx-lm `Model` with `.model` (embed, layers, final norm) and a head."""

    DEFAULT_CONTEXT = 2048  # transformers' max_position_embeddings default for the family

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        raise NotImplementedError

    def __init__(self, module: nn.Module, config: dict[str, Any], architecture: str):
        super().__init__(module, config, architecture)
        self._tied = "lm_head" not in module
        self._head = module.model.embed_tokens if self._tied else module.lm_head

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or self.DEFAULT_CONTEXT)

    @property
    def vocab_size(self) -> int:
        return int(self._head["weight"].shape[0])

    def make_caches(self) -> list[Any]:
        return make_prompt_cache(self.module)

    def hidden(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        return self.module.model(tokens, cache=caches)

    def postprocess(self, logits: mx.array) -> mx.array:
        """Element-wise logit post-processing (soft-capping, ...); identity here."""
        return logits

    def unembed(self, hidden: mx.array) -> mx.array:
        head = self._head
        if not self._tied:
            logits = head(hidden)
        elif cpu_gemv.one_row(hidden, head.weight):  # a decode step on the CPU
            logits = cpu_gemv.matvec(hidden, head.weight)
        else:
            logits = head.as_linear(hidden)
        return self.postprocess(logits)

    def unembed_candidates(self, hidden: mx.array, ids: mx.array) -> mx.array:
        logits = hidden.astype(mx.float32) @ gather_rows(self._head, ids).T
        if not self._tied and "bias" in self._head:
            logits = logits + self._head["bias"][ids].astype(mx.float32)
        return self.postprocess(logits)


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

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**LLAMA_DEFAULTS, **config}
        require(c, "hidden_act", "silu")  # mlx-lm's llama MLP is always SwiGLU
        rope = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        # mlx-lm's llama reads only rope_theta / rope_scaling, never rope_parameters
        c["rope_theta"], c["rope_scaling"] = mlx_rope(rope)
        # transformers' Llama has no sliding-window layers; mlx-lm would honour these keys
        c.pop("layer_types", None)
        c.pop("sliding_window", None)
        return llama.Model(llama.ModelArgs.from_dict(c))
