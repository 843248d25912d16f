"""Gemma2ForCausalLM (model_type gemma2) over mlx-lm's gemma2.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- sliding windows: transformers windows the `layer_types` layers marked sliding (by default
  every other one, the first included) by `sliding_window`; mlx-lm's gemma2 gives every
  layer one full causal mask. Windowed layers cache in a rotating buffer;
- `attn_logit_softcapping` and `final_logit_softcapping` may be null (no capping) in
  transformers; mlx-lm always divides by them. The final cap is applied to the logits here
  (`postprocess`: mlx-lm applies it only in the `__call__` the runner never calls);
- RoPE comes from `rope_parameters` (mlx-lm reads `rope_theta` and nothing else);
- the head is tied iff `tie_word_embeddings` (default true); mlx-lm's is always tied;
- `attention_bias` gives q/k/v/o biases (mlx-lm has none);
- mlx-lm's defaults (query_pre_attn_scalar 144, no head_dim, ...) are replaced by
  transformers'.
The attention is mlx-lm's, soft-capped where the config caps, and ends in the runner's
attention call where it does not. Soft-capped scores need the whole score matrix, which the
runner's attention call does not expose, so rows batched over a shared prefix attend to a
per-row copy of the prefix there (`SharedPrefixKV.materialise`).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2
from mlx_lm.models.base import scaled_dot_product_attention

from runner.backend import native_step
from runner.backend.install import Kernels
from runner.cache.shared_prefix import SharedPrefixKV
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_layer_kinds,
    hf_rope_parameters,
    integer,
    number,
    require,
    rope_module,
)
from runner.models.decoder import DecoderModel, add_attention_bias, layer_caches, run_layers
from runner.models.registry import register
from runner.sources.source import ModelLoadError

# transformers 5 Gemma2Config defaults, where mlx-lm's differ or are missing.
GEMMA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attention_bias": False,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": None,
}


def softcapped_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    cap: float,
) -> mx.array:
    """mlx-lm's gemma2 attention, scores soft-capped (cap * tanh(scores / cap)) before the
    mask and the softmax, as transformers computes them; with the runner's masks ("causal",
    arrays or none) and rows over a shared prefix (`SharedPrefixKV`: the suffix K/V only)."""
    if isinstance(cache, SharedPrefixKV):
        keys, values = cache.materialise(keys, values)
    b, heads, n, d = queries.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    q = (queries * scale).reshape(b, kv_heads, rep, n, d)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)  # [b, kv_heads, rep, n, s]
    scores = mx.tanh(scores / cap) * cap
    if isinstance(mask, str):  # causal: the n queries are the last n of the s positions
        mask = mx.arange(s)[None, :] <= (s - n + mx.arange(n))[:, None]
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ mx.expand_dims(values, 2)).reshape(b, heads, n, d)


class Attention(gemma2.Attention):
    """mlx-lm's gemma2 attention with transformers' optional soft-cap and the given RoPE."""

    def __init__(self, args: gemma2.ModelArgs, cap: float | None, rope: nn.Module):
        super().__init__(args)
        self.softcap = cap  # mlx-lm's attn_logit_softcapping is a number, never none
        self.rope = rope  # type: ignore[assignment]  # any of mlx-lm's RoPE modules

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        b, n, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.offset
        queries = self.rope(queries, offset=offset)
        keys = self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        cap = self.softcap
        if cap is None:
            output = scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=self.scale, mask=mask
            )
        else:
            output = softcapped_attention(queries, keys, values, cache, self.scale, mask, cap)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _TextModel(gemma2.GemmaModel):
    def __init__(
        self, args: gemma2.ModelArgs, kinds: list[str], window: int | None, attention: Any
    ):
        super().__init__(args)
        self.kinds, self.window = kinds, window
        for layer in self.layers:
            layer.self_attn = attention()

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        # transformers: the float32 sqrt(hidden) cast to the weight dtype
        h = h * mx.array(math.sqrt(self.args.hidden_size), mx.float32).astype(h.dtype)
        return self.norm(run_layers(self.layers, self.kinds, h, cache, self.window))


class _Model(gemma2.Model):
    def __init__(
        self,
        args: gemma2.ModelArgs,
        kinds: list[str],
        window: int | None,
        attention: Any,
        tied: bool,
    ):
        super().__init__(args)
        self.model = _TextModel(args, kinds, window, attention)
        self.hf_tied = tied
        if not tied:  # mlx-lm's gemma2 is always tied
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.hf_tied:  # transformers ties by config, whatever the checkpoint holds
            return {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        if "lm_head.weight" not in weights:
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        return weights

    def make_cache(self) -> list[Any]:
        return layer_caches(self.model.kinds, self.model.window)


def _cap(c: dict[str, Any], key: str) -> float | None:
    """A soft-cap: a positive number, or null for none (as transformers reads it)."""
    return None if c.get(key) is None else number(c[key], key)


@register("Gemma2ForCausalLM", "gemma2")
class Gemma2(DecoderModel):
    DEFAULT_CONTEXT = 8192
    KERNELS = Kernels(attention=(Attention,), gelu_glu=(gemma2.MLP,))
    NATIVE_STEP = True

    def native_shape(self) -> native_step.NativeShape:
        """Gemma's norms scale by 1 + weight; its embeddings by the float32 sqrt(hidden)."""
        hidden = int(self.module.model.args.hidden_size)
        return native_step.NativeShape(
            plus_one_norms=(gemma2.RMSNorm,), embedding_scale=math.sqrt(hidden)
        )

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**GEMMA2_DEFAULTS, **config}
        check_decoder(c, hidden_by_heads=True)
        require(c, "hidden_activation", "gelu_pytorch_tanh")  # mlx-lm: tanh-approximate GELU
        require(c, "use_bidirectional_attention", False, None)  # mlx-lm is causal only
        n = c["num_hidden_layers"]
        kinds = c.get("layer_types")
        if kinds is None:  # transformers: sliding first, then every other layer
            kinds = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
        check_layer_kinds(kinds, (SLIDING, FULL), n)
        window = integer(c["sliding_window"], "sliding_window") if SLIDING in kinds else None
        number(c["query_pre_attn_scalar"], "query_pre_attn_scalar")
        attention_cap = _cap(c, "attn_logit_softcapping")
        _cap(c, "final_logit_softcapping")
        rope_params = hf_rope_parameters(c, default_theta=c.get("rope_theta", 10000.0))
        rope = rope_module(rope_params, c["head_dim"], c["max_position_embeddings"])
        args = gemma2.ModelArgs.from_dict(c)
        module = _Model(
            args,
            list(kinds),
            window,
            lambda: Attention(args, attention_cap, rope),
            c["tie_word_embeddings"],
        )
        if c["attention_bias"]:
            add_attention_bias(module.layers)
        return module

    def postprocess(self, logits: mx.array) -> mx.array:
        cap = self.config.get("final_logit_softcapping", GEMMA2_DEFAULTS["final_logit_softcapping"])
        return mx.tanh(logits / cap) * cap if cap else logits

    def postprocess_is_identity(self) -> bool:
        cap = self.config.get("final_logit_softcapping", GEMMA2_DEFAULTS["final_logit_softcapping"])
        return not cap
