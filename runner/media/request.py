"""A prepared prompt's images during its forward, on the MLX thread (Go's `requestMedia`).

The prefix cache keys a media prompt by `PreparedPrompt.keys` (folds over the expansions);
this object turns a range of those positions back into the model's input: the real token
ids, and for every item the range overlaps, its features (the rows of that range).

- `extend_chunk(pos, stop, end)`: a prefill chunk [pos, stop) never ends strictly inside an
  atomic item: if the item starts after `pos` the chunk is cut at its start, else it is
  extended to the item's end (never past `end`). Causal items may split.
- `floor(offset)`: the deepest restorable offset at or below `offset`: not strictly inside
  an atomic item (its tokens' states depend on the whole image).
- Features are encoded on the first chunk that overlaps an item (`model.encode_item`),
  kept while later chunks need them, and released once a chunk has gone past the item's
  end; `close()` releases the rest.
- `layout`: the prompt's position layout (runner/media/prepare.py) or None; the live state
  passes it with every forward of the request, decode steps included.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from runner.media.prepare import Item, PreparedPrompt

Media = list[tuple[int, mx.array]]  # (position in the chunk, feature rows from there)


class RequestMedia:
    def __init__(self, model: Any, prompt: PreparedPrompt):
        self.model = model
        self.prompt = prompt
        self.items = prompt.items
        self.keys = prompt.keys
        self.layout = prompt.layout  # every forward of the request passes it to the model
        self._features: dict[int, mx.array] = {}
        self.encoded = 0  # how many items were encoded (tests: each once)

    def floor(self, offset: int) -> int:
        for item in self.items:
            if not item.causal and item.start < offset < item.end:
                return item.start
        return offset

    def extend_chunk(self, pos: int, stop: int, end: int) -> int:
        for item in self.items:
            if not item.causal and item.start < stop < item.end:
                if item.start > pos:
                    return item.start
                return min(item.end, end)
        return stop

    def inputs(self, start: int, stop: int) -> tuple[mx.array, Media]:
        """Token ids [1, n] and media for positions [start, stop)."""
        tokens = mx.array(self.prompt.tokens[start:stop], dtype=mx.int32)[None]
        media: Media = []
        for index, item in enumerate(self.items):
            if item.end <= start or item.start >= stop:
                continue
            features = self._encoded(index, item)
            first, last = max(item.start, start), min(item.end, stop)
            rows = features[first - item.start : last - item.start]
            media.append((first - start, rows))
        return tokens, media

    def release(self, pos: int) -> None:
        """Drop the features of items that end at or before `pos`."""
        for index, item in enumerate(self.items):
            if item.end <= pos:
                self._features.pop(index, None)

    def close(self) -> None:
        self._features.clear()

    def _encoded(self, index: int, item: Item) -> mx.array:
        if index not in self._features:
            features = self.model.encode_item(item)
            if features.shape[0] != item.end - item.start:
                raise ValueError(
                    f"image features have {features.shape[0]} rows for an expansion of "
                    f"{item.end - item.start} tokens"
                )
            self._features[index] = features
            self.encoded += 1
        return self._features[index]
