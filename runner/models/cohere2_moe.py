"""Cohere2MoeForCausalLM (model_type cohere2_moe), written here after transformers 5's
`cohere2_moe` modeling: mlx-lm has no such model. Pieces of mlx-lm's `cohere2` (the gated
MLP) and `switch_layers` (the routed experts) are reused.

As transformers computes it:
- each layer is parallel: one input norm (LayerNorm without bias, or RMSNorm when
  `rms_norm_eps` is set), then residual + attention + MLP of the same normed input;
- attention kinds from `layer_types` (sliding layers: a window of `sliding_window`, and a
  rotating cache; full layers: a KV cache). RoPE (interleaved pairs) only on sliding layers,
  and on the dense layers when `prefix_dense_sliding_window_pattern` is 1; the other full
  layers have no positions (NoPE);
- MLP kinds from `mlp_layer_types`: dense layers a gated MLP of
  `prefix_dense_intermediate_size` (else `intermediate_size`); sparse layers route each token
  to the top `num_experts_per_tok` of `num_experts` experts by router logit, weighted by the
  softmax of those logits (or their sigmoids, normalised with `norm_topk_prob`), with
  `num_shared_experts` shared experts summed in or averaged with them;
- the head is tied by default (`tie_word_embeddings` true when absent) and its logits are
  multiplied by `logit_scale`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cohere2
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.rope_utils import initialize_rope

from runner.backend.install import Kernels
from runner.models.config import (
    FULL,
    SLIDING,
    check_decoder,
    check_layer_kinds,
    hf_rope_parameters,
    integer,
    mlx_rope,
    number,
    require,
)
from runner.models.decoder import (
    DecoderModel,
    FloatSwitchGLU,
    layer_caches,
    run_layers,
    switch_mlp_weights,
)
from runner.models.registry import register
from runner.sources.source import ModelLoadError, show

# transformers 5 Cohere2MoeConfig defaults.
COHERE2_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000,
    "hidden_size": 8192,
    "intermediate_size": 22528,
    "logit_scale": 0.0625,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "layer_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 4096,
    "num_experts_per_tok": 2,
    "num_experts": 8,
    "num_shared_experts": 0,
    "shared_expert_combination_strategy": "average",
    "expert_selection_fn": "softmax",
    "prefix_dense_sliding_window_pattern": 1,
    "norm_topk_prob": True,
    "prefix_dense_intermediate_size": None,
    "rms_norm_eps": None,
    "sliding_window_pattern": 4,
}
DENSE, SPARSE = "dense", "sparse"


class Attention(nn.Module):
    """transformers' Cohere2MoeAttention: RoPE where `rope` is given, none otherwise.
    `__call__` ends in mlx-lm's `scaled_dot_product_attention`, as the runner's attention
    kernel expects (runner/backend/install.py)."""

    def __init__(self, c: dict[str, Any], rope: nn.Module | None):
        super().__init__()
        dim, head_dim = c["hidden_size"], c["head_dim"]
        self.n_heads, self.n_kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.scale = head_dim**-0.5
        bias = c["attention_bias"]
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.rope = rope

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.rope is not None:
            offset = cache.offset if cache is not None else 0
            queries = self.rope(queries, offset=offset)
            keys = self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.scale, mask=mask
        )
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class SparseMoeBlock(nn.Module):
    """transformers' Cohere2MoeSparseMoeBlock: routed experts plus optional shared ones."""

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        dim, size, experts = c["hidden_size"], c["intermediate_size"], c["num_experts"]
        self.top_k = c["num_experts_per_tok"]
        self.softmax = c["expert_selection_fn"] == "softmax"
        self.norm_topk_prob = c["norm_topk_prob"]
        self.average = c["shared_expert_combination_strategy"] == "average"
        self.gate = nn.Linear(dim, experts, bias=False)
        self.switch_mlp = FloatSwitchGLU(dim, size, experts)
        if c["num_shared_experts"] > 0:
            self.shared_experts = cohere2.MLP(dim, size * c["num_shared_experts"])

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.gate(x)
        inds = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        chosen = mx.take_along_axis(logits, inds, axis=-1)
        if self.softmax:
            scores = mx.softmax(chosen.astype(mx.float32), axis=-1)
        else:
            scores = mx.sigmoid(chosen)
            if self.norm_topk_prob:
                scores = scores / scores.sum(axis=-1, keepdims=True)
        y = (self.switch_mlp(x, inds) * scores.astype(x.dtype)[..., None]).sum(axis=-2)
        if "shared_experts" in self:
            shared = self.shared_experts(x)
            y = (y + shared) / 2 if self.average else y + shared
        return y


class DecoderLayer(nn.Module):
    def __init__(self, c: dict[str, Any], mlp_kind: str, rope: nn.Module | None):
        super().__init__()
        dim = c["hidden_size"]
        self.self_attn = Attention(c, rope)
        if mlp_kind == DENSE:
            size = c["prefix_dense_intermediate_size"] or c["intermediate_size"]
            self.mlp: nn.Module = cohere2.MLP(dim, size)
        else:
            self.mlp = SparseMoeBlock(c)
        self.input_layernorm = _norm(c)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, mask, cache) + self.mlp(h)


def _norm(c: dict[str, Any]) -> nn.Module:
    if c["rms_norm_eps"] is not None:
        return nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
    return nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"], bias=False)


class TextModel(nn.Module):
    def __init__(self, c: dict[str, Any], kinds: list[str], mlp_kinds: list[str], rope: Any):
        super().__init__()
        self.kinds = kinds
        self.window = c["sliding_window"]
        force_rope = c["prefix_dense_sliding_window_pattern"] == 1
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = [
            DecoderLayer(c, mlp, rope if kind == SLIDING or (mlp == DENSE and force_rope) else None)
            for kind, mlp in zip(kinds, mlp_kinds, strict=True)
        ]
        self.norm = _norm(c)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        h = self.embed_tokens(inputs)
        return self.norm(run_layers(self.layers, self.kinds, h, cache, self.window))


class Model(nn.Module):
    def __init__(self, c: dict[str, Any], kinds: list[str], mlp_kinds: list[str], rope: Any):
        super().__init__()
        self.model = TextModel(c, kinds, mlp_kinds, rope)
        self.hf_tied = c["tie_word_embeddings"]
        if not self.hf_tied:
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.hf_tied:  # transformers ties by config, over any lm_head.weight
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        elif "lm_head.weight" not in weights:
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        return switch_mlp_weights(weights)

    def make_cache(self) -> list[Any]:
        m = self.model
        return layer_caches(m.kinds, m.window)


def _kinds(c: dict[str, Any]) -> tuple[list[str], list[str]]:
    """transformers' layer_types and mlp_layer_types, derived as its config does when absent
    (`first_k_dense_replace` dense layers with their own window pattern, then the rest)."""
    n = c["num_hidden_layers"]
    first_dense = integer(c.get("first_k_dense_replace", 0), "first_k_dense_replace", minimum=0)
    kinds = c.get("layer_types")
    if kinds is None:
        prefix = integer(
            c["prefix_dense_sliding_window_pattern"], "prefix_dense_sliding_window_pattern"
        )
        pattern = integer(c["sliding_window_pattern"], "sliding_window_pattern")
        kinds = [SLIDING if (i + 1) % prefix else FULL for i in range(min(first_dense, n))]
        kinds += [SLIDING if (i + 1) % pattern else FULL for i in range(n - len(kinds))]
    check_layer_kinds(kinds, (FULL, SLIDING), n)
    mlp_kinds = c.get("mlp_layer_types")
    if mlp_kinds is None:
        mlp_kinds = [DENSE if i < first_dense else SPARSE for i in range(n)]
    if (
        not isinstance(mlp_kinds, list)
        or len(mlp_kinds) != n
        or not all(isinstance(k, str) and k in (DENSE, SPARSE) for k in mlp_kinds)
    ):
        raise ModelLoadError(
            f"config.json: mlp_layer_types must give dense or sparse for each of the {n} "
            f"layers, not {show(mlp_kinds)}"
        )
    return list(kinds), list(mlp_kinds)


def _check(c: dict[str, Any]) -> None:
    """The sizes and choices beyond check_decoder's, refused by name."""
    eps = c["rms_norm_eps"]
    number(
        c["layer_norm_eps"] if eps is None else eps,
        "layer_norm_eps" if eps is None else "rms_norm_eps",
    )
    number(c["logit_scale"], "logit_scale")
    experts = integer(c["num_experts"], "num_experts")
    top_k = integer(c["num_experts_per_tok"], "num_experts_per_tok")
    if top_k > experts:
        raise ModelLoadError(
            f"config.json: num_experts_per_tok {top_k} is more than num_experts {experts}"
        )
    integer(c["num_shared_experts"], "num_shared_experts", minimum=0)
    if c["prefix_dense_intermediate_size"] is not None:
        integer(c["prefix_dense_intermediate_size"], "prefix_dense_intermediate_size")
    require(c, "expert_selection_fn", "softmax", "sigmoid")
    require(c, "shared_expert_combination_strategy", "average", "sum")
    require(c, "hidden_act", "silu")  # the gated MLPs are SwiGLU


@register("Cohere2MoeForCausalLM", "cohere2_moe")
class Cohere2Moe(DecoderModel):
    DEFAULT_CONTEXT = 8192
    KERNELS = Kernels(attention=(Attention,), swiglu=(cohere2.MLP,))

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**COHERE2_MOE_DEFAULTS, **config}
        if c.get("tie_word_embeddings") is None:  # absent or null: tied
            c["tie_word_embeddings"] = True
        _check(c)
        # the input norms' eps, whichever norm they are
        eps = c["rms_norm_eps"] if c["rms_norm_eps"] is not None else c["layer_norm_eps"]
        check_decoder({**c, "rms_norm_eps": eps}, nullable=("num_key_value_heads",))
        if c.get("num_key_value_heads") is None:  # transformers: as many as the query heads
            c["num_key_value_heads"] = c["num_attention_heads"]
        kinds, mlp_kinds = _kinds(c)
        if SLIDING in kinds:
            integer(c["sliding_window"], "sliding_window")
        rope_params = hf_rope_parameters(c, default_theta=c.get("rope_theta") or 10000.0)
        theta, scaling = mlx_rope(rope_params)
        rope = initialize_rope(
            c["head_dim"], theta, True, scaling, c["max_position_embeddings"]
        )  # interleaved pairs, as transformers' Cohere rotate_half
        return Model(c, kinds, mlp_kinds, rope)

    def postprocess(self, logits: mx.array) -> mx.array:
        return logits * self.config.get("logit_scale", COHERE2_MOE_DEFAULTS["logit_scale"])
