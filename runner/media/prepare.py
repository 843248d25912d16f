"""A prompt with `[img-N]` tags, prepared for an image model (docs/PROTOCOL.md §7).

Runs off the MLX thread (it tokenizes and decodes images) and is deterministic: the same
prompt and bytes always give the same tokens, items and pixels, because a cache restore
splices recomputed state with stored state.

- The prompt is split at the tags (`\\[img-(\\d+)\\]`): each text part is tokenized (BOS only
  before part 0, when the tokenizer adds one; empty parts give no tokens), each tag is
  replaced by the model's expansion of the media item whose `id` is N (not its index).
  An unknown id is `invalid image index: N`; an item never referenced is ignored; an id
  referenced twice gives two items with the same fold.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from runner.protocol.errors import BadRequest
from runner.protocol.wire import MediaItem
from runner.text.tokenizer import Tokenizer

TAG = re.compile(r"\[img-(\d+)\]")
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
    """Text parts and tag ids in order, text first and last (parts may be empty)."""
    parts: list[str | int] = []
    last = 0
    for match in TAG.finditer(prompt):
        parts += [prompt[last : match.start()], int(match.group(1))]
        last = match.end()
    parts.append(prompt[last:])
    return parts


def prepare_prompt(
    prompt: str,
    media: Sequence[MediaItem],
    tokenizer: Tokenizer,
    model: Any,
    add_bos: bool,
    expansions: dict[int, Placed] | None = None,
) -> PreparedPrompt:
    """`prompt` with every tag expanded by `model.prepare_image` (an `ImageModel`).

    `expansions` caches each media id's expansion and item folds across the tags and rows of
    one request (the same bytes are decoded and hashed once). Raises BadRequest for an unknown
    id, undecodable image bytes, or an expansion that breaks the item rules.
    """
    by_id = {item.id: item for item in media}  # a later item with the same id wins, as Go's map
    expansions = {} if expansions is None else expansions
    parts = split_prompt(prompt)
    texts = [p for p in parts if isinstance(p, str)]
    encoded = iter(tokenizer.encode_batch(texts))
    tokens: list[int] = []
    items: list[Item] = []
    tail_start = 0
    for index, part in enumerate(parts):
        if isinstance(part, str):
            tail_start = len(tokens)
            ids = next(encoded)
            if index == 0:
                ids = [*tokenizer.bos(add_bos), *ids]
            tokens += ids
            continue
        source = by_id.get(part)
        if source is None:
            raise BadRequest(f"invalid image index: {part}")
        if part not in expansions:
            expansions[part] = place(model, source.raw)
        expansion, folds = expansions[part]
        base = len(tokens)
        for e, fold in zip(expansion.items, folds, strict=True):
            items.append(
                Item(base + e.start, base + e.end, e.pixels, e.causal, fold, index // 2, e.opaque)
            )
        tokens += expansion.tokens
    check_items(items, len(tokens), sum(1 for p in parts if isinstance(p, int)))
    layout = None
    if items and isinstance(model, PositionLayouts):
        layout = model.position_layout(tokens, items)
    return PreparedPrompt(tokens, items, tail_start, layout)


Placed = tuple[Expansion, list[int]]  # an image's expansion and the fold of each item


def place(model: Any, data: bytes) -> Placed:
    """The model's expansion of `data` and each item's fold (bytes and the item's dims)."""
    try:
        expansion = model.prepare_image(data)
    except ValueError as e:
        raise BadRequest(str(e) or "invalid image data") from None
    folds = [fold_value(data, tuple(int(d) for d in e.pixels.shape)) for e in expansion.items]
    return expansion, folds


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
