"""What the runner needs from a model, on top of mlx-lm's implementation of it.

A `RunnerModel` wraps one mlx-lm model instance. The runner never calls the mlx-lm model's
`__call__` (that computes vocabulary-wide logits at every position); it calls:

- `hidden(tokens, caches)`: the final hidden states (after the last norm, before the output
  head) for a [1, L] block of token ids, writing into `caches` (one per layer, from
  `make_caches`). Chunked calls with the same caches equal one call over the whole prompt.
- `unembed(hidden)`: full-vocabulary logits with the model's own post-processing
  (final-logit soft-capping, logit scale, ...), in the model's dtype.
- `unembed_candidates(hidden, ids)`: only the rows `ids` of the output projection, computed
  in float32 (dense rows cast, quantized rows dequantized), then the same element-wise
  post-processing as `unembed`. hidden is [N, H], ids is [K] int32; the result is [N, K]
  float32 and equals `unembed(hidden)[:, ids]` up to float32 rounding.

All methods run on the MLX worker thread and build lazy graphs; callers evaluate.
"""

from __future__ import annotations

from typing import Any

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
