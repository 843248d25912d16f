"""A half-precision checkpoint's matrices on the CPU, widened or held as stored
(runner/models/halves.py): the stored layout computes the widened one's numbers (bit for bit
in prompt chunks, where both read panels of the same halves; within float32 rounding in decode
steps and rows over a prefix) from the file's own bytes, at a third of the memory, and `auto`
picks it where the widened layout would not fit."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear

from runner.backend import Backend
from runner.native import abi, preload
from runner.sources.source import ModelLoadError
from tests.tiny import load_tiny_model

pytestmark = pytest.mark.skipif(
    not preload.dispatch_active(), reason="needs the runner's dispatch library preloaded"
)


def _half_rows() -> bool:
    functions = abi.load()
    return functions is not None and bool(functions.half_weights)


needs_half = pytest.mark.skipif(
    preload.dispatch_active() and not _half_rows(), reason="no AVX2 + F16C on this CPU"
)

BACKEND = Backend.cpu().replace(native_step_max_tokens=160)
SETTING = "OLLAMA_MLX_RUNNER_HALF_WEIGHTS"


def _load(arch: str, path: Path, dtype: str, layout: str, monkeypatch: Any, **kw: Any) -> Any:
    monkeypatch.setenv(SETTING, layout)
    return load_tiny_model(arch, path, backend=kw.pop("backend", BACKEND), dtype=dtype, **kw)


def _forward(model: Any, caches: list[Any], tokens: list[int]) -> np.ndarray:
    hidden = model.hidden(mx.array([tokens], dtype=mx.int32), caches)
    logits = model.unembed(hidden)
    mx.eval(hidden, logits)
    return np.array(logits)


def _stored(model: Any) -> dict[str, str]:
    from runner.models.quantized import GGMLEmbedding, GGMLLinear, GGMLSwitchLinear

    kept = (GGMLLinear, GGMLEmbedding, GGMLSwitchLinear)
    return {p: m.ggml_type for p, m in model.module.named_modules() if isinstance(m, kept)}


def _parameter_bytes(model: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.module.parameters()))


@needs_half
@pytest.mark.parametrize(
    "arch, dtype",
    [
        ("LlamaForCausalLM", "bfloat16"),
        ("Qwen3ForCausalLM", "float16"),
        ("Gemma3ForCausalLM", "bfloat16"),
        ("Phi3ForCausalLM", "float16"),  # fused projections, read as row ranges
        ("GptOssForCausalLM", "bfloat16"),  # sinks, experts with biases
        ("Qwen3MoeForCausalLM", "bfloat16"),  # stacked experts
    ],
)
def test_stored_halves_compute_what_widened_ones_compute(arch, dtype, tmp_path, monkeypatch):
    """Every decoder matrix kept as the checkpoint's bytes (no float32 weights, no half
    copies: each matrix half its float32 bytes, a third of the widened layout's with its
    copies), read by the step: prompt chunks give the widened layout's bits (both the same
    halves' panels), decode steps (the rows' own stream tiles, the copies' panels widened)
    and rows over a prefix its numbers within float32 rounding."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    widened = _load(arch, tmp_path / "w", dtype, "widened", monkeypatch)
    stored = _load(arch, tmp_path / "s", dtype, "stored", monkeypatch)
    assert not _stored(widened) and widened._native.half_format == dtype
    ggml_type = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    halves = _stored(stored)
    assert set(halves.values()) == {ggml_type}
    assert "model.embed_tokens" in halves and stored._native is not None
    layers = dict(stored.module.named_modules())
    stacks = [p for p in halves if type(layers[p]).__name__ == "GGMLSwitchLinear"]
    projections = [p for p in halves if p.startswith("model.layers.") and p not in stacks]
    assert len(projections) >= 4 * stored._native.layers  # attention's, at least
    assert stored._native.half_format is None and stored._native.half_copies == []
    held = sum(layers[p].blocks.nbytes for p in halves)  # the halves, where float32 was 2x
    assert _parameter_bytes(stored) == _parameter_bytes(widened) - held
    prompt = np.random.default_rng(3).integers(3, 300, size=180).tolist()
    results = []
    for model in (widened, stored):
        caches = model.make_caches()
        logits = [_forward(model, caches, prompt[a:b]) for a, b in ((0, 150), (150, 170))]
        with model.decode_steps():
            steps = [_forward(model, caches, [t]) for t in prompt[170:178]]
        batch = broadcast([kind_of(c) for c in caches], caches, 3)
        rows = np.array(forward_suffixes(model, batch, [[4, 5], [6], [7, 8, 9]]))
        results.append((logits, steps, rows))
    (want_logits, want_steps, want_rows), (got_logits, got_steps, got_rows) = results
    sparse = sum(e is not None for e in stored._native._experts)
    assert len(stacks) == 3 * sparse  # stacked experts as stored too
    experts = sparse > 0  # widened, float32 experts (another product order)
    for got, want in zip(got_logits, want_logits, strict=True):
        if experts:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, want)
    for got, want in [*zip(got_steps, want_steps, strict=True), (got_rows, want_rows)]:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    # and the step reads the stored bytes, where MLX holds them: other bytes, other numbers
    for path in [projections[0], *stacks[:1]]:
        before = _forward(stored, stored.make_caches(), prompt[:5])
        blocks = np.asarray(layers[path].blocks)
        ctypes.memset(blocks.ctypes.data, 0, blocks.nbytes)
        assert not np.array_equal(_forward(stored, stored.make_caches(), prompt[:5]), before)


@needs_half
def test_auto_stores_halves_where_widening_would_not_fit(tmp_path, monkeypatch):
    """`auto`: widened (float32 weights and the step's half copies, 3x the halves' bytes)
    while that takes at most three quarters of the memory available at load; stored beyond
    (where before only the copies were dropped, the float32 weights, 2x, kept). A mixture's
    stacked experts stored in any case."""
    from runner.backend import native_step
    from runner.models import halves

    monkeypatch.setattr(native_step, "available_memory", lambda: 1 << 40)
    ample = _load("Qwen3ForCausalLM", tmp_path / "a", "bfloat16", "auto", monkeypatch)
    assert not _stored(ample) and ample._native.half_format == "bfloat16"
    monkeypatch.setattr(native_step, "available_memory", lambda: 100_000)  # bytes
    short = _load("Qwen3ForCausalLM", tmp_path / "b", "bfloat16", "auto", monkeypatch)
    assert _stored(short) and short._native is not None and short._native.half_copies == []
    # a mixture's experts are stored whatever the memory (widened, they have no copies)
    monkeypatch.setattr(native_step, "available_memory", lambda: 1 << 40)
    moe = _load("Qwen3MoeForCausalLM", tmp_path / "m", "bfloat16", "auto", monkeypatch)
    layers = dict(moe.module.named_modules())
    kinds = {type(layers[p]).__name__ for p in _stored(moe)}
    assert kinds == {"GGMLSwitchLinear"} and moe._native.half_format == "bfloat16"
    widened = _load("Qwen3MoeForCausalLM", tmp_path / "w", "bfloat16", "widened", monkeypatch)
    prompt = list(range(3, 40))
    want = _forward(widened, widened.make_caches(), prompt)
    got = _forward(moe, moe.make_caches(), prompt)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(halves, "vector_halves", lambda: False)  # halves a value at a time
    scalar = _load("Qwen3MoeForCausalLM", tmp_path / "v", "bfloat16", "auto", monkeypatch)
    assert not _stored(scalar)
    assert halves.stores(1000, "auto", 3999) and not halves.stores(1000, "auto", 4000)
    assert halves.stores(1000, "auto", 4000, other_bytes=1)  # the experts' bytes count
    assert not halves.stores(1 << 40, "auto", None)  # memory unknown: as before
    assert halves.stores(1, "stored", 1 << 40) and not halves.stores(1 << 40, "widened", 1)


def test_an_unknown_layout_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match=SETTING):
        _load("LlamaForCausalLM", tmp_path, "bfloat16", "halves", monkeypatch)


@needs_half
def test_no_stored_halves_without_a_step(tmp_path, monkeypatch):
    """A family without the native step, a backend without it, a float32 checkpoint, and a
    module the step declines keep MLX's path's float32 weights, `stored` or not."""
    from runner.backend import native_step

    for arch, path in (("Cohere2MoeForCausalLM", "c"), ("Gemma4ForCausalLM", "g")):
        other = _load(arch, tmp_path / path, "bfloat16", "stored", monkeypatch)
        assert other._native is None and not _stored(other)
    off = BACKEND.replace(native_step_max_tokens=None)
    plain = _load(
        "LlamaForCausalLM", tmp_path / "o", "bfloat16", "stored", monkeypatch, backend=off
    )
    assert not _stored(plain)
    full = _load("LlamaForCausalLM", tmp_path / "f", "float32", "stored", monkeypatch)
    assert full._native is not None and not _stored(full)
    widened = _load("LlamaForCausalLM", tmp_path / "w", "bfloat16", "widened", monkeypatch)
    monkeypatch.setattr(native_step, "build", lambda *a, **k: None)  # the step declines
    declined = _load("LlamaForCausalLM", tmp_path / "d", "bfloat16", "stored", monkeypatch)
    assert declined._native is None and not _stored(declined)
    linears = [m for _, m in declined.module.named_modules() if type(m) is nn.Linear]
    assert linears and all(m.weight.dtype == mx.float32 for m in linears)
    moe = _load("Qwen3MoeForCausalLM", tmp_path / "m", "bfloat16", "stored", monkeypatch)
    assert moe._native is None and not _stored(moe)
    stacks = [m for _, m in moe.module.named_modules() if isinstance(m, SwitchLinear)]
    assert stacks and all(m.weight.dtype == mx.float32 for m in stacks)
    prompt = list(range(3, 40))
    want = _forward(widened, widened.make_caches(), prompt)
    np.testing.assert_allclose(
        _forward(declined, declined.make_caches(), prompt), want, rtol=1e-4, atol=1e-5
    )


@needs_half
def test_stored_halves_score_what_widened_ones_score(engine, tmp_path, monkeypatch):
    """/v1/score's numbers from the stored layout: candidates' logits of rows sharing a
    prefix, scored cold and again through the prefix cache, those of the widened layout."""
    from runner.score.scorer import Scorer
    from runner.score.validate import Row
    from tests.tiny import prefix_cache

    def load(layout: str) -> Any:
        return engine.call(
            lambda job: _load(
                "Qwen3ForCausalLM", tmp_path / layout, "bfloat16", layout, monkeypatch
            )
        )

    widened, stored = load("widened"), load("stored")
    assert _stored(stored) and not _stored(widened)
    shared = [5, 17, 42, 99, 23, 8, 61, 7, 19, 33] * 4
    rows = [Row([*shared, *tail], [3, 7, 11, 300]) for tail in ([4], [9, 10, 12], [], [6, 6])]
    scores = {}
    for name, model in (("widened", widened), ("stored", stored)):
        cache = engine.call(lambda job, m=model: prefix_cache(m, name="halves", keep_hidden=True))
        cold = engine.call(lambda job, m=model, c=cache: Scorer(m, c).score(rows, job.check))
        warm = engine.call(lambda job, m=model, c=cache: Scorer(m, c).score(rows, job.check))
        assert warm.cached_tokens > 0
        scores[name] = (cold.logits, warm.logits)
    for got, want in zip(scores["stored"], scores["widened"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
