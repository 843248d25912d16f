"""The tiny models' logits against their stored goldens (tests/test_golden.py): one shot, in
chunks through the same caches, and through the candidate path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runner.models import Model
from tests.tiny import GOLDEN

TOLERANCE = 1e-4


CHUNK = 7


CANDIDATES = [0, 2, 5, 17, 100, 255, 383]


def logits_three_ways(model: Model, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Last-position logits: one shot, in chunks of CHUNK through the same caches, and the
    candidate path (only CANDIDATES, float32)."""
    ids = mx.array(tokens, dtype=mx.int32)[None]
    one_shot = model.hidden(ids, model.make_caches())[:, -1]
    caches = model.make_caches()
    for start in range(0, ids.shape[1], CHUNK):
        chunked = model.hidden(ids[:, start : start + CHUNK], caches)[:, -1]
    candidates = model.unembed_candidates(one_shot, mx.array(CANDIDATES, dtype=mx.int32))
    out = {
        "one_shot": model.unembed(one_shot)[0],
        "chunked": model.unembed(chunked)[0],
        "candidates": candidates[0],
    }
    return {k: np.array(v.astype(mx.float32)) for k, v in out.items()}


def assert_matches(model: Model, tokens: np.ndarray, expected: np.ndarray) -> None:
    got = logits_three_ways(model, tokens)
    for way in ("one_shot", "chunked"):
        diff = np.abs(got[way] - expected).max()
        assert diff <= TOLERANCE, f"{way}: max abs diff {diff:.3g} over {len(tokens)} tokens"
    diff = np.abs(got["candidates"] - expected[CANDIDATES]).max()
    assert diff <= TOLERANCE, f"candidates: max abs diff {diff:.3g} over {len(tokens)} tokens"


def stored_golden(arch: str) -> list[tuple[np.ndarray, np.ndarray]]:
    z = np.load(GOLDEN / f"{arch}.npz")
    return [(z[f"tokens_{i}"], z[f"logits_{i}"]) for i in range(len(z.files) // 2)]
