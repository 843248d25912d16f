"""The model contract: what the runner needs from a loaded model, and what a model may add.

A model wraps one mlx-lm model instance. The runner never calls the mlx-lm model's
`__call__` (that computes vocabulary-wide logits at every position). It needs:

`Model` (required):
- facts: `architecture`, `context_length`, `vocab_size` (rows of the output projection),
  plain Python values fixed at load, safe to read from any thread;
- `make_caches()`: fresh live caches, one per layer (mlx-lm cache objects whose kinds the
  prefix cache knows, runner/cache/kinds.py);
- `hidden(tokens, caches)`: the final hidden states (after the last norm, before the output
  head) for a [B, L] block of token ids, writing into `caches` (B > 1 only with batched
  caches, runner/cache/batch.py). Chunked calls with the same caches equal one call over the
  whole prompt;
- `unembed(hidden)`: full-vocabulary logits with the model's own post-processing
  (final-logit soft-capping, logit scale, ...), in the model's dtype.

Optional capabilities, named as the Go runner names them and checked with `isinstance` where
scoring is dispatched (runner/server/endpoints.py, runner/score/scorer.py):
- `CandidateUnembedder`: `unembed_candidates(hidden, ids)` computes only the rows `ids` of
  the output projection, in float32, then the same post-processing as `unembed`: hidden is
  [N, H], ids [K] int32, the result [N, K] float32, equal to `unembed(hidden)[:, ids]` up to
  float32 rounding. Without it, scoring unembeds fully and gathers the candidates.
- `CachedScorer`: the model answers whole /v1/score requests itself (models whose prompts need
  their own preparation, such as images): `score(request, tokenizer, hidden_rows)` validates
  (raising BadRequest) and returns a ScoreResponse, asking the runner for hidden rows through
  the scoring prefix cache with `hidden_rows(tokens)` -> (the last token's hidden row [1, H],
  tokens restored from the cache); that call checks for cancellation between chunks.

- `HostLogits`: `host_logits(hidden)` gives `unembed(hidden)`'s logits as numpy's [rows,
  vocab] float32 where the model computed them on the host (the native step's head), the
  same values; None otherwise. A greedy decode step takes its argmax there
  (runner/generate/pipeline.py).
- `DecodeSteps`: `decode_steps()`, a context manager inside which forwards of one token a
  row and their `unembed` / `host_logits` are decode steps (each row a sequence's next
  token; runner/generate/pipeline.py enters it around each one). The model may compute them
  another way than a forward of the same rows, within float32 grade of the same values: the
  native step's GGML blocks and 5-bit codes multiply A's values as integer limbs
  (docs/DESIGN.md §4.4), so a decode step's hidden row is not a forward's bit for bit.
  Scoring never enters it.

- `KVRestorer` (declared by its user, runner/cache/prefix_cache.py): `restore_kv(cache,
  segments, target, kept)` makes one plain `KVCache` hold [0, target) from the trie's KV
  segments (`Snap`s of (keys, values), in order from 0) without new buffers, writing them
  into buffers the model already owns for that cache; positions [0, kept) already hold the
  prefix (the live state shares them) and need not be written. False when it cannot
  (nothing changed: the prefix cache installs them as usual). Equal to `KVKind.install` in
  what the cache then holds.
- `ImageModel`: the model takes images in prompts. `plan_image(data)` (off the MLX thread,
  cheap: the header only) says what the image's tag will become before anything is decoded
  (`ImagePlan`: the expansion's tokens, the pixels decoding makes, the bytes its items
  keep), raising ValueError for a header it refuses; `prepare_image(data)` (off the MLX
  thread, on the image pool, deterministic) decodes and preprocesses one image's bytes into
  the `Expansion` its `[img-N]` tag becomes: exactly the planned tokens, and items (token
  ranges with pixels, causal or atomic), raising ValueError for bytes it cannot decode;
  `encode_item(item)` computes an item's features [end - start, H]; `hidden(tokens, caches,
  media)` takes, besides the token ids, the features for this block: (position in the block,
  rows) pairs that replace those positions' embeddings. An atomic item is always whole
  inside one block (runner/media/request.py). A model whose token positions are not their
  indices once a prompt has images (Qwen3.5's 3-channel rotary positions) is also a
  `PositionLayouts` (declared by its user, runner/media/prepare.py):
  `position_layout(tokens, items)` (off the MLX thread, deterministic; called only for
  prompts with items), and its `hidden` takes `layout=`: the runner passes the prompt's
  layout with every forward of that request (prefill chunks, batched rows over a shared
  prefix, decode steps), and the model reads its block's absolute indices from its caches'
  offset. Models without `position_layout` are never given one.

Load-time capabilities, which `build_model` (runner/models/build.py) calls once, before the
model serves:
- `SourceReader`: `bind_source(source)` reads more of the model's files than the config and
  the weights (an image model's preprocessor_config.json);
- `GenerationConfigReader`: `use_generation_config(generation_config)` with
  generation_config.json's contents or None (Gemma 4's `suppress_tokens`);
- `MLXPathSwitch`: `mlx_only()`, a context manager inside which every forward takes MLX's
  path, for a model whose forwards usually take another (the native decoder step, `native`:
  None where this model has none, so MLX's path is the only one): the load-time checks run
  both paths.

Every method except `plan_image` and `prepare_image` runs on the MLX thread and builds lazy
graphs; callers evaluate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from runner.media.prepare import Expansion, ImagePlan, Item
    from runner.protocol.wire import ScoreRequest, ScoreResponse
    from runner.sources.source import ModelSource
    from runner.text.tokenizer import Tokenizer


@runtime_checkable
class Model(Protocol):
    architecture: str
    context_length: int
    vocab_size: int

    def make_caches(self) -> list[Any]: ...

    def hidden(self, tokens: mx.array, caches: list[Any]) -> mx.array: ...

    def unembed(self, hidden: mx.array) -> mx.array: ...


@runtime_checkable
class CandidateUnembedder(Protocol):
    def unembed_candidates(self, hidden: mx.array, ids: mx.array) -> mx.array: ...


HiddenRows = Callable[[list[int]], tuple[mx.array, int]]


@runtime_checkable
class HostLogits(Protocol):
    def host_logits(self, hidden: mx.array) -> np.ndarray | None: ...


@runtime_checkable
class DecodeSteps(Protocol):
    def decode_steps(self) -> contextlib.AbstractContextManager[None]: ...


@runtime_checkable
class CachedScorer(Protocol):
    def score(
        self, request: ScoreRequest, tokenizer: Tokenizer, hidden_rows: HiddenRows
    ) -> ScoreResponse: ...


@runtime_checkable
class ImageModel(Protocol):
    def plan_image(self, data: bytes) -> ImagePlan: ...

    def prepare_image(self, data: bytes) -> Expansion: ...

    def encode_item(self, item: Item) -> mx.array: ...

    def hidden(
        self, tokens: mx.array, caches: list[Any], media: list[tuple[int, mx.array]] | None = None
    ) -> mx.array: ...


@runtime_checkable
class SourceReader(Protocol):
    def bind_source(self, source: ModelSource) -> None: ...


@runtime_checkable
class GenerationConfigReader(Protocol):
    def use_generation_config(self, generation_config: dict[str, Any] | None) -> None: ...


@runtime_checkable
class MLXPathSwitch(Protocol):
    @property
    def native(self) -> Any: ...

    def mlx_only(self) -> contextlib.AbstractContextManager[None]: ...
