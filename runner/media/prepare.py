"""A prompt with `[img-N]` tags, prepared for an image model (docs/PROTOCOL.md §7).

Runs off the MLX thread (it tokenizes and decodes images) and is deterministic: the same
prompt and bytes always give the same tokens, items and pixels, because a cache restore
splices recomputed state with stored state.

- The prompt is split at the tags (`\\[img-([0-9]+)\\]`, ASCII digits only, as Go's `\\d`):
  each text part is tokenized (BOS only before part 0, when the tokenizer adds one; empty
  parts give no tokens; equal parts are tokenized once), each tag is replaced by the
  model's expansion of the media item whose `id` is N (not its index). An unknown id is
  `invalid image index: N`; an item never referenced is ignored; an id referenced twice
  gives two items with the same fold.
- Two steps, so that nothing is decoded for a prompt that cannot fit: `plan_prompt` reads
  each image's header only (`model.plan_image`: its expansion's tokens, the pixels its
  decoding makes, the bytes its items keep) and counts the prompt's tokens without building
  them; the caller checks that count (a score row against `max_tokens`, a completion against
  the context), then `PlannedPrompt.realize()` decodes each image (`model.prepare_image`,
  on the image pool, runner/media/pool.py) and builds the tokens and items. An image's
  decoded expansion must have exactly its planned tokens.
- `RequestImages` holds one request's images across its rows: each distinct image (by its
  bytes) is planned and decoded once; before one is decoded the request's cancellation is
  checked and its budget charged from the header (`MAX_REQUEST_PIXELS` decoded pixels,
  `MAX_REQUEST_ITEM_BYTES` bytes of item pixels kept for the forward), a 400 naming the
  budget when it would go over.
- Each expansion carries one or more items (`Item`): a token range, the pixels, and whether
  it is causal. An atomic (non-causal) item's tokens attend to each other, so its first
  evaluation must cover the whole range in one forward (runner/media/request.py).
- The prefix trie keys every position of an item by `fold(bytes, dims)` (Go's `foldValue`:
  FNV-1a 64 over the bytes, then each dim as a little-endian uint64, folded to 32 bits with
  bit 31 set), so text keys (ids < 2**31) never equal image keys, the same image restores
  past its expansion, and other bytes or geometry diverge at its first position.
- A model whose positions are not the token indices once an image is in the prompt
  (Qwen3.5's 3-channel rotary positions) makes a **position layout** for the prompt
  (`model.position_layout(tokens, items)`, only when there are items): a deterministic
  function of the tokens and items, so the same prefix always has the same layout and a
  restored prefix needs no state beside its caches. Every forward of the request passes it
  to the model (runner/media/request.py, runner/cache/session.py).
"""

from __future__ import annotations

import ctypes
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from runner.media.pool import decode_on_pool
from runner.protocol.errors import BadRequest
from runner.protocol.wire import MediaItem
from runner.text.tokenizer import Tokenizer

TAG = re.compile(r"\[img-([0-9]+)\]")  # Go's regexp: \d is ASCII only
# A request's budget for its images, charged from each distinct image's header before it is
# decoded (docs/PROTOCOL.md §7): three images at the per-image limit
# (runner/media/images.py MAX_IMAGE_PIXELS), ~22 twelve-megapixel photos.
MAX_REQUEST_PIXELS = 1 << 28
# ...and the item pixels it keeps until its forward (float32: Gemma3's 896 x 896 images take
# 9.6 MB each, Qwen3.5's up to 24 bytes a pixel of its resized image).
MAX_REQUEST_ITEM_BYTES = 1 << 30
FOLD_BIT = 1 << 31
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fold_value(data: bytes, dims: Sequence[int]) -> int:
    """Go's `foldValue`: a 32-bit key with bit 31 set for these bytes and this geometry."""
    h = fnv1a64(data, _FNV_OFFSET)
    h = _fnv1a64_python(b"".join(struct.pack("<Q", d & _MASK64) for d in dims), h)
    return ((h >> 32) ^ (h & 0xFFFFFFFF)) | FOLD_BIT


def _fnv1a64_python(data: bytes, h: int) -> int:
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h


def _fnv1a64_native() -> Any:
    """The dispatch library's FNV-1a (runner/native/hash.c), when it is preloaded:
    ~1 ms a megabyte with the GIL released, against ~120 ms holding it in Python."""
    try:
        function = ctypes.CDLL(None).runner_fnv1a64
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    function.restype = ctypes.c_uint64
    return function


_NATIVE_FNV = _fnv1a64_native()


def fnv1a64(data: bytes, h: int) -> int:
    """FNV-1a 64 over `data`, from `h`."""
    if _NATIVE_FNV is not None and len(data) > 64:
        return int(_NATIVE_FNV(data, len(data), h))
    return _fnv1a64_python(data, h)


@dataclass(frozen=True)
class ExpansionItem:
    """One item of an image's expansion: tokens [start, end) of the expansion."""

    start: int
    end: int
    pixels: np.ndarray  # what the model's `encode_image` takes
    causal: bool
    opaque: Any = None  # model-private (e.g. a position layout)


@dataclass(frozen=True)
class Expansion:
    """What one `[img-N]` tag becomes: tokens, and the items among them."""

    tokens: list[int]
    items: list[ExpansionItem]


@dataclass(frozen=True)
class ImagePlan:
    """What an image's header says its tag becomes, before anything is decoded
    (`model.plan_image`): the expansion's tokens (decoding must give exactly these), the
    pixels the decoder will make, and the bytes of the items' pixels that the request then
    keeps until its forward."""

    tokens: list[int]
    pixels: int
    item_bytes: int


@dataclass(frozen=True)
class Item:
    """An expansion item placed in a prompt: tokens [start, end), keyed by `fold`."""

    start: int
    end: int
    pixels: np.ndarray
    causal: bool
    fold: int
    source: int  # the media segment (tag) it came from, in prompt order
    opaque: Any = None


@runtime_checkable
class PositionLayouts(Protocol):
    """An image model whose token positions stop being their indices once a prompt has
    images (runner/models/base.py): the layout of a prompt with items, deterministic, made
    here off the MLX thread and passed with every forward of the request."""

    def position_layout(self, tokens: list[int], items: list[Item]) -> Any: ...


@dataclass(frozen=True)
class PreparedPrompt:
    """The model's input tokens and the items spliced into them."""

    tokens: list[int]
    items: list[Item] = field(default_factory=list)
    tail_start: int = 0  # where the tokens of the text after the last tag begin
    layout: Any = None  # the model's position layout for these tokens, if it makes one

    @property
    def keys(self) -> list[int]:
        """The prefix trie's key for each position: the token, or its item's fold."""
        if not self.items:
            return self.tokens
        keys = list(self.tokens)
        for item in self.items:
            keys[item.start : item.end] = [item.fold] * (item.end - item.start)
        return keys


def split_prompt(prompt: str) -> list[str | int]:
    """Text parts and tag ids in order, text first and last (parts may be empty): the text
    parts at even indices, the ids at odd ones."""
    parts: list[str | int] = []
    last = 0
    for match in TAG.finditer(prompt):
        parts += [prompt[last : match.start()], int(match.group(1))]
        last = match.end()
    parts.append(prompt[last:])
    return parts


Placed = tuple[Expansion, list[int]]  # an image's expansion and the fold of each item


def _never_cancelled() -> None:
    pass


class RequestImages:
    """One request's images, across its rows: each distinct image (by its bytes) planned from
    its header once (`plan`) and decoded once (`placed`), on the image pool, after the
    request's budget is charged and its cancellation checked (`check` raises `Cancelled`)."""

    def __init__(
        self,
        media: Sequence[MediaItem],
        model: Any,
        check: Callable[[], None] | None = None,
        max_pixels: int | None = None,
        max_item_bytes: int | None = None,
    ):
        self.by_id = {item.id: item for item in media}  # a later item with the same id wins
        self.model = model
        self.check = check or _never_cancelled
        self.max_pixels = MAX_REQUEST_PIXELS if max_pixels is None else max_pixels
        self.max_item_bytes = MAX_REQUEST_ITEM_BYTES if max_item_bytes is None else max_item_bytes
        self.pixels = 0  # charged so far
        self.item_bytes = 0
        self.decoded = 0  # images decoded (tests)
        self._data: dict[int, bytes] = {}
        self._plans: dict[bytes, ImagePlan] = {}
        self._placed: dict[bytes, Placed] = {}

    def data(self, image_id: int) -> bytes:
        data = self._data.get(image_id)
        if data is None:
            source = self.by_id.get(image_id)
            if source is None:
                raise BadRequest(f"invalid image index: {image_id}")
            data = self._data[image_id] = source.raw
        return data

    def plan(self, image_id: int) -> ImagePlan:
        """The image's plan, from its header; BadRequest for an unknown id or a header the
        model refuses."""
        data = self.data(image_id)
        plan = self._plans.get(data)
        if plan is None:
            try:
                plan = self.model.plan_image(data)
            except ValueError as e:
                raise BadRequest(str(e) or "invalid image data") from None
            self._plans[data] = plan
        return plan

    def placed(self, image_id: int) -> Placed:
        """The image's expansion and item folds, decoding it if this request has not yet."""
        data = self.data(image_id)
        placed = self._placed.get(data)
        if placed is not None:
            return placed
        plan = self.plan(image_id)
        self._charge(image_id, plan)
        self.check()
        model = self.model
        try:
            expansion = decode_on_pool(lambda: model.prepare_image(data), self.check, plan.pixels)
        except ValueError as e:
            raise BadRequest(str(e) or "invalid image data") from None
        self.decoded += 1
        if expansion.tokens != plan.tokens:
            raise RuntimeError(
                f"image {image_id} decoded to {len(expansion.tokens)} tokens where its header "
                f"said {len(plan.tokens)}"
            )
        folds = [fold_value(data, tuple(int(d) for d in e.pixels.shape)) for e in expansion.items]
        placed = self._placed[data] = (expansion, folds)
        return placed

    def _charge(self, image_id: int, plan: ImagePlan) -> None:
        pixels, item_bytes = self.pixels + plan.pixels, self.item_bytes + plan.item_bytes
        if pixels > self.max_pixels:
            raise BadRequest(
                f"images exceed the request's budget of {self.max_pixels} decoded pixels "
                f"(image {image_id} brings the request to {pixels})"
            )
        if item_bytes > self.max_item_bytes:
            raise BadRequest(
                f"images exceed the request's budget of {self.max_item_bytes} bytes of "
                f"preprocessed pixels (image {image_id} brings the request to {item_bytes})"
            )
        self.pixels, self.item_bytes = pixels, item_bytes


@dataclass
class PlannedPrompt:
    """A prompt whose tags are planned, nothing decoded: `count` tokens (BOS included), `tail`
    the tokens of its text after the last tag; `realize()` decodes its images and builds it
    (only for a prompt whose every text part was within the planning's limit)."""

    parts: list[str | int]
    encoded: dict[str, list[int] | int]  # each distinct text part's ids (a count past the limit)
    bos: list[int]
    images: RequestImages
    count: int

    @property
    def tail(self) -> list[int]:
        ids = self.encoded[str(self.parts[-1])]
        ids = [] if isinstance(ids, int) else ids
        return [*self.bos, *ids] if len(self.parts) == 1 else ids

    def realize(self) -> PreparedPrompt:
        tokens: list[int] = []
        items: list[Item] = []
        tail_start = 0
        for index, part in enumerate(self.parts):
            if isinstance(part, str):
                tail_start = len(tokens)
                if index == 0:
                    tokens += self.bos
                ids = self.encoded[part]
                if isinstance(ids, int):
                    raise RuntimeError("a prompt past its length limit is never realized")
                tokens += ids
                continue
            expansion, folds = self.images.placed(part)
            base = len(tokens)
            for e, fold in zip(expansion.items, folds, strict=True):
                items.append(
                    Item(
                        base + e.start, base + e.end, e.pixels, e.causal, fold, index // 2, e.opaque
                    )
                )
            tokens += expansion.tokens
        check_items(items, len(tokens), len(self.parts) // 2)
        layout = None
        model = self.images.model
        if items and isinstance(model, PositionLayouts):
            layout = model.position_layout(tokens, items)
        return PreparedPrompt(tokens, items, tail_start, layout)


def plan_prompt(
    prompt: str,
    images: RequestImages,
    tokenizer: Tokenizer,
    add_bos: bool,
    limit: int | None = None,
) -> PlannedPrompt:
    """`prompt` split at its tags, its text tokenized and each image planned from its header
    (BadRequest for an unknown id or a refused header, in prompt order); nothing is decoded
    and the tokens are only counted: a million tags cost a dictionary lookup each, and a text
    part of more than `limit` tokens is only counted."""
    parts = split_prompt(prompt)
    texts = [p for p in parts[0::2] if isinstance(p, str)]
    distinct = list(dict.fromkeys(texts))
    encoded = dict(zip(distinct, tokenizer.encode_within(distinct, limit), strict=True))
    bos = tokenizer.bos(add_bos)
    count = len(bos)
    for text in texts:
        ids = encoded[text]
        count += ids if isinstance(ids, int) else len(ids)
    lengths: dict[int, int] = {}
    for image_id in parts[1::2]:
        assert isinstance(image_id, int)
        length = lengths.get(image_id)
        if length is None:
            length = lengths[image_id] = len(images.plan(image_id).tokens)
        count += length
    return PlannedPrompt(parts, encoded, bos, images, count)


def prepare_prompt(
    prompt: str,
    media: Sequence[MediaItem],
    tokenizer: Tokenizer,
    model: Any,
    add_bos: bool,
    images: RequestImages | None = None,
) -> PreparedPrompt:
    """`prompt` with every tag expanded by `model` (an `ImageModel`): `plan_prompt`, then
    `realize`, with no check of the count between them.

    `images` holds the request's images across its rows (each decoded and hashed once).
    Raises BadRequest for an unknown id, undecodable image bytes, a request over its image
    budget, or an expansion that breaks the item rules.
    """
    images = RequestImages(media, model) if images is None else images
    return plan_prompt(prompt, images, tokenizer, add_bos).realize()


def check_items(items: list[Item], length: int, segments: int) -> None:
    """Go's `bindItems` rules: items in order, non-overlapping, non-empty, in bounds, and
    every media segment produced at least one."""
    previous_end = 0
    for item in items:
        if not previous_end <= item.start < item.end <= length:
            raise BadRequest(f"media expansion has invalid range [{item.start}, {item.end})")
        previous_end = item.end
    if len({item.source for item in items}) < segments:
        raise BadRequest("media expansion produced no tokens")
