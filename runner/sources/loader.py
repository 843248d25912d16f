"""Turn `--model NAME` into a `ModelSource`: the default model, a local Hugging Face / mlx-lm
directory, or a name in the Ollama model store (runner/sources/ollama_store.py).

Nothing is built here: `runner.models.build_model` consumes the `ModelSource`. A directory is
read as given, symlinks followed; the shards its index names must be plain file names in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from runner.sources.ollama_store import load_safetensors, load_store_model
from runner.sources.source import ModelLoadError, ModelSource, config_json

# `--model default` means the prepared default model (runner/sources/default_model.py).
DEFAULT_ALIAS = "default"


def load_model_source(name_or_path: str) -> ModelSource:
    """`default`, an existing directory, a GGUF file, or an Ollama model name, in that
    order."""
    if name_or_path == DEFAULT_ALIAS:
        # Imported here so that ordinary loads never touch the preparation code.
        from runner.sources.default_model import resolve_default_gguf
        from runner.sources.gguf.model import load_gguf

        return load_gguf(resolve_default_gguf(), DEFAULT_ALIAS)
    if _is_dir(name_or_path):
        return load_local_dir(Path(name_or_path).expanduser())
    if name_or_path.endswith(".gguf") and _is_file(name_or_path):
        from runner.sources.gguf.model import load_gguf

        return load_gguf(Path(name_or_path).expanduser(), name_or_path)
    if name_or_path.startswith(("/", "./", "../", "~")):  # meant as a path, not a name
        raise ModelLoadError(f"{name_or_path} is not a model directory or GGUF file")
    return load_store_model(name_or_path)


def _is_dir(name_or_path: str) -> bool:
    """Whether the argument names an existing directory; `~nobody/x` or a NUL byte make
    `expanduser` raise, and such an argument names none."""
    try:
        return Path(name_or_path).expanduser().is_dir()
    except (RuntimeError, ValueError):
        return False


def _is_file(name_or_path: str) -> bool:
    try:
        return Path(name_or_path).expanduser().is_file()
    except (RuntimeError, ValueError):
        return False


def _read_text(path: Path) -> str | None:
    """An optional UTF-8 file's text."""
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def _read_json(path: Path, *, optional: bool = False) -> Any:
    if optional and not path.exists():
        return None
    try:
        return config_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path.name} not found in {path.parent}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def _weight_files(path: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors."""
    index = _read_json(path / "model.safetensors.index.json", optional=True)
    if index is not None:
        files = [path / name for name in _shard_names(index)]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    return files


def _shard_names(index: Any) -> list[str]:
    """The files an index's `weight_map` names, each refused unless it is a plain file name
    in the model directory: an index must not make the loader read elsewhere. (Symlinks are
    followed: the Hugging Face cache links every file to its blob store.)"""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelLoadError("model.safetensors.index.json has no weight_map object")
    for name in weight_map.values():
        if not _plain_file_name(name):
            raise ModelLoadError(
                f"model.safetensors.index.json names {name!r}, not a file in the model directory"
            )
    return sorted(set(weight_map.values()))


def _plain_file_name(name: Any) -> bool:
    """No separator, not `.` or `..`, and no NUL (which would cut the C path short)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and Path(name).name == name
    )


def _dir_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's quantization dict from config.json (`quantization`, or the identical copy
    mlx-lm writes as `quantization_config`). Other formats (GPTQ, AWQ, FP8, ...) would need
    weight conversion, so they are refused rather than loaded wrong."""
    block = config.get("quantization")
    if block is None:
        block = config.get("quantization_config")
        if isinstance(block, dict) and ("quant_method" in block or "bits" not in block):
            method = block.get("quant_method", "unknown")
            raise ModelLoadError(
                f"unsupported quantization_config (quant_method {method!r}); "
                "convert the model with mlx_lm.convert"
            )
    if block is None:
        return None
    if not isinstance(block, dict) or "bits" not in block or "group_size" not in block:
        raise ModelLoadError(f"malformed quantization config: {block!r}")
    return {"mode": "affine", **block}


def load_local_dir(path: Path) -> ModelSource:
    """A directory in Hugging Face / mlx-lm layout: config.json, *.safetensors (maybe
    sharded), tokenizer.json, optional tokenizer_config.json and generation_config.json."""
    path = Path(path)
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
    try:
        tokenizer_json = (path / "tokenizer.json").read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelLoadError(f"tokenizer.json not found in {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'tokenizer.json'}: {e}") from None

    weights: dict[str, mx.array] = {}
    for file in _weight_files(path):
        arrays, _ = load_safetensors(file)
        weights.update(arrays)
    return ModelSource(
        name=str(path),
        config=config,
        tokenizer_json=tokenizer_json,
        tokenizer_config=_read_json(path / "tokenizer_config.json", optional=True),
        generation_config=_read_json(path / "generation_config.json", optional=True),
        preprocessor_config=_read_json(path / "preprocessor_config.json", optional=True),
        chat_template=_read_text(path / "chat_template.jinja"),
        weights=weights,
        quantization=_dir_quantization(config),
    )
