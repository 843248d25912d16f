"""Qwen3.5's vision tower and patch merger (`VisionModel`: one image's patches -> its token
features), and the vision config it is built from (`vision_config`).

transformers 5's Qwen3.5 vision model on the same weights is the reference: the patch
projection (a Conv3d whose kernel is its stride: one product), learned position embeddings
interpolated bilinearly (align_corners) from their square grid to the image's, 2D rotary
embeddings over (row, column), blocks with full attention inside the image, then the merger
(LayerNorm, 2 x 2 patches concatenated, MLP). Qwen3.5 has no deepstack features (Qwen3-VL's
early-layer injections). The blocks are runner/models/vision_blocks.py's; the weights keep
the checkpoint's names under `model.visual.`.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.models.config import integer, json_object, number
from runner.models.qwen3_5_vision.processor import Grid
from runner.models.vision_blocks import (
    ACTIVATIONS,
    PatchProjection,
    PreNormBlock,
    VisionMLP,
    attention_in_query_blocks,
    check_activation,
    rotate_half,
)
from runner.sources.source import ModelLoadError, show

# transformers 5's Qwen3_5VisionConfig defaults.
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}
VISION_ROPE_THETA = 10000.0
LAYER_NORM_EPS = 1e-6  # the tower's and the merger's LayerNorms

# Patches whose attention the tower computes at once: Qwen's largest images have 16384
# patches, whose scores for 256 queries over 16 heads are 256 MiB in float32.
QUERY_BLOCK = 256


def vision_config(config: dict[str, Any]) -> dict[str, Any]:
    """The model config's `vision_config` over transformers' defaults, checked, with its
    rotary `rope_theta`."""
    v = {**VISION_DEFAULTS, **json_object(config.get("vision_config"), "vision_config")}
    for key in (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "in_channels",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "out_hidden_size",
        "num_position_embeddings",
    ):
        integer(v[key], f"vision_config.{key}")
    check_activation(v)
    if v["in_channels"] != 3:  # the preprocessor makes RGB pixels
        raise ModelLoadError(
            f"config.json: vision_config.in_channels must be 3, not {show(v['in_channels'])}"
        )
    if v["hidden_size"] % (v["num_heads"] * 4):
        raise ModelLoadError(
            f"config.json: vision_config.hidden_size {v['hidden_size']} is not a multiple of "
            f"4 x num_heads {v['num_heads']} (the 2D rotary embedding's pairs)"
        )
    side = math.isqrt(v["num_position_embeddings"])
    if side * side != v["num_position_embeddings"]:
        raise ModelLoadError(
            f"config.json: vision_config.num_position_embeddings "
            f"{v['num_position_embeddings']} is not a square"
        )
    rope = json_object(v.get("rope_parameters") or {}, "vision_config.rope_parameters")
    if rope.get("rope_type", "axial") != "axial":
        raise ModelLoadError(
            f"config.json: vision_config.rope_parameters.rope_type {show(rope['rope_type'])} "
            "is not axial"
        )
    v["rope_theta"] = number(rope.get("rope_theta", VISION_ROPE_THETA), "vision rope_theta")
    return v


def block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch of an h x w grid in merge-block order."""
    within = np.arange(h * w)
    blocks_w = w // merge
    row = (within // (merge * merge * blocks_w)) * merge + (within // merge) % merge
    col = ((within // (merge * merge)) % blocks_w) * merge + within % merge
    return row, col


def _interpolation_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps into `side` learned positions for `index` of `size` (align_corners),
    in float32 as transformers computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
    return taps, weights.astype(np.float32)


def position_interpolation(grid: Grid, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices [N, 4] into the learned position table and their weights [N, 4] for each patch
    (merge-block order), transformers' `get_vision_interpolation_indices_and_weights`."""
    _, h, w = grid
    row, col = block_order(h, w, merge)
    h_taps, h_weights = _interpolation_taps(row, h, side)
    w_taps, w_weights = _interpolation_taps(col, w, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def vision_rotary(grid: Grid, merge: int, head_dim: int, theta: float) -> tuple[mx.array, ...]:
    """cos, sin [N, head_dim] of the tower's 2D rotary embedding: the first half of each
    head's pairs rotate by the patch's row, the second by its column."""
    _, h, w = grid
    row, col = block_order(h, w, merge)
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    angles = np.concatenate([row[:, None] * inv_freq, col[:, None] * inv_freq], axis=-1)
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float32)
    return mx.array(np.cos(angles)), mx.array(np.sin(angles))


class _Conv3dAsLinear(PatchProjection):
    """The patch projection: a Conv3d whose kernel is its stride over one patch is a product
    with the flattened [out, C, T, P, P] weight (kept in the checkpoint's layout)."""

    def __init__(self, channels: int, temporal: int, patch: int, hidden: int):
        super().__init__(hidden, (channels, temporal, patch, patch))

    def __call__(self, patches: mx.array) -> mx.array:
        return self.project(patches.astype(self.weight.dtype))


class _PatchEmbed(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.proj = _Conv3dAsLinear(
            v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["hidden_size"]
        )

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


class _VisionAttention(nn.Module):
    """Fused q/k/v over the patches [N, dim], q and k turned by the 2D rotary embedding (in
    float32, as transformers rotates), attention over the whole image."""

    def __init__(self, v: dict[str, Any]):
        super().__init__()
        dim = v["hidden_size"]
        self.heads = v["num_heads"]
        self.scale = (dim // self.heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n, d = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.heads, -1)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [N, heads, head_dim]
        c, s = cos[:, None, :], sin[:, None, :]  # in float32, as transformers rotates

        def rotate(t: mx.array) -> mx.array:
            t32 = t.astype(mx.float32)
            return (t32 * c + rotate_half(t32) * s).astype(t.dtype)

        q, k = rotate(q), rotate(k)
        q, k, v = (t.transpose(1, 0, 2)[None] for t in (q, k, v))  # [1, heads, N, head_dim]
        out = attention_in_query_blocks(q, k, v, self.scale, QUERY_BLOCK)
        return self.proj(out[0].transpose(1, 0, 2).reshape(n, d))


def _vision_block(v: dict[str, Any]) -> PreNormBlock:
    """`norm1`, `attn`, `norm2`, `mlp` (`linear_fc1`, `linear_fc2`), as the checkpoint says."""
    attention = _VisionAttention(v)
    mlp = VisionMLP(
        v["hidden_size"],
        v["intermediate_size"],
        ACTIVATIONS[v["hidden_act"]],
        fc1="linear_fc1",
        fc2="linear_fc2",
    )
    return PreNormBlock(v["hidden_size"], LAYER_NORM_EPS, attention, mlp)


class _PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge x merge block of patches concatenated (they are
    adjacent in block order) through fc1, exact GELU, fc2 to the text model's width."""

    def __init__(self, v: dict[str, Any]):
        super().__init__()
        merged = v["hidden_size"] * v["spatial_merge_size"] ** 2
        self.norm = nn.LayerNorm(v["hidden_size"], eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, v["out_hidden_size"])
        self.merged = merged

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    """Qwen3.5's vision tower and merger: patches of one image -> its token features."""

    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.patch_embed = _PatchEmbed(v)
        self.pos_embed = nn.Embedding(v["num_position_embeddings"], v["hidden_size"])
        self.blocks = [_vision_block(v) for _ in range(v["depth"])]
        self.merger = _PatchMerger(v)
        self.side = math.isqrt(v["num_position_embeddings"])
        self.merge = v["spatial_merge_size"]
        self.head_dim = v["hidden_size"] // v["num_heads"]
        self.theta = v["rope_theta"]

    def __call__(self, patches: mx.array, grid: Grid) -> mx.array:
        indices, weights = position_interpolation(grid, self.side, self.merge)
        h = self.patch_embed(patches)
        table = self.pos_embed.weight
        positions = (
            table[mx.array(indices)] * mx.array(weights)[..., None].astype(table.dtype)
        ).sum(1)
        h = h + positions.astype(h.dtype)
        cos, sin = vision_rotary(grid, self.merge, self.head_dim, self.theta)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.merger(h)
