"""Gemma 4 (dense, MoE, per-layer embeddings, KV sharing) over mlx-lm's gemma4_text.

Served: Gemma4ForCausalLM (gemma4_text), Gemma4ForConditionalGeneration (gemma4: the text
model of `text_config`; the vision and audio towers' weights are dropped, so media requests
are refused as for any text model), Gemma4UnifiedForCausalLM (gemma4_unified_text) and
Gemma4UnifiedForConditionalGeneration (gemma4_unified).

Caches (docs/DESIGN.md §3.1): rotating on sliding layers, KV on global layers, and only for
the layers before the first KV-sharing layer; a sharing layer attends to the keys and values
its donor (the last earlier layer of its kind) computed in the same forward.

Where mlx-lm reads a transformers 5 config differently, this adapter follows transformers:
- the global layers' head size and KV heads come from `per_layer_config` (what transformers 5
  writes), else `global_head_dim` (default 512) and, with `attention_k_eq_v`,
  `num_global_key_value_heads`; mlx-lm reads only the latter two;
- defaults are transformers' (no final soft-cap, single-wide MLPs, no per-layer inputs for
  the unified text model, window 512 / 1024); mlx-lm's are another checkpoint's (soft-cap 30,
  double-wide MLPs, 256-wide per-layer inputs);
- the last layer is global, as transformers forces it;
- the head is tied iff `tie_word_embeddings` (default true);
- a KV-sharing layer's attention call gets a read-only view of its donor's batched cache, so
  rows batched over a shared prefix (runner/cache/batch.py) attend to the prefix there too
  (mlx-lm passes no cache, and the donor hands over the rows' suffix keys only);
- `suppress_tokens` of generation_config.json become -inf logits after the soft-cap, in
  `unembed` and `unembed_candidates` alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import ProportionalRoPE

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.cache.shared_prefix import SharedPrefixKV
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_layer_kinds,
    check_rope,
    flag,
    integer,
    json_object,
    number,
    require,
)
from runner.models.decoder import DecoderModel, Float32ExpertsOnCPU, layer_caches
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

# transformers 5 Gemma4TextConfig defaults, where mlx-lm's differ or are missing.
GEMMA4_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
}
# Gemma4UnifiedTextConfig: no per-layer inputs, no MoE, a longer context and window.
UNIFIED_DEFAULTS: dict[str, Any] = {
    **GEMMA4_DEFAULTS,
    "max_position_embeddings": 262144,
    "sliding_window": 1024,
    "use_bidirectional_attention": "vision",
    "hidden_size_per_layer_input": 0,
}
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # per_layer_config keys read here
# Weights of the media towers of the conditional-generation checkpoints (text only here).
_MEDIA_PREFIXES = (
    "vision_tower",
    "multi_modal_projector",
    "audio_tower",
    "embed_audio",
    "embed_vision",
    "vision_embedder",
)


@dataclasses.dataclass(frozen=True)
class _LayerShape:
    head_dim: int
    kv_heads: int


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: `text_config` of the conditional-generation checkpoints."""
    if config.get("model_type") in ("gemma4", "gemma4_unified") or "text_config" in config:
        nested = json_object(config.get("text_config"), "text_config")
        # the composite config's tie flag is the one transformers ties the head by
        if "tie_word_embeddings" in config:
            flag(nested.get("tie_word_embeddings", True), "tie_word_embeddings")
            nested = {**nested, "tie_word_embeddings": config["tie_word_embeddings"]}
        return nested
    return config


def _layer_shapes(c: dict[str, Any], kinds: list[str]) -> list[_LayerShape]:
    """Each layer's head size and KV heads, as transformers' `per_layer_config` resolves them."""
    n = len(kinds)
    if "per_layer_config" in c:
        raw = json_object(c["per_layer_config"], "per_layer_config")
        overrides: dict[int, dict[str, Any]] = {}
        for key, value in raw.items():
            index = int(key) if isinstance(key, str) and key.isdigit() else -1
            if not 0 <= index < n:
                raise ModelLoadError(
                    f"config.json: per_layer_config key {show(key)} is not a layer index"
                )
            entry = json_object(value, f"per_layer_config.{key}")
            unknown = sorted(set(entry) - set(_LAYER_OVERRIDES))
            if unknown:
                raise ModelLoadError(f"per_layer_config.{key}: {', '.join(unknown)} not supported")
            overrides[index] = entry
    else:
        entry = {"head_dim": c.get("global_head_dim", 512)}
        if c["attention_k_eq_v"] and c.get("num_global_key_value_heads") is not None:
            entry["num_key_value_heads"] = c["num_global_key_value_heads"]
        overrides = {i: entry for i, kind in enumerate(kinds) if kind == FULL}
    shapes = []
    heads = c["num_attention_heads"]
    for i in range(n):
        entry = {**{k: c[k] for k in _LAYER_OVERRIDES}, **overrides.get(i, {})}
        head_dim = integer(entry["head_dim"], f"layer {i} head_dim")
        kv_heads = integer(entry["num_key_value_heads"], f"layer {i} num_key_value_heads")
        if heads % kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads {heads} is not a multiple of layer {i}'s "
                f"num_key_value_heads {kv_heads}"
            )
        shapes.append(_LayerShape(head_dim, kv_heads))
    return shapes


def _rope(params: dict[str, Any], head_dim: int, where: str) -> nn.Module:
    """transformers' per-kind RoPE: "default" rotates the whole head (any
    partial_rotary_factor is ignored, as transformers' default init does); "proportional"
    rotates the first fraction's frequencies over the whole head, the rest standing still."""
    if head_dim % 2:
        raise ModelLoadError(
            f"config.json: RoPE would rotate the {head_dim} dimensions of a {where} head; "
            "it rotates pairs"
        )
    params = dict(json_object(params, where))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "proportional"):
        raise ModelLoadError(f"{where}.rope_type {rope_type!r} is not supported")
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", 10_000.0)
    if rope_type == "proportional":
        params.setdefault("factor", 1.0)
    check_rope(params, where)
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return nn.RoPE(head_dim, base=theta)
    fraction = float(params.get("partial_rotary_factor", 1.0))
    rotated = int(fraction * head_dim // 2) * 2
    return ProportionalRoPE(head_dim, rotated, base=theta, factor=float(params["factor"]))


def _kv_donors(kinds: list[str], first_shared: int) -> list[int]:
    """For each layer the layer whose keys and values it uses: itself before `first_shared`,
    then the last earlier layer of its kind (transformers' `kv_sharing_modes`)."""
    last: dict[str, int] = {kind: i for i, kind in enumerate(kinds[:first_shared])}
    missing = sorted(set(kinds[first_shared:]) - set(last))
    if missing:
        raise ModelLoadError(
            f"config.json: num_kv_shared_layers leaves no earlier {', '.join(missing)} layer "
            "to share keys and values from"
        )
    return [i if i < first_shared else last[kinds[i]] for i in range(len(kinds))]


class _SharedView(SharedPrefixKV):
    """What a KV-sharing layer passes as its cache when its donor's cache holds rows batched
    over a shared prefix: the attention call reads the donor's prefix through it (the donor's
    suffix keys and values come as `shared_kv`); nothing is written."""

    def __init__(self, donor: SharedPrefixKV):
        KVCache.__init__(self)
        self.prefix_keys, self.prefix_values = donor.prefix_keys, donor.prefix_values
        self.prefix_len, self.batch, self.offset = donor.prefix_len, donor.batch, donor.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values


class _Experts(Float32ExpertsOnCPU, gemma4_text.Experts):
    """mlx-lm's experts, computed in float32 on the CPU (see Float32ExpertsOnCPU)."""


class _TextModel(gemma4_text.Gemma4TextModel):
    def __init__(
        self,
        args: gemma4_text.ModelArgs,
        kinds: list[str],
        shapes: list[_LayerShape],
        ropes: dict[str, dict[str, Any]],
        donors: list[int],
    ):
        super().__init__(args)
        self.kinds = kinds
        self.donors = donors
        for i, (layer, shape) in enumerate(zip(self.layers, shapes, strict=True)):
            layer_args = dataclasses.replace(
                args,
                head_dim=shape.head_dim,
                global_head_dim=0,  # the layer's own head_dim, set above
                num_key_value_heads=shape.kv_heads,
                num_global_key_value_heads=None,
            )
            layer.self_attn = gemma4_text.Attention(layer_args, i)
            where = f"rope_parameters.{kinds[i]}"
            layer.self_attn.rope = _rope(ropes[kinds[i]], shape.head_dim, where)
            if args.enable_moe_block:
                layer.experts = _Experts(args)
        self.previous_kvs = donors

    def __call__(
        self,
        inputs: Any = None,
        cache: Any = None,
        input_embeddings: Any = None,
        per_layer_inputs: Any = None,  # mlx-lm's signature; the runner passes token ids
    ) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        # transformers: the float32 sqrt(hidden) cast to the weight dtype
        h = h * mx.array(math.sqrt(self.config.hidden_size), mx.float32).astype(h.dtype)
        per_layer: list[Any] = [None] * len(self.layers)
        if self.hidden_size_per_layer_input:
            projected = self._project_per_layer_inputs(h, self._get_per_layer_inputs(inputs))
            per_layer = [projected[:, :, i, :] for i in range(len(self.layers))]
        own = list(cache) if cache is not None else []
        own += [None] * (len(self.layers) - len(own))
        # a sharing layer writes nothing; over a batched prefix it reads its donor's prefix
        caches = [
            _SharedView(own[d]) if d != i and isinstance(own[d], SharedPrefixKV) else own[i]
            for i, d in enumerate(self.donors)
        ]
        masks = self._make_masks(h, caches)
        shared: list[tuple[Any, Any]] = [(None, None)] * len(self.layers)
        for i, layer in enumerate(self.layers):
            donor = self.donors[i]
            kvs, offset = shared[donor] if donor != i else (None, None)
            h, kvs, offset = layer(
                h, masks[i], caches[i], per_layer_input=per_layer[i], shared_kv=kvs, offset=offset
            )
            shared[i] = (kvs, offset)
        return self.norm(h)


class _Model(gemma4_text.Model):
    def __init__(self, args: gemma4_text.ModelArgs, text: _TextModel, nested: bool):
        super().__init__(args)
        self.model = text
        self.nested = nested  # weights under model.language_model., media towers beside

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.nested:
            flat = {}
            for key, value in weights.items():
                inner = key.removeprefix("model.")
                if inner.startswith(_MEDIA_PREFIXES):
                    continue
                flat[inner.replace("language_model.", "model.", 1)] = value
            weights = flat
        if self.tie_word_embeddings:  # transformers ties by config, mlx-lm by the weights
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        elif "lm_head.weight" not in weights:
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        return super().sanitize(weights)

    def make_cache(self) -> list[Any]:
        first_shared = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        return layer_caches(self.model.kinds[:first_shared], self.args.sliding_window)


def _check(c: dict[str, Any]) -> None:
    """The Gemma 4 keys no model can have, or that mlx-lm's layers cannot compute."""
    check_decoder(c, hidden_by_heads=False)
    require(c, "hidden_activation", "gelu_pytorch_tanh")  # mlx-lm: tanh-approximate GELU
    require(c, "use_bidirectional_attention", None, "vision")  # "vision": text is causal
    require(c, "attention_bias", False)  # mlx-lm's Gemma 4 projections have no biases
    for key in ("attention_k_eq_v", "enable_moe_block", "use_double_wide_mlp"):
        flag(c[key], key)
    integer(c["sliding_window"], "sliding_window")
    if c["final_logit_softcapping"] is not None:
        number(c["final_logit_softcapping"], "final_logit_softcapping")
    if c["hidden_size_per_layer_input"]:
        integer(c["hidden_size_per_layer_input"], "hidden_size_per_layer_input")
        integer(c["vocab_size_per_layer_input"], "vocab_size_per_layer_input")
    shared = integer(c["num_kv_shared_layers"], "num_kv_shared_layers", minimum=0)
    if shared >= c["num_hidden_layers"]:
        raise ModelLoadError(
            f"config.json: num_kv_shared_layers {shared} leaves no layer to compute keys"
        )
    if c["enable_moe_block"]:
        experts = integer(c["num_experts"], "num_experts")
        integer(c["top_k_experts"], "top_k_experts", maximum=experts)
        integer(c["moe_intermediate_size"], "moe_intermediate_size")


def _kinds(c: dict[str, Any]) -> list[str]:
    n = c["num_hidden_layers"]
    kinds = c.get("layer_types")
    if kinds is None:
        kinds = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    kinds = list(check_layer_kinds(kinds, (SLIDING, FULL), n))
    kinds[-1] = FULL  # transformers forces the last layer global
    return kinds


@register(
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForCausalLM",
    "Gemma4UnifiedForConditionalGeneration",
    "gemma4_text",
    "gemma4",
    "gemma4_unified_text",
    "gemma4_unified",
)
class Gemma4(DecoderModel):
    DEFAULT_CONTEXT = 131072
    # attention only: mlx-lm's Gemma 4 MLP calls its own compiled geglu, not gelu_approx
    KERNELS = Kernels(attention=(gemma4_text.Attention,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        text = text_config(config)
        unified = "unified" in str(text.get("model_type") or config.get("model_type"))
        c = {**(UNIFIED_DEFAULTS if unified else GEMMA4_DEFAULTS), **text}
        if unified:  # transformers' unified text model has neither per-layer inputs nor MoE
            c["hidden_size_per_layer_input"], c["enable_moe_block"] = 0, False
        _check(c)
        kinds = _kinds(c)
        shapes = _layer_shapes(c, kinds)
        ropes = {**_DEFAULT_ROPE, **json_object(c.get("rope_parameters"), "rope_parameters")}
        first_shared = c["num_hidden_layers"] - c["num_kv_shared_layers"]
        donors = _kv_donors(kinds, first_shared)
        c["layer_types"] = kinds
        c["global_head_dim"] = 0
        c["num_global_key_value_heads"] = None
        c["rope_parameters"] = {}  # each layer's RoPE is set from `ropes`
        c["hidden_size_per_layer_input"] = c["hidden_size_per_layer_input"] or 0
        args = gemma4_text.ModelArgs.from_dict(c)
        model = _TextModel(args, kinds, shapes, ropes, donors)
        return _Model(args, model, nested=text is not config)

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        text = text_config(config)
        super().__init__(module, text, architecture, backend)
        self.suppressed: mx.array | None = None
        if "max_position_embeddings" not in text:
            unified = "unified" in architecture or "unified" in str(text.get("model_type"))
            self.context_length = 262144 if unified else self.DEFAULT_CONTEXT

    def use_generation_config(self, generation_config: dict[str, Any] | None) -> None:
        """Read `suppress_tokens` (ids that must never be produced) from generation_config."""
        ids = (generation_config or {}).get("suppress_tokens")
        if ids is None:
            return
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in ids
        ):
            raise ModelLoadError(
                f"generation_config.json: suppress_tokens must be a list of token ids below "
                f"{self.vocab_size}, not {show(ids)}"
            )
        self.suppressed = mx.array(sorted(set(ids)), dtype=mx.int32) if ids else None

    def postprocess(self, logits: mx.array) -> mx.array:
        cap = self.config.get("final_logit_softcapping")
        return mx.tanh(logits / cap) * cap if cap else logits

    def unembed(self, hidden: mx.array) -> mx.array:
        logits = super().unembed(hidden)
        if self.suppressed is None:
            return logits
        banned = mx.zeros((self.vocab_size,), dtype=mx.bool_)
        banned[self.suppressed] = True
        return mx.where(banned, mx.array(-mx.inf, logits.dtype), logits)

    def unembed_candidates(self, hidden: mx.array, ids: mx.array) -> mx.array:
        logits = super().unembed_candidates(hidden, ids)
        if self.suppressed is None:
            return logits
        banned = (ids[:, None] == self.suppressed[None, :]).any(axis=1)
        return mx.where(banned, mx.array(-mx.inf, logits.dtype), logits)
