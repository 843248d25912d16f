"""Where the default model lives once prepared: `--model default` (tools/default_model.py
prepares it).

The default model is SmolLM2-135M-Instruct (Apache-2.0), converted once from the GGUF inside
a pinned PyPI wheel into `$OLLAMA_MLX_RUNNER_CACHE` or `~/.cache/ollama-mlx-runner`, then
`models/<name>`. The runner only reads that directory; preparing it (a download and a
conversion) is tooling, done by `scripts/demo` or `python -m tools.default_model`.
"""

from __future__ import annotations

import os
from pathlib import Path

from runner.sources.source import ModelLoadError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = ".prepared"  # holds the GGUF sha256; written last, so its presence means complete


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("OLLAMA_MLX_RUNNER_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ollama-mlx-runner"


def model_dir(cache_dir: Path | None = None) -> Path:
    return cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME


def is_prepared(path: Path) -> bool:
    try:
        return (path / MARKER).read_text().strip() == GGUF_SHA256
    except OSError:
        return False


def resolve_default_model() -> Path:
    """The prepared default model's directory; a ModelLoadError saying how to prepare it."""
    path = model_dir()
    if not is_prepared(path):
        raise ModelLoadError(
            f"the default model is not prepared in {path}: run scripts/demo, or "
            "python -m tools.default_model from the repository"
        )
    return path
