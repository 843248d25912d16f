"""Gemma3ForConditionalGeneration (model_type gemma3): the text family with images.

The text model is runner/models/gemma3.py's, built from the nested `text_config`; the image
side is SigLIP's vision tower and Gemma3's multimodal projector, written here in `mlx.nn`
(mlx-lm has no vision towers). transformers 5 on the same weights is the reference:
- pixels: `Gemma3ImagePreprocessor`, the PIL backend of transformers' Gemma3 image processor;
- an image becomes `expansion()`: "\\n\\n", <start_of_image>, mm_tokens_per_image soft tokens,
  <end_of_image>, "\\n\\n" (`Gemma3Processor.full_image_sequence`); the soft tokens' embeddings
  are the projected image features, not scaled by sqrt(hidden) as token embeddings are;
- the soft tokens of one image attend to each other both ways (transformers' token_type_ids
  mask: full layers causal OR same image, sliding layers that AND the window), so an image is
  evaluated whole, in one forward: its expansion is atomic (docs/DESIGN.md, the model
  contract); everything else is the text model's causal attention;
- the head is tied iff the top-level `tie_word_embeddings` (default true), and, unlike
  Gemma3ForCausalLM, transformers' conditional-generation head applies no
  `final_logit_softcapping`.
Checkpoint names: transformers 5 writes `language_model.model.*`, `vision_tower.*` and
`multi_modal_projector.*`; Google's checkpoints spell the tower `vision_tower.vision_model.*`,
and transformers 4 wrote everything under `model.`; all are read.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from PIL import Image

from runner.backend import Backend
from runner.media.images import decode_image
from runner.media.pixels import PixelRules
from runner.media.prepare import Expansion, ExpansionItem, Item
from runner.models import gemma3
from runner.models.config import SLIDING, flag, integer, json_object, number
from runner.models.gemma3 import GEMMA3_DEFAULTS, Gemma3
from runner.models.registry import register
from runner.sources.source import ModelLoadError, ModelSource, show
from runner.text.tokenizer import Tokenizer

# transformers 5's Gemma3Config and SiglipVisionConfig defaults (the released checkpoints
# write most of them; sparse configs rely on these).
MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "mm_tokens_per_image": 256,
    "boi_token_index": 255_999,
    "eoi_token_index": 256_000,
    "image_token_index": 262_144,
    "tie_word_embeddings": True,
}
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
_ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}

# Gemma3ImageProcessor's class defaults, which Google's preprocessor_config.json repeats
# (size = the tower's image_size): bilinear resize, x/255, then (x - 0.5) / 0.5.
RESCALE = 1 / 255
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)

NEWLINES = "\n\n"  # what Gemma3Processor puts around each image
QUERY_BLOCK = 1024  # patches whose attention the tower computes at once


class Gemma3ImagePreprocessor:
    """Pixels for the tower: float32 [3, S, S], equal to transformers 5's Gemma3 image
    processor with pan-and-scan off (its default). That is the PIL backend
    (`Gemma3ImageProcessorPil`), the one `AutoImageProcessor` gives wherever torchvision is
    not installed, as in this project's reference environment. The torchvision backend
    (what AutoImageProcessor gives where torchvision is installed) resizes with torch's
    uint8 antialiasing, which differs from Pillow's by one grey level (2/255 after the
    normalisation) on up to a fifth of the pixels when upscaling. Steps, as
    transformers does them: RGB with transparency composited onto white; PIL bilinear resize
    of the uint8 image to S x S; float64 x / 255 cast to float32; (x - mean) / std in
    float32."""

    def __init__(self, config: dict[str, Any], preprocessor: dict[str, Any] | None = None):
        """`preprocessor`: the model's preprocessor_config.json, whose resample filter,
        rescale factor, mean and std (and do_rescale / do_normalize / do_convert_rgb) win over
        the class defaults; its size must be the tower's."""
        vision = {**SIGLIP_DEFAULTS, **json_object(config.get("vision_config"), "vision_config")}
        self.size = integer(vision["image_size"], "vision_config.image_size")
        p = json_object(preprocessor or {}, "preprocessor_config.json")
        size = p.get("size") or {"height": self.size, "width": self.size}
        if not isinstance(size, dict) or (size.get("height"), size.get("width")) != (
            self.size,
            self.size,
        ):
            raise ModelLoadError(
                f"preprocessor_config.json: size {show(size)} is not the vision tower's "
                f"{self.size} x {self.size}"
            )
        if p.get("do_pan_and_scan") or p.get("do_resize") is False:
            raise ModelLoadError(
                "preprocessor_config.json: pan-and-scan and no resizing are not supported"
            )
        self.pixels = PixelRules.read(p, Image.Resampling.BILINEAR, RESCALE, IMAGE_MEAN, IMAGE_STD)

    def __call__(self, image: Image.Image) -> np.ndarray:
        rgb = self.pixels.rgb(image)
        resized = rgb.resize((self.size, self.size), resample=self.pixels.resample)
        return self.pixels.normalise(resized)


class _PatchEmbedding(nn.Module):
    """SigLIP's patch convolution (kernel = stride = patch) as one product over the
    flattened patches, keeping the checkpoint's [out, channels, patch, patch] weight."""

    def __init__(self, channels: int, hidden: int, patch: int):
        super().__init__()
        self.patch = patch
        self.weight = mx.zeros((hidden, channels, patch, patch))
        self.bias = mx.zeros((hidden,))

    def __call__(self, pixels: mx.array) -> mx.array:
        b, c, s, _ = pixels.shape
        p, g = self.patch, s // self.patch
        patches = pixels.reshape(b, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, g * g, c * p * p)
        return patches @ self.weight.reshape(self.weight.shape[0], -1).T + self.bias


class _VisionEmbeddings(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        patches = (v["image_size"] // v["patch_size"]) ** 2
        self.patch_embedding = _PatchEmbedding(v["num_channels"], v["hidden_size"], v["patch_size"])
        self.position_embedding = nn.Embedding(patches, v["hidden_size"])

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.patch_embedding(pixels) + self.position_embedding.weight


class _VisionAttention(nn.Module):
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
        # in query blocks: a 896-pixel image has 4096 patches, whose whole score matrix
        # would be 1 GiB a layer in float32 where MLX composes attention (the CPU)
        out = mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(
                    q[:, :, i : i + QUERY_BLOCK], k, v, scale=self.scale
                )
                for i in range(0, n, QUERY_BLOCK)
            ],
            axis=2,
        )
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, n, d))


class _VisionMLP(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])
        self.activation = _ACTIVATIONS[v["hidden_act"]]

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.activation(self.fc1(x)))


class _VisionLayer(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        eps = v["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.self_attn = _VisionAttention(v)
        self.layer_norm2 = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.mlp = _VisionMLP(v)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _VisionEncoder(nn.Module):
    def __init__(self, v: dict[str, Any]):
        super().__init__()
        self.layers = [_VisionLayer(v) for _ in range(v["num_hidden_layers"])]


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


class _MultimodalModule(nn.Module):
    """The text model's parts (`model`, `lm_head` until a tie removes it) beside the tower
    and the projector, under the names the runner's loader and adapter read."""

    def __init__(self, text: gemma3._Model, tower: VisionTower, projector: MultimodalProjector):
        super().__init__()
        self.args = text.args
        self.model = text.model
        self.lm_head = text.lm_head
        self.vision_tower = tower
        self.multi_modal_projector = projector
        self.hf_tied = text.hf_tied

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        renamed: dict[str, mx.array] = {}
        for name, value in weights.items():
            new = _internal_name(name)
            if new is None:
                continue
            if new in renamed:
                raise ModelLoadError(f"weights: {name} is given twice under different names")
            renamed[new] = value
        if self.hf_tied:
            renamed.pop("lm_head.weight", None)
            self.pop("lm_head")
        elif "lm_head.weight" not in renamed:
            raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
        return renamed

    def make_cache(self) -> list[Any]:
        return gemma3._Model.make_cache(self)  # type: ignore[arg-type]  # same fields


# checkpoint prefix -> internal prefix, longest first; None drops (SigLIP's unused head)
_PREFIXES: tuple[tuple[str, str | None], ...] = (
    ("model.vision_tower.vision_model.head.", None),
    ("vision_tower.vision_model.head.", None),
    ("model.vision_tower.head.", None),
    ("vision_tower.head.", None),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)


def _internal_name(name: str) -> str | None:
    for prefix, internal in _PREFIXES:
        if name.startswith(prefix):
            return None if internal is None else internal + name[len(prefix) :]
    return name  # an unknown name: the strict load reports it


def _vision_config(config: dict[str, Any]) -> dict[str, Any]:
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
    if v["hidden_act"] not in _ACTIVATIONS:
        raise ModelLoadError(
            f"config.json: vision_config.hidden_act must be one of {', '.join(_ACTIVATIONS)}, "
            f"not {show(v['hidden_act'])}"
        )
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


def _token_id(config: dict[str, Any], key: str, alias: str) -> int:
    """A special token id under its config key, else under the name transformers maps to it
    (`attribute_map`: image_token_id -> image_token_index), else the default."""
    value = config[key] if key in config else config.get(alias, MULTIMODAL_DEFAULTS[key])
    return integer(value, key, minimum=0)


@register("Gemma3ForConditionalGeneration", "gemma3")
class Gemma3Multimodal(Gemma3):
    """Gemma3's text model with image input: the runner's Gemma3 adapter plus the interface
    the request side calls (`expansion`, `preprocess`, `encode_image`, `hidden(..., media)`).
    """

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        c = {**MULTIMODAL_DEFAULTS, **config}
        text_config = json_object(c.get("text_config"), "text_config")
        tied = flag(c["tie_word_embeddings"], "tie_word_embeddings")
        text = Gemma3.build_module({**text_config, "tie_word_embeddings": tied})
        t = {**GEMMA3_DEFAULTS, **text_config}
        v = _vision_config(c)
        tokens = integer(c["mm_tokens_per_image"], "mm_tokens_per_image")
        side = math.isqrt(tokens)
        patches = v["image_size"] // v["patch_size"]
        if side * side != tokens or patches % side:
            raise ModelLoadError(
                f"config.json: mm_tokens_per_image {tokens} must be a square whose side divides "
                f"the {patches} patches on a side of the image"
            )
        vocab = t["vocab_size"]
        for key, alias in (
            ("boi_token_index", "boi_token_id"),
            ("eoi_token_index", "eoi_token_id"),
        ):
            if _token_id(config, key, alias) >= vocab:
                raise ModelLoadError(f"config.json: {key} is outside the vocabulary of {vocab}")
        _token_id(config, "image_token_index", "image_token_id")
        projector = MultimodalProjector(
            v["hidden_size"], t["hidden_size"], patches, side, v["layer_norm_eps"]
        )
        return _MultimodalModule(text, VisionTower(v), projector)  # type: ignore[arg-type]

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        super().__init__(module, config, architecture, backend)
        c = {**MULTIMODAL_DEFAULTS, **config}
        text_config = {**GEMMA3_DEFAULTS, **(config.get("text_config") or {})}
        self.context_length = int(text_config["max_position_embeddings"])
        self.image_tokens = int(c["mm_tokens_per_image"])
        self.image_token_id = _token_id(config, "image_token_index", "image_token_id")
        self.boi_token_id = _token_id(config, "boi_token_index", "boi_token_id")
        self.eoi_token_id = _token_id(config, "eoi_token_index", "eoi_token_id")
        self.hidden_size = int(text_config["hidden_size"])
        self.newline_ids: list[int] | None = None  # "\n\n", from the tokenizer (bind_source)
        self.preprocessor = Gemma3ImagePreprocessor(config)

    def bind_source(self, source: ModelSource) -> None:
        """Read what config.json does not say: the tokenizer's "\\n\\n" ids, and the
        preprocessor_config.json the model came with (if any)."""
        tokenizer = Tokenizer(source.tokenizer_json, tokenizer_config=source.tokenizer_config)
        self.newline_ids = tokenizer.encode(NEWLINES)
        if source.preprocessor_config is not None:
            self.preprocessor = Gemma3ImagePreprocessor(self.config, source.preprocessor_config)

    def postprocess(self, logits: mx.array) -> mx.array:
        return logits  # the conditional-generation head has no final soft-capping

    # The request side's interface.

    def expansion(self) -> tuple[list[int], int, int]:
        """The token ids an image tag becomes, and the [start, end) of its soft tokens (the
        atomic range the features replace), as Gemma3Processor expands `<start_of_image>`.
        The blank lines are the tokenizer's "\\n\\n" on their own: the Go runner tokenizes
        the text around a tag separately, so they never merge with neighbouring text."""
        if self.newline_ids is None:
            raise RuntimeError("expansion() needs the tokenizer: the model was not bound to it")
        nl = list(self.newline_ids)
        start = len(nl) + 1
        ids = [*nl, self.boi_token_id, *[self.image_token_id] * self.image_tokens]
        ids += [self.eoi_token_id, *nl]
        return ids, start, start + self.image_tokens

    def preprocess(self, data: bytes) -> np.ndarray:
        """Image bytes to the tower's float32 [3, S, S] pixels (any thread; deterministic).
        Raises ValueError("invalid image data: ...") for bytes that are not an image."""
        return self.preprocessor(decode_image(data))

    def prepare_image(self, data: bytes) -> Expansion:
        """`ImageModel`: the expansion of one image, its soft tokens one atomic item."""
        ids, start, end = self.expansion()
        return Expansion(ids, [ExpansionItem(start, end, self.preprocess(data), causal=False)])

    def encode_item(self, item: Item) -> mx.array:
        """`ImageModel`: the item's features [image_tokens, text hidden]."""
        return self.encode_image(mx.array(item.pixels)[None])

    def encode_image(self, pixels: mx.array) -> mx.array:
        """[1, 3, S, S] pixels -> [image_tokens, text hidden] features (lazy)."""
        s = self.preprocessor.size
        if tuple(pixels.shape) != (1, 3, s, s):
            raise ValueError(f"pixels must be [1, 3, {s}, {s}], not {list(pixels.shape)}")
        dtype = self.module.multi_modal_projector.mm_input_projection_weight.dtype
        features = self.module.multi_modal_projector(self.module.vision_tower(pixels.astype(dtype)))
        return features[0]

    def hidden(
        self,
        tokens: mx.array,
        caches: list[Any],
        media: list[tuple[int, mx.array]] | None = None,
    ) -> mx.array:
        """The text model's hidden states; `media` is [(pos, features)] with positions
        relative to this chunk, each image whole inside it. Without media, the text path."""
        if not media:
            return super().hidden(tokens, caches)
        b, n = tokens.shape
        if b != 1:
            raise ValueError("media is computed one row at a time")
        text = self.module.model
        ids = tokens
        if self.image_token_id >= self.vocab_size:  # as transformers: an id the table lacks
            ids = mx.where(tokens == self.image_token_id, 0, tokens)
        h = text.embed_tokens(ids)
        h = h * mx.array(math.sqrt(text.args.hidden_size), mx.float32).astype(h.dtype)
        parts, blocks, at = [], np.full(n, -1, np.int64), 0
        for index, (pos, features) in enumerate(sorted(media, key=lambda m: m[0])):
            length = features.shape[0]
            if pos < at or pos + length > n or tuple(features.shape[1:]) != (h.shape[-1],):
                raise ValueError(
                    f"media at {pos} with features {list(features.shape)} does not fit a chunk "
                    f"of {n} tokens and hidden size {h.shape[-1]}"
                )
            parts += [h[:, at:pos], features[None].astype(h.dtype)]
            blocks[pos : pos + length] = index
            at = pos + length
        h = mx.concatenate([*parts, h[:, at:]], axis=1)
        masks = _media_masks(h, caches, text.kinds, text.window_size, blocks)
        for layer, kind, cache in zip(text.layers, text.kinds, caches, strict=True):
            h = layer(h, masks[kind], cache)
        return text.norm(h)


def _media_masks(
    h: mx.array, caches: list[Any], kinds: list[str], window: int, blocks: np.ndarray
) -> dict[str, Any]:
    """One mask per layer kind: the text model's (causal, and the window on sliding layers)
    OR'd with "same image, later position", the part of transformers' token_type_ids mask
    that causality hides. The keys a layer sees end with this chunk's, so key j is chunk
    position j - (keys - n); earlier keys are text to this chunk's images."""
    n = h.shape[1]
    masks: dict[str, Any] = {}
    for kind, cache in zip(kinds, caches, strict=True):
        if kind in masks:
            continue
        size = window if kind == SLIDING else None
        if n == 1:
            masks[kind] = create_attention_mask(h, cache, window_size=size)
            continue
        base = (
            cache.make_mask(n, window_size=size, return_array=True)
            if cache is not None
            else create_attention_mask(h, None, window_size=size, return_array=True)
        )
        keys = base.shape[-1]
        key_blocks = np.concatenate([np.full(keys - n, -1, np.int64), blocks])
        later = np.arange(keys)[None, :] - (keys - n) > np.arange(n)[:, None]
        same = (blocks[:, None] == key_blocks[None, :]) & (blocks[:, None] >= 0)
        masks[kind] = mx.logical_or(base, mx.array(same & later))
    return masks
