"""Every tiny architecture loads from an Ollama store with the logits it has from its
directory (runner/sources/ollama_store.py: manifests, config layers, safetensors blobs; the
Go runner's import layout), so each family is proven on both of the runner's loading paths."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from runner.models import build_model
from runner.sources.loader import load_local_dir
from runner.sources.ollama_store import load_store_model
from tests.ollama_store import write_ollama_model
from tests.tiny import TINY_ARCHITECTURES, write_tiny_model

IDS = mx.array([[5, 9, 100, 7, 300, 11, 12, 13, 2, 40, 41]], dtype=mx.int32)


def logits(model) -> np.ndarray:
    return np.array(model.unembed(model.hidden(IDS, model.make_caches())).astype(mx.float32))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_a_store_model_equals_its_directory(tmp_path: Path, arch: str) -> None:
    path = write_tiny_model(arch, tmp_path / "hf")
    write_ollama_model(tmp_path / "models", f"tiny-{arch.lower()}", path)
    from_dir = build_model(load_local_dir(path))
    from_store = build_model(load_store_model(f"tiny-{arch.lower()}", tmp_path / "models"))
    assert from_store.architecture == from_dir.architecture == arch
    assert [type(c) for c in from_store.make_caches()] == [type(c) for c in from_dir.make_caches()]
    assert np.array_equal(logits(from_store), logits(from_dir))
