"""Qwen3.5's image-text adapter (`Qwen3_5ImageModel`, the `ImageModel` of
runner/models/base.py for every Qwen3.5 text family), the checkpoint's split between the
text module and the tower (`VisionWeights`), and the dense family's registration
(`Qwen3_5ForConditionalGeneration`, model_type qwen3_5).

The text model is runner/models/qwen3_5.py's, built from the nested `text_config` (the MoE
sibling, runner/models/qwen3_5_moe.py, puts its own text model under the same image side);
the pixels and expansions are processor.py's, the tower vision.py's, the 3-channel
positions positions.py's (this package). The adapter splices the tower's features over the
image pads' embeddings and passes a prompt's position layout to every forward of its
request. Checkpoint names: transformers 5 writes `model.language_model.*`, `model.visual.*`
and `lm_head.*`; `mtp.*` (the multi-token-prediction head) is not read.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.backend import Backend
from runner.media.images import decode_image, read_header
from runner.media.prepare import Expansion, ImagePlan, Item
from runner.models.config import flag, integer
from runner.models.decoder import DecoderModel, splice_features
from runner.models.qwen3_5 import ImageTextModel, Qwen3_5, image_text_config
from runner.models.qwen3_5_vision.positions import (
    LayoutRoPE,
    MropeLayout,
    MropeTable,
    mrope_channels,
    mrope_layout,
    mrope_section,
    rotary_table,
)
from runner.models.qwen3_5_vision.processor import (
    Grid,
    Qwen3_5ImagePreprocessor,
    image_expansion,
    image_tokens,
)
from runner.models.qwen3_5_vision.vision import VisionModel, vision_config
from runner.models.registry import register
from runner.sources.source import ModelLoadError, ModelSource

# transformers 5's Qwen3_5Config defaults.
MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "image_token_id": 248056,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
}

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
        v = vision_config(c)
        hidden = module.args.hidden_size
        if v["out_hidden_size"] != hidden:
            raise ModelLoadError(
                f"config.json: vision_config.out_hidden_size {v['out_hidden_size']} is not the "
                f"text model's hidden_size {hidden}"
            )
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if integer(c[key], key, minimum=0) >= module.args.vocab_size:
                raise ModelLoadError(f"config.json: {key} is outside the vocabulary")
        mrope_section(text_config)
        module.visual = VisionModel(v)
        shared = MropeTable()
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
        self.vision = vision_config(c)
        self.image_token_id = int(c["image_token_id"])
        self.vision_start_token_id = int(c["vision_start_token_id"])
        self.vision_end_token_id = int(c["vision_end_token_id"])
        self.merge = int(self.vision["spatial_merge_size"])
        self.preprocessor = Qwen3_5ImagePreprocessor(self.vision)
        head_dim = module.args.head_dim
        rotary = int(head_dim * module.args.partial_rotary_factor)
        theta = float(module.args.rope_theta)
        self.inv_freq = 1.0 / (theta ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary))
        self.channels = mrope_channels(rotary // 2, mrope_section(text_config))
        self.mrope_table: MropeTable = module.mrope_table

    def bind_source(self, source: ModelSource) -> None:
        """The preprocessor_config.json the model came with (if any)."""
        if source.preprocessor_config is not None:
            self.preprocessor = Qwen3_5ImagePreprocessor(self.vision, source.preprocessor_config)

    # The request side's interface (`ImageModel`).

    def preprocess(self, data: bytes) -> tuple[np.ndarray, Grid]:
        """Image bytes to the tower's patches and grid (any thread; deterministic). Raises
        ValueError("invalid image data: ...") for bytes that are not an image."""
        return self.preprocessor(decode_image(data))

    def plan_image(self, data: bytes) -> ImagePlan:
        """`ImageModel`: from the header alone, the tokens `prepare_image` will give (the
        grid `smart_resize` makes of the declared size), the pixels decoding makes and the
        bytes of the patches. Raises ValueError("invalid image data: ...") as `preprocess`."""
        header = read_header(data)
        grid, patch_bytes = self.preprocessor.grid(header.height, header.width)
        tokens = image_tokens(
            grid,
            self.merge,
            self.vision_start_token_id,
            self.image_token_id,
            self.vision_end_token_id,
        )
        return ImagePlan(tokens, header.pixels, patch_bytes)

    def prepare_image(self, data: bytes) -> Expansion:
        """vision_start, the image's pads (one causal item, its grid the item's opaque
        state), vision_end."""
        patches, grid = self.preprocess(data)
        return image_expansion(
            patches,
            grid,
            self.merge,
            self.vision_start_token_id,
            self.image_token_id,
            self.vision_end_token_id,
        )

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
            h = splice_features(h, media)
        if layout is None:
            return text(tokens, cache=caches, input_embeddings=h)
        start = 0
        if text.fa_idx is not None and caches is not None:
            start = int(caches[text.fa_idx].offset)
        self.mrope_table.table = rotary_table(
            layout.positions(start, tokens.shape[1]), self.channels, self.inv_freq
        )
        try:
            return text(tokens, cache=caches, input_embeddings=h)
        finally:
            self.mrope_table.table = None


@register("Qwen3_5ForConditionalGeneration", "qwen3_5")
class Qwen3_5Multimodal(Qwen3_5ImageModel):
    """Qwen3.5 (dense) with images."""

    KERNELS = Qwen3_5.KERNELS

    @classmethod
    def build_text_module(cls, text_config: dict[str, Any]) -> nn.Module:
        return Qwen3_5.build_module(text_config, _VisionTextModel)
