"""Gemma3's image side: SigLIP's vision transformer (`VisionTower`, without its pooling
head) and Gemma3's multimodal projector (`MultimodalProjector`), and the vision config they
are built from (`vision_config`).

transformers 5's SiglipVisionModel and Gemma3MultiModalProjector on the same weights are the
reference. The blocks are runner/models/vision_blocks.py's; the weights keep the names
transformers 5 writes under `vision_tower.` and `multi_modal_projector.`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.models.config import flag, integer, json_object, number
from runner.models.vision_blocks import (
    ACTIVATIONS,
    PatchProjection,
    PreNormBlock,
    VisionMLP,
    attention_in_query_blocks,
    check_activation,
)
from runner.sources.source import ModelLoadError, show

# transformers 5's SiglipVisionConfig defaults (the released checkpoints write most of
# them; sparse configs rely on these).
SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}

# Patches whose attention the tower computes at once: a 896-pixel image has 4096 patches,
# whose whole score matrix would be 1 GiB a layer in float32 where MLX composes attention.
QUERY_BLOCK = 1024


def vision_config(config: dict[str, Any]) -> dict[str, Any]:
    """The model config's `vision_config` over SigLIP's defaults, checked."""
    v = {**SIGLIP_DEFAULTS, **json_object(config.get("vision_config"), "vision_config")}
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_channels",
        "image_size",
        "patch_size",
    ):
        integer(v[key], f"vision_config.{key}")
    number(v["layer_norm_eps"], "vision_config.layer_norm_eps")
    flag(v["vision_use_head"], "vision_config.vision_use_head")
    check_activation(v)
    if v["num_channels"] != 3:  # the preprocessor makes RGB pixels
        raise ModelLoadError(
            f"config.json: vision_config.num_channels must be 3, not {show(v['num_channels'])}"
        )
    if v["hidden_size"] % v["num_attention_heads"]:
        raise ModelLoadError(
            f"config.json: vision_config.hidden_size {v['hidden_size']} is not a multiple of "
            f"num_attention_heads {v['num_attention_heads']}"
        )
    if v["image_size"] % v["patch_size"]:
        raise ModelLoadError(
            f"config.json: vision_config.image_size {v['image_size']} is not a multiple of "
            f"patch_size {v['patch_size']}"
        )
    return v


class _PatchEmbedding(PatchProjection):
    """SigLIP's patch convolution (kernel = stride = patch) as one product over the
    flattened patches, keeping the checkpoint's [out, channels, patch, patch] weight."""

    def __init__(self, channels: int, hidden: int, patch: int):
        super().__init__(hidden, (channels, patch, patch))
        self.patch = patch

    def __call__(self, pixels: mx.array) -> mx.array:
        b, c, s, _ = pixels.shape
        p, g = self.patch, s // self.patch
        patches = pixels.reshape(b, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, g * g, c * p * p)
        return self.project(patches)


class _VisionEmbeddings(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        patches = (v["image_size"] // v["patch_size"]) ** 2
        self.patch_embedding = _PatchEmbedding(v["num_channels"], v["hidden_size"], v["patch_size"])
        self.position_embedding = nn.Embedding(patches, v["hidden_size"])

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.patch_embedding(pixels) + self.position_embedding.weight


class _VisionAttention(nn.Module):
    """Separate q/k/v over the patches [B, N, dim], attention over the whole image."""

    def __init__(self, v: dict[str, Any]):
        super().__init__()
        dim = v["hidden_size"]
        self.heads = v["num_attention_heads"]
        self.scale = (dim // self.heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array) -> mx.array:
        b, n, d = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = attention_in_query_blocks(q, k, v, self.scale, QUERY_BLOCK)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, n, d))


def _vision_layer(v: dict[str, Any]) -> PreNormBlock:
    """`layer_norm1`, `self_attn`, `layer_norm2`, `mlp` (`fc1`, `fc2`), as SigLIP names them."""
    attention = _VisionAttention(v)
    mlp = VisionMLP(v["hidden_size"], v["intermediate_size"], ACTIVATIONS[v["hidden_act"]])
    return PreNormBlock(
        v["hidden_size"],
        v["layer_norm_eps"],
        attention,
        mlp,
        norm1="layer_norm1",
        attn="self_attn",
        norm2="layer_norm2",
    )


class _VisionEncoder(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.layers = [_vision_layer(v) for _ in range(v["num_hidden_layers"])]


class VisionTower(nn.Module):
    """SigLIP's vision transformer without its pooling head (Gemma3 reads every patch)."""

    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.embeddings = _VisionEmbeddings(v)
        self.encoder = _VisionEncoder(v)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.embeddings(pixels)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class MultimodalProjector(nn.Module):
    """Gemma3's projector: the patch grid average-pooled to tokens_per_side^2 tokens, a
    Gemma RMSNorm (scale 1 + w), then the product with `mm_input_projection_weight`."""

    def __init__(self, vision_hidden: int, text_hidden: int, patches: int, tokens: int, eps: float):
        super().__init__()
        self.mm_input_projection_weight = mx.zeros((vision_hidden, text_hidden))
        self.mm_soft_emb_norm = nn.RMSNorm(vision_hidden, eps=eps)
        self.patches_per_side = patches
        self.tokens_per_side = tokens
        self.eps = eps

    def __call__(self, patches: mx.array) -> mx.array:
        b, _, d = patches.shape
        g, t = self.patches_per_side, self.tokens_per_side
        k = g // t
        pooled = patches.reshape(b, t, k, t, k, d).mean(axis=(2, 4)).reshape(b, t * t, d)
        weight = 1.0 + self.mm_soft_emb_norm.weight
        normed = mx.fast.rms_norm(pooled, weight, self.eps)
        return normed @ self.mm_input_projection_weight
