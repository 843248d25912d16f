"""Qwen3_5ForConditionalGeneration (model_type qwen3_5): Qwen3.5's text model with images.

The text model is runner/models/qwen3_5.py's, built from the nested `text_config` (the MoE
sibling, runner/models/qwen3_5_moe.py, puts its own text model under the same image side:
`Qwen3_5ImageModel`); the image side is Qwen3.5's vision tower and patch merger, written
here in `mlx.nn` (mlx-lm has no vision towers). transformers 5 on the same weights is the
reference:
- pixels: `Qwen3_5ImagePreprocessor`, the PIL backend of transformers' Qwen2-VL image
  processor (what AutoImageProcessor gives qwen3_5): `smart_resize` to multiples of
  patch * merge within [min_pixels, max_pixels], bicubic, rescale, normalise, then patches
  [grid_h * grid_w, C * temporal_patch * patch * patch] in merge-block order, the still
  image repeated over the temporal patch;
- an image becomes `<|vision_start|>`, grid_h * grid_w / merge^2 `<|image_pad|>`,
  `<|vision_end|>` (Qwen3VLProcessor); the pads' embeddings are the merged image features.
  Attention stays causal over them (no image attends both ways), so an image's item is
  **causal**: prefill chunks may split it (docs/DESIGN.md, the model contract);
- the tower: patch projection (a Conv3d whose kernel is its stride: one product), learned
  position embeddings interpolated bilinearly (align_corners) from their square grid to the
  image's, 2D rotary embeddings over (row, column), blocks with full attention inside the
  image, then the merger (LayerNorm, 2 x 2 patches concatenated, MLP). Qwen3.5 has no
  deepstack features (Qwen3-VL's early-layer injections);
- positions: transformers' `get_rope_index` gives each token three positions (t, h, w):
  text advances all three by one; an image's tokens take (start, start + row, start +
  column) on its merged grid, and the text after it continues at start + max(rows,
  columns). The text model's rotary angles take pair j from channel h (j % 3 == 1, j < 3 *
  mrope_section[1]), w (j % 3 == 2, j < 3 * mrope_section[2]) or t (the rest): interleaved
  mrope. `position_layout` makes that table for a prepared prompt (`MropeLayout`), and every
  forward of the request passes it (`hidden(..., layout=)`), so a token's rotary position is
  a function of its absolute index (cache offset + i), and tokens past the prompt (decode)
  sit at index + delta. Without a layout (a text-only prompt), t = h = w = index: the text
  path, unchanged.
Checkpoint names: transformers 5 writes `model.language_model.*`, `model.visual.*` and
`lm_head.*`; `mtp.*` (the multi-token-prediction head) is not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from PIL import Image

from runner.backend import Backend
from runner.media.images import decode_image
from runner.media.pixels import PixelRules
from runner.media.prepare import Expansion, ExpansionItem, Item
from runner.models.config import flag, integer, json_object, number
from runner.models.decoder import DecoderModel
from runner.models.qwen3_5 import ImageTextModel, Qwen3_5, image_text_config
from runner.models.registry import register
from runner.sources.source import ModelLoadError, ModelSource, show

# transformers 5's Qwen3_5Config / Qwen3_5VisionConfig defaults.
MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "image_token_id": 248056,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
}
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
MROPE_SECTION = (11, 11, 10)  # transformers' default when rope_parameters has none
_ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}
LAYER_NORM_EPS = 1e-6  # the tower's and the merger's LayerNorms

# Qwen2VLImageProcessorPil's class defaults (a preprocessor_config.json may override them).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
RESCALE = 1 / 255
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
MAX_ASPECT = 200  # smart_resize refuses longer images

# Patches whose attention the tower computes at once: Qwen's largest images have 16384
# patches, whose scores for 256 queries over 16 heads are 256 MiB in float32.
QUERY_BLOCK = 256

Grid = tuple[int, int, int]  # (t, h, w) in patches, before the merge


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' `smart_resize`: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(
            f"invalid image data: aspect ratio {max(height, width) / min(height, width):.1f} "
            f"is over {MAX_ASPECT}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen3_5ImagePreprocessor:
    """Patches for the tower, equal to transformers 5's `Qwen2VLImageProcessorPil` (what
    AutoImageProcessor gives qwen3_5 where torchvision is not installed, as in this
    project's reference environment): RGB with transparency composited onto white;
    `smart_resize`; PIL resize of the uint8 image; float64 x * rescale cast to float32;
    (x - mean) / std in float32; patches in merge-block order (block row, block column,
    row in block, column in block), each C x temporal_patch x patch x patch with the image
    repeated over the temporal patch."""

    def __init__(self, vision: dict[str, Any], preprocessor: dict[str, Any] | None = None):
        """`vision`: the checked vision config, whose patch geometry the pixels must have;
        `preprocessor`: the model's preprocessor_config.json, whose sizes, filter, rescale,
        mean and std win over the class defaults."""
        p = json_object(preprocessor or {}, "preprocessor_config.json")
        for key, tower_key in (
            ("patch_size", "patch_size"),
            ("temporal_patch_size", "temporal_patch_size"),
            ("merge_size", "spatial_merge_size"),
        ):
            value = p.get(key, vision[tower_key])
            if value != vision[tower_key]:
                raise ModelLoadError(
                    f"preprocessor_config.json: {key} {show(value)} is not the vision tower's "
                    f"{vision[tower_key]}"
                )
        self.patch = int(vision["patch_size"])
        self.temporal = int(vision["temporal_patch_size"])
        self.merge = int(vision["spatial_merge_size"])
        size = p.get("size") or {}
        if not isinstance(size, dict):
            raise ModelLoadError(f"preprocessor_config.json: size {show(size)} is not an object")
        low = p.get("min_pixels", size.get("shortest_edge", MIN_PIXELS))
        high = p.get("max_pixels", size.get("longest_edge", MAX_PIXELS))
        self.min_pixels = integer(low, "preprocessor_config.json min_pixels")
        self.max_pixels = integer(high, "preprocessor_config.json max_pixels")
        factor = self.patch * self.merge
        if self.max_pixels < max(self.min_pixels, factor * factor):
            raise ModelLoadError(
                f"preprocessor_config.json: max_pixels {self.max_pixels} is below min_pixels "
                f"{self.min_pixels} or one merged patch ({factor} x {factor})"
            )
        if p.get("do_resize") is False:
            raise ModelLoadError("preprocessor_config.json: no resizing is not supported")
        self.pixels = PixelRules.read(p, Image.Resampling.BICUBIC, RESCALE, IMAGE_MEAN, IMAGE_STD)

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, Grid]:
        """float32 patches [h * w, 3 * T * P * P] and the grid (1, h, w) in patches."""
        rgb = self.pixels.rgb(image)
        factor = self.patch * self.merge
        height, width = smart_resize(
            rgb.height, rgb.width, factor, self.min_pixels, self.max_pixels
        )
        resized = rgb.resize((width, height), resample=self.pixels.resample)
        pixels = self.pixels.normalise(resized)
        p, m, t = self.patch, self.merge, self.temporal
        gh, gw = height // p, width // p
        blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        patches = np.ascontiguousarray(repeated.reshape(gh * gw, 3 * t * p * p), np.float32)
        return patches, (1, gh, gw)


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


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class _Conv3dAsLinear(nn.Module):
    """The patch projection: a Conv3d whose kernel is its stride over one patch is a product
    with the flattened [out, C, T, P, P] weight (kept in the checkpoint's layout)."""

    def __init__(self, channels: int, temporal: int, patch: int, hidden: int):
        super().__init__()
        self.weight = mx.zeros((hidden, channels, temporal, patch, patch))
        self.bias = mx.zeros((hidden,))

    def __call__(self, patches: mx.array) -> mx.array:
        flat = self.weight.reshape(self.weight.shape[0], -1)
        return patches.astype(flat.dtype) @ flat.T + self.bias


class _PatchEmbed(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.proj = _Conv3dAsLinear(
            v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["hidden_size"]
        )

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


class _VisionAttention(nn.Module):
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
        # in query blocks: a large image's whole score matrix would not fit (the CPU
        # composes attention from its products)
        out = mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(
                    q[:, :, i : i + QUERY_BLOCK], k, v, scale=self.scale
                )
                for i in range(0, n, QUERY_BLOCK)
            ],
            axis=2,
        )
        return self.proj(out[0].transpose(1, 0, 2).reshape(n, d))


class _VisionMLP(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.linear_fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.linear_fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])
        self.activation = _ACTIVATIONS[v["hidden_act"]]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class _VisionBlock(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.norm1 = nn.LayerNorm(v["hidden_size"], eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(v["hidden_size"], eps=LAYER_NORM_EPS)
        self.attn = _VisionAttention(v)
        self.mlp = _VisionMLP(v)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


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
        self.blocks = [_VisionBlock(v) for _ in range(v["depth"])]
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


# --- the text model's positions ---------------------------------------------------------


@dataclass(frozen=True)
class MropeLayout:
    """A prompt's 3-channel rotary positions: `table` [3, L] for its L tokens, and `delta`,
    what a token past the prompt adds to its index (transformers' `rope_deltas`)."""

    table: np.ndarray
    delta: int

    def positions(self, start: int, n: int) -> np.ndarray:
        """[3, n] positions of the tokens at absolute indices start .. start + n - 1."""
        index = np.arange(start, start + n)
        out = np.repeat((index + self.delta)[None], 3, axis=0)
        inside = index < self.table.shape[1]
        out[:, inside] = self.table[:, index[inside]]
        return out


def mrope_layout(length: int, items: list[tuple[int, int, Grid]], merge: int) -> MropeLayout:
    """transformers' `get_rope_index` for one prompt of `length` tokens whose image tokens
    are `items` ([start, end) and grid in patches, in order); the rest is text."""
    table = np.empty((3, length), np.int64)
    current = at = 0
    for start, end, (t, h, w) in items:
        table[:, at:start] = np.arange(start - at) + current
        current += start - at
        gh, gw = h // merge, w // merge
        if t * gh * gw != end - start:
            raise ValueError(f"an image of grid {(t, h, w)} cannot fill [{start}, {end})")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        table[:, start:end] = np.stack([tt, hh, ww]).reshape(3, -1) + current
        current += max(gh, gw)
        at = end
    table[:, at:] = np.arange(length - at) + current
    delta = int(table.max()) + 1 - length if length else 0
    return MropeLayout(table, delta)


class _MropeTable:
    """The cos/sin of the forward being built, shared by the full-attention layers' rotary
    modules; None outside a forward with a layout."""

    def __init__(self) -> None:
        self.table: tuple[mx.array, mx.array] | None = None


class LayoutRoPE(nn.Module):
    """A full-attention layer's rotary embedding: mlx-lm's (offset-based) without a layout;
    with one, the forward's 3-channel table over the leading `dims` of each head."""

    def __init__(self, original: nn.Module, shared: _MropeTable):
        super().__init__()
        self.original = original  # a child: the backend may swap in its table rope
        object.__setattr__(self, "_shared", shared)
        self.dims = int(original.dims)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        table = self._shared.table
        if table is None:
            return self.original(x, offset=offset)
        cos, sin = table
        rotated = x[..., : self.dims]
        rotated = rotated * cos.astype(x.dtype) + rotate_half(rotated) * sin.astype(x.dtype)
        if x.shape[-1] == self.dims:
            return rotated
        return mx.concatenate([rotated, x[..., self.dims :]], axis=-1)


def mrope_channels(pairs: int, section: tuple[int, ...]) -> np.ndarray:
    """Which position channel (0 t, 1 h, 2 w) rotates each pair: transformers' interleaved
    `recomposition_frequencies`."""
    channels = np.zeros(pairs, np.int64)
    for channel in (1, 2):
        channels[channel : min(section[channel] * 3, pairs) : 3] = channel
    return channels


# --- the module and the model -------------------------------------------------------------

# checkpoint prefix -> internal prefix of the tower
_VISION_PREFIXES = ("model.visual.", "visual.")


class VisionWeights:
    """Mixin for an image-text checkpoint's text module (mlx-lm's, whose own `sanitize` reads
    the text weights): the tower's weights go to `visual` untouched, the rest to the text
    module's `sanitize`. Put it first among the bases."""

    visual: VisionModel

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        vision, rest = {}, {}
        for name, value in weights.items():
            prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                rest[name] = value
            else:
                vision["visual." + name[len(prefix) :]] = value
        return {**super().sanitize(rest), **vision}  # type: ignore[misc]


class _VisionTextModel(VisionWeights, ImageTextModel):
    """The image-text checkpoint's text model (mlx-lm's) beside the tower (`visual`)."""


def _vision_config(config: dict[str, Any]) -> dict[str, Any]:
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
    if v["hidden_act"] not in _ACTIVATIONS:
        raise ModelLoadError(
            f"config.json: vision_config.hidden_act must be one of {', '.join(_ACTIVATIONS)}, "
            f"not {show(v['hidden_act'])}"
        )
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


def _mrope_section(text_config: dict[str, Any]) -> tuple[int, int, int]:
    rope = text_config.get("rope_parameters") or {}
    section = rope.get("mrope_section", list(MROPE_SECTION)) if isinstance(rope, dict) else None
    if not (
        isinstance(section, list | tuple)
        and len(section) == 3
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
    ):
        raise ModelLoadError(
            f"config.json: text_config.rope_parameters.mrope_section {show(section)} is not "
            "three non-negative integers"
        )
    if rope.get("mrope_interleaved", True) is not True:
        raise ModelLoadError(
            "config.json: text_config.rope_parameters.mrope_interleaved must be true "
            "(transformers' Qwen3.5 interleaves its sections)"
        )
    return section[0], section[1], section[2]


class Qwen3_5ImageModel(DecoderModel):
    """A Qwen3.5 text family with image input (`ImageModel`, runner/models/base.py), whose
    prompts carry a position layout: the tower, preprocessing, expansions and positions are
    the same for every text family (transformers' dense and MoE image-text models differ in
    their text models only). A family subclasses it with `build_text_module`, putting its
    own text adapter after this class among the bases where that adapter has an
    `__init__` of its own (runner/models/qwen3_5_moe.py)."""

    DEFAULT_CONTEXT = 32768

    @classmethod
    def build_text_module(cls, text_config: dict[str, Any]) -> nn.Module:
        """The family's mlx-lm text module for the nested `text_config`, its class's
        `sanitize` reading the image-text checkpoint (`VisionWeights` first among its bases)."""
        raise NotImplementedError

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**MULTIMODAL_DEFAULTS, **config}
        flag(c["tie_word_embeddings"], "tie_word_embeddings")
        text_config = image_text_config(c)
        module = cls.build_text_module(text_config)
        v = _vision_config(c)
        hidden = module.args.hidden_size
        if v["out_hidden_size"] != hidden:
            raise ModelLoadError(
                f"config.json: vision_config.out_hidden_size {v['out_hidden_size']} is not the "
                f"text model's hidden_size {hidden}"
            )
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if integer(c[key], key, minimum=0) >= module.args.vocab_size:
                raise ModelLoadError(f"config.json: {key} is outside the vocabulary")
        _mrope_section(text_config)
        module.visual = VisionModel(v)
        shared = _MropeTable()
        for layer in module.model.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.rope = LayoutRoPE(layer.self_attn.rope, shared)
        object.__setattr__(module, "mrope_table", shared)
        return module

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        c = {**MULTIMODAL_DEFAULTS, **config}
        text_config = image_text_config(c)
        super().__init__(module, text_config, architecture, backend)
        self.vision = _vision_config(c)
        self.image_token_id = int(c["image_token_id"])
        self.vision_start_token_id = int(c["vision_start_token_id"])
        self.vision_end_token_id = int(c["vision_end_token_id"])
        self.merge = int(self.vision["spatial_merge_size"])
        self.preprocessor = Qwen3_5ImagePreprocessor(self.vision)
        head_dim = module.args.head_dim
        rotary = int(head_dim * module.args.partial_rotary_factor)
        theta = float(module.args.rope_theta)
        self.inv_freq = 1.0 / (theta ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary))
        self.channels = mrope_channels(rotary // 2, _mrope_section(text_config))
        self.mrope_table: _MropeTable = module.mrope_table

    def bind_source(self, source: ModelSource) -> None:
        """The preprocessor_config.json the model came with (if any)."""
        if source.preprocessor_config is not None:
            self.preprocessor = Qwen3_5ImagePreprocessor(self.vision, source.preprocessor_config)

    # The request side's interface (`ImageModel`).

    def preprocess(self, data: bytes) -> tuple[np.ndarray, Grid]:
        """Image bytes to the tower's patches and grid (any thread; deterministic). Raises
        ValueError("invalid image data: ...") for bytes that are not an image."""
        return self.preprocessor(decode_image(data))

    def prepare_image(self, data: bytes) -> Expansion:
        """vision_start, the image's pads (one causal item, its grid the item's opaque
        state), vision_end."""
        patches, grid = self.preprocess(data)
        n = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
        tokens = [self.vision_start_token_id, *[self.image_token_id] * n]
        tokens.append(self.vision_end_token_id)
        return Expansion(tokens, [ExpansionItem(1, 1 + n, patches, causal=True, opaque=grid)])

    def position_layout(self, tokens: list[int], items: list[Item]) -> MropeLayout | None:
        """The prompt's 3-channel positions (None without images: the text path)."""
        if not items:
            return None
        return mrope_layout(len(tokens), [(i.start, i.end, i.opaque) for i in items], self.merge)

    def encode_item(self, item: Item) -> mx.array:
        """The item's features [end - start, hidden]."""
        return self.encode_image(mx.array(item.pixels), item.opaque)

    def encode_image(self, patches: mx.array, grid: Grid) -> mx.array:
        t, h, w = grid
        width = 3 * self.vision["temporal_patch_size"] * self.vision["patch_size"] ** 2
        if t != 1 or h % self.merge or w % self.merge or tuple(patches.shape) != (h * w, width):
            raise ValueError(
                f"patches {list(patches.shape)} of grid {list(grid)} are not one image's"
            )
        return self.module.visual(patches, grid)

    def hidden(
        self,
        tokens: mx.array,
        caches: list[Any],
        media: list[tuple[int, mx.array]] | None = None,
        layout: MropeLayout | None = None,
    ) -> mx.array:
        """The text model's hidden states. `media`: [(pos, rows)] with positions relative to
        this block (rows may be part of an image); `layout`: the prompt's positions, for
        every block of a request whose prompt has images (decode steps included)."""
        if not media and layout is None:
            return super().hidden(tokens, caches)
        text = self.module.model
        h = text.embed_tokens(tokens)
        if media:
            h = _splice(h, media)
        if layout is None:
            return text(tokens, cache=caches, input_embeddings=h)
        start = 0
        if text.fa_idx is not None and caches is not None:
            start = int(caches[text.fa_idx].offset)
        self.mrope_table.table = self._rotary_table(layout.positions(start, tokens.shape[1]))
        try:
            return text(tokens, cache=caches, input_embeddings=h)
        finally:
            self.mrope_table.table = None

    def _rotary_table(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        """cos, sin [n, rotary dims] for positions [3, n]: pair j turns by its channel's
        position (float64 angles, float32 tables)."""
        chosen = positions[self.channels, :].T  # [n, pairs]
        angles = chosen * self.inv_freq[None, :]
        angles = np.concatenate([angles, angles], axis=-1)
        return mx.array(np.cos(angles).astype(np.float32)), mx.array(
            np.sin(angles).astype(np.float32)
        )


@register("Qwen3_5ForConditionalGeneration", "qwen3_5")
class Qwen3_5Multimodal(Qwen3_5ImageModel):
    """Qwen3.5 (dense) with images."""

    KERNELS = Qwen3_5.KERNELS

    @classmethod
    def build_text_module(cls, text_config: dict[str, Any]) -> nn.Module:
        return Qwen3_5.build_module(text_config, _VisionTextModel)


def _splice(h: mx.array, media: list[tuple[int, mx.array]]) -> mx.array:
    """Embeddings [1, n, H] with each (pos, rows) written over positions pos .. pos + len."""
    b, n, width = h.shape
    if b != 1:
        raise ValueError("media is computed one row at a time")
    parts, at = [], 0
    for pos, rows in sorted(media, key=lambda m: m[0]):
        length = rows.shape[0]
        if pos < at or pos + length > n or tuple(rows.shape[1:]) != (width,):
            raise ValueError(
                f"media at {pos} with features {list(rows.shape)} does not fit a chunk of "
                f"{n} tokens and hidden size {width}"
            )
        parts += [h[:, at:pos], rows[None].astype(h.dtype)]
        at = pos + length
    return mx.concatenate([*parts, h[:, at:]], axis=1)
