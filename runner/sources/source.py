"""The files of one model, wherever they came from (an Ollama store or a local directory).

A `ModelSource` is what the loaders produce and what the model registry consumes: plain
JSON configs, the tokenizer file, and a flat name -> array map of weights already renamed
to the Hugging Face / mlx-lm spelling (`P.weight`, and for quantized linears `P.scales`,
`P.biases`), plus the mlx-lm style quantization config that describes them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing MLX here would load it before runner/environment.py settles
    import mlx.core as mx  # the library path (runner/native/build.py reads default_model)


class ModelLoadError(Exception):
    """A model cannot be loaded; the message is printed after `Error: ` at start-up."""


def show(value: Any) -> str:
    """A value read from a model's files, for a one-line error message: its repr (so control
    characters are escaped), cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# transformers 5 writes the floats JSON cannot spell as {"__float__": "Infinity"} and reads
# them back (PreTrainedConfig._decode_special_floats); Nemotron-H's time_step_limit is one.
_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_float(pairs: list[tuple[str, Any]]) -> Any:
    if len(pairs) == 1 and pairs[0][0] == "__float__" and pairs[0][1] in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[pairs[0][1]]
    return dict(pairs)


def config_json(text: str | bytes) -> Any:
    """A model's JSON config as transformers reads it: Python's json (which also reads
    `Infinity` and `NaN`), and transformers' `{"__float__": "Infinity"}` objects as floats.
    Raises json.JSONDecodeError (a ValueError) or UnicodeDecodeError."""
    return json.loads(text, object_pairs_hook=_special_float)


@dataclass
class ModelSource:
    name: str
    config: dict[str, Any]
    tokenizer_json: str  # the text of tokenizer.json
    tokenizer_config: dict[str, Any] | None = None
    generation_config: dict[str, Any] | None = None
    preprocessor_config: dict[str, Any] | None = None  # an image model's preprocessor_config.json
    chat_template: str | None = None  # a chat_template.jinja file (else tokenizer_config's)
    weights: dict[str, mx.array] = field(default_factory=dict)
    # An Ollama model's own layers beside the weights (application/vnd.ollama.image.*):
    # "template" (a Go text/template), "system", "license" as text, "params" as JSON.
    ollama: dict[str, Any] = field(default_factory=dict)
    # mlx-lm's `quantization` config: {"group_size", "bits", "mode"} defaults plus per-layer
    # entries keyed by module path ({"group_size", "bits", "mode"}, or False for dense).
    # None when nothing is quantized.
    quantization: dict[str, Any] | None = None
