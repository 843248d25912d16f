"""The files of one model, wherever they came from (an Ollama store or a local directory).

A `ModelSource` is what the loaders produce and what the model registry consumes: plain
JSON configs, the tokenizer file, and a flat name -> array map of weights already renamed
to the Hugging Face / mlx-lm spelling (`P.weight`, and for quantized linears `P.scales`,
`P.biases`), plus the mlx-lm style quantization config that describes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


class ModelLoadError(Exception):
    """A model cannot be loaded; the message is printed after `Error: ` at start-up."""


def show(value: Any) -> str:
    """A value read from a model's files, for a one-line error message: its repr (so control
    characters are escaped), cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class ModelSource:
    name: str
    config: dict[str, Any]
    tokenizer_json: str  # the text of tokenizer.json
    tokenizer_config: dict[str, Any] | None = None
    generation_config: dict[str, Any] | None = None
    preprocessor_config: dict[str, Any] | None = None  # an image model's preprocessor_config.json
    weights: dict[str, mx.array] = field(default_factory=dict)
    # mlx-lm's `quantization` config: {"group_size", "bits", "mode"} defaults plus per-layer
    # entries keyed by module path ({"group_size", "bits", "mode"}, or False for dense).
    # None when nothing is quantized.
    quantization: dict[str, Any] | None = None
