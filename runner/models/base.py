"""What the runner needs from a model, on top of mlx-lm's implementation of it.

A `RunnerModel` wraps one mlx-lm model instance. The runner never calls the mlx-lm model's
`__call__` (that computes vocabulary-wide logits at every position); it calls:

- `hidden(tokens, caches)`: the final hidden states (after the last norm, before the output
  head) for a [B, L] block of token ids, writing into `caches` (one per layer, from
  `make_caches`; B > 1 only with caches batched by `Kind.broadcast`). Chunked calls with the
  same caches equal one call over the whole prompt.
- `unembed(hidden)`: full-vocabulary logits with the model's own post-processing
  (final-logit soft-capping, logit scale, ...), in the model's dtype.
- `unembed_candidates(hidden, ids)`: only the rows `ids` of the output projection, computed
  in float32 (dense rows cast, quantized rows dequantized), then the same element-wise
  post-processing as `unembed`. hidden is [N, H], ids is [K] int32; the result is [N, K]
  float32 and equals `unembed(hidden)[:, ids]` up to float32 rounding.

All methods run on the MLX worker thread and build lazy graphs; callers evaluate.

A model may also take over whole scoring requests (`ScoresRequests`, the seed's
`CachedScorer`): for models whose prompts need their own preparation (media, say), it
validates and scores the request itself, asking the runner for hidden rows through the
scoring prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn


class RunnerModel:
    """Base adapter over an mlx-lm text model; architecture files override what differs."""

    def __init__(self, module: nn.Module, config: dict[str, Any], architecture: str):
        self.module = module
        self.config = config
        self.architecture = architecture

    # --- facts -----------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        """Rows of the output projection."""
        raise NotImplementedError

    # --- compute ---------------------------------------------------------------------
    def make_caches(self) -> list[Any]:
        raise NotImplementedError

    def hidden(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        raise NotImplementedError

    def unembed(self, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    def unembed_candidates(self, hidden: mx.array, ids: mx.array) -> mx.array:
        raise NotImplementedError


HiddenRow = Callable[[list[int]], tuple[mx.array, int]]


@runtime_checkable
class ScoresRequests(Protocol):
    """A model that answers /v1/score itself.

    `score_request(request, tokenizer, hidden_row)` gets the decoded ScoreRequest and
    returns a ScoreResponse (raising BadRequest for invalid input). `hidden_row(tokens)`
    gives the final hidden row of the last token ([1, H]) and how many tokens were restored
    from the scoring prefix cache; it checks for cancellation between chunks.
    """

    def score_request(self, request: Any, tokenizer: Any, hidden_row: HiddenRow) -> Any: ...
