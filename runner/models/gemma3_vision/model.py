"""Gemma3's image-text adapter and its registration (`Gemma3ForConditionalGeneration`,
model_type gemma3): the text family with images.

The text model is runner/models/gemma3.py's, built from the nested `text_config`; the pixels
and expansions are processor.py's, the SigLIP tower and projector vision.py's (this
package). transformers 5 on the same weights is the reference:
- the soft tokens' embeddings are the projected image features, not scaled by sqrt(hidden)
  as token embeddings are;
- the soft tokens of one image attend to each other both ways (transformers' token_type_ids
  mask: full layers causal OR same image, sliding layers that AND the window), so an image is
  evaluated whole, in one forward: its expansion is atomic (docs/DESIGN.md §3.5);
  everything else is the text model's causal attention;
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

from runner.backend import Backend
from runner.media.images import decode_image, read_header
from runner.media.prepare import Expansion, ExpansionItem, ImagePlan, Item
from runner.models import gemma3
from runner.models.config import SLIDING, flag, integer, json_object
from runner.models.decoder import splice_features
from runner.models.gemma3 import GEMMA3_DEFAULTS, Gemma3
from runner.models.gemma3_vision.processor import (
    NEWLINES,
    Gemma3ImagePreprocessor,
    image_expansion,
)
from runner.models.gemma3_vision.vision import MultimodalProjector, VisionTower, vision_config
from runner.models.registry import register
from runner.sources.source import ModelLoadError, ModelSource
from runner.text.tokenizer import Tokenizer

# transformers 5's Gemma3Config defaults (the released checkpoints write most of them;
# sparse configs rely on these).
MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "mm_tokens_per_image": 256,
    "boi_token_index": 255_999,
    "eoi_token_index": 256_000,
    "image_token_index": 262_144,
    "tie_word_embeddings": True,
}


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
        v = vision_config(c)
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
        self.vision = vision_config(c)
        self.preprocessor = Gemma3ImagePreprocessor(self.vision)

    def bind_source(self, source: ModelSource) -> None:
        """Read what config.json does not say: the tokenizer's "\\n\\n" ids, and the
        preprocessor_config.json the model came with (if any)."""
        tokenizer = Tokenizer(source.tokenizer_json, tokenizer_config=source.tokenizer_config)
        self.newline_ids = tokenizer.encode(NEWLINES)
        if source.preprocessor_config is not None:
            self.preprocessor = Gemma3ImagePreprocessor(self.vision, source.preprocessor_config)

    def postprocess(self, logits: mx.array) -> mx.array:
        return logits  # the conditional-generation head has no final soft-capping

    # The request side's interface.

    def expansion(self) -> tuple[list[int], int, int]:
        """The token ids an image tag becomes, and the [start, end) of its soft tokens
        (processor.py's `image_expansion` with this model's ids)."""
        if self.newline_ids is None:
            raise RuntimeError("expansion() needs the tokenizer: the model was not bound to it")
        return image_expansion(
            self.newline_ids,
            self.boi_token_id,
            self.image_token_id,
            self.eoi_token_id,
            self.image_tokens,
        )

    def preprocess(self, data: bytes) -> np.ndarray:
        """Image bytes to the tower's float32 [3, S, S] pixels (any thread; deterministic).
        Raises ValueError("invalid image data: ...") for bytes that are not an image."""
        return self.preprocessor(decode_image(data))

    def plan_image(self, data: bytes) -> ImagePlan:
        """`ImageModel`: from the header alone (checked as `preprocess` checks it), the
        expansion's tokens (the same for every image), the pixels decoding makes and the
        bytes of the [3, S, S] float32 pixels."""
        header = read_header(data)
        size = self.preprocessor.size
        return ImagePlan(self.expansion()[0], header.pixels, 3 * size * size * 4)

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
        n = tokens.shape[1]
        text = self.module.model
        ids = tokens
        if self.image_token_id >= self.vocab_size:  # as transformers: an id the table lacks
            ids = mx.where(tokens == self.image_token_id, 0, tokens)
        h = text.embed_tokens(ids)
        h = h * mx.array(math.sqrt(text.args.hidden_size), mx.float32).astype(h.dtype)
        h = splice_features(h, media)
        blocks = np.full(n, -1, np.int64)  # which image each position is part of
        for index, (pos, features) in enumerate(sorted(media, key=lambda m: m[0])):
            blocks[pos : pos + features.shape[0]] = index
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
