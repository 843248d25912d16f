"""One-row products through numpy equal MLX's; everything else stays MLX's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runner.models import cpu_gemv
from tests.tiny import load_tiny_model


def test_matvec_equals_mlx_with_and_without_bias():
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((300, 64)).astype(np.float32))
    b = mx.array(rng.standard_normal(300).astype(np.float32))
    x = mx.array(rng.standard_normal((1, 1, 64)).astype(np.float32))
    got = cpu_gemv.matvec(x, w, b)
    assert got.shape == (1, 1, 300)
    np.testing.assert_allclose(np.array(got), np.array(x @ w.T + b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(cpu_gemv.matvec(x, w)), np.array(x @ w.T), atol=1e-5)


def test_gemv_linear_takes_only_one_float32_row(monkeypatch):
    layer = nn.Linear(32, 48)
    mx.eval(layer.parameters())
    plain = {"one": mx.ones((1, 1, 32)), "rows": mx.ones((1, 3, 32))}
    expected = {k: layer(v) for k, v in plain.items()}
    assert cpu_gemv.install(layer) == 1 and isinstance(layer, cpu_gemv.GemvLinear)
    calls = []
    matvec = cpu_gemv.matvec
    monkeypatch.setattr(cpu_gemv, "matvec", lambda *a: calls.append(a[0].shape) or matvec(*a))
    for key, x in plain.items():
        np.testing.assert_allclose(np.array(layer(x)), np.array(expected[key]), atol=1e-5)
    assert calls == [(1, 1, 32)]
    assert not cpu_gemv.one_row(mx.ones((1, 32), dtype=mx.bfloat16), layer.weight)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_loaded_models_decode_through_gemv_with_the_same_logits(tmp_path, arch):
    model = load_tiny_model(arch, tmp_path / arch)
    linears = [m for _, m in model.module.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is cpu_gemv.GemvLinear for m in linears)
    caches = model.make_caches()
    model.hidden(mx.array([[3, 5, 7, 11]]), caches)
    step = model.unembed(model.hidden(mx.array([[13]]), caches)[0, -1:])  # numpy, one row
    whole = model.module.model(mx.array([[3, 5, 7, 11, 13]]))[0, -1:]  # MLX, five rows
    np.testing.assert_allclose(np.array(step), np.array(model.unembed(whole)), atol=1e-4)
