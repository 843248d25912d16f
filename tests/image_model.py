"""A tiny image model for the request side of images (runner/media), over the tiny Llama.

`TinyImageModel` implements `ImageModel` (runner/models/base.py) around a loaded tiny Llama:
an image's bytes become `[BOI] + k * [IMG] + [EOI]` with k = 2 + len(bytes) % 4 (so the
expansion's length depends on the image, as Qwen3.5's does; `plan_image` says so from the
length alone, and counts the pixels as the bytes), its pixels a deterministic [k, 8] array
of the bytes (bytes starting with `BROKEN` plan but do not decode), its features those
pixels through a fixed random projection. An atomic model (`causal=False`) lets an image's
tokens attend to each other, as Gemma3's do, so a forward that splits an image differs from
one that does not; a causal one is plain causal. The real families' vision towers are tested
against transformers elsewhere.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from runner.media.prepare import Expansion, ExpansionItem, ImagePlan, Item

BOI, IMG, EOI = 341, 342, 343  # ids past the tiny tokenizer's 340, inside the model's 384
BROKEN = b"BROKEN"  # bytes starting so have a header but no pixels: `prepare_image` refuses
PIXELS = 8


class TinyImageModel:
    def __init__(self, base: Any, causal: bool = False):
        self.base = base
        self.causal = causal
        self.architecture = base.architecture
        self.context_length = base.context_length
        self.vocab_size = base.vocab_size
        hidden = base.module.model.embed_tokens.weight.shape[1]
        self.projection = 0.5 * mx.random.normal((PIXELS, hidden), key=mx.random.key(7))
        mx.eval(self.projection)  # built on the MLX thread: evaluate it there
        self.encoded = 0  # items encoded, to see that shared images are computed once
        self.planned = 0  # images planned from their "headers"
        self.prepared = 0  # images "decoded"

    # --- ImageModel ----------------------------------------------------------------------
    def plan_image(self, data: bytes) -> ImagePlan:
        if not data:
            raise ValueError("invalid image data: no bytes")
        k = 2 + len(data) % 4
        self.planned += 1
        return ImagePlan([BOI, *[IMG] * k, EOI], len(data), k * PIXELS * 4)

    def prepare_image(self, data: bytes) -> Expansion:
        if not data:
            raise ValueError("invalid image data: no bytes")
        self.prepared += 1
        if data.startswith(BROKEN):
            raise ValueError("invalid image data: broken pixels")
        k = 2 + len(data) % 4
        values = np.frombuffer(data, dtype=np.uint8).astype(np.float32) / 255.0
        pixels = np.resize(values, (k, PIXELS))
        return Expansion([BOI, *[IMG] * k, EOI], [ExpansionItem(1, 1 + k, pixels, self.causal)])

    def encode_item(self, item: Item) -> mx.array:
        self.encoded += 1
        return mx.array(item.pixels) @ self.projection

    def hidden(self, tokens: mx.array, caches: list[Any], media: Any = None) -> mx.array:
        if not media:
            return self.base.hidden(tokens, caches)
        inner = self.base.module.model
        h = inner.embed_tokens(tokens)
        n = tokens.shape[1]
        for pos, rows in media:
            h[:, pos : pos + rows.shape[0]] = rows.astype(h.dtype)
        past = caches[0].offset
        allowed = np.tril(np.ones((n, past + n), dtype=bool), k=past)
        if not self.causal:
            for pos, rows in media:
                end = pos + rows.shape[0]
                allowed[pos:end, past + pos : past + end] = True
        mask = mx.array(allowed)
        for layer, cache in zip(inner.layers, caches, strict=True):
            h = layer(h, mask, cache)
        return inner.norm(h)

    # --- the rest of the model contract, the base model's ----------------------------------
    def make_caches(self) -> list[Any]:
        return self.base.make_caches()

    def unembed(self, hidden: mx.array) -> mx.array:
        return self.base.unembed(hidden)

    def unembed_candidates(self, hidden: mx.array, ids: mx.array) -> mx.array:
        return self.base.unembed_candidates(hidden, ids)
