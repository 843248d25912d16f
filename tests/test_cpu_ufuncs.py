"""numpy's element-wise kernels equal MLX's, and run only where they should."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import activations, gemma3_text, qwen3

from runner.models import cpu_ufuncs, stock_mlx_lm


@pytest.fixture
def always_numpy(monkeypatch):
    monkeypatch.setattr(cpu_ufuncs, "MIN_ELEMENTS", 0)


def test_softmax_numerators_in_place_over_two_parts_with_a_mask():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 5, 40)).astype(np.float32) * 20
    b = rng.standard_normal((2, 3, 5, 7)).astype(np.float32) * 20
    hidden = np.arange(7)[None, :] > (2 + np.arange(5))[:, None]  # causal over the last 5 of 7
    joint = np.concatenate([a, np.where(hidden, -np.inf, b)], axis=-1).astype(np.float64)
    expected = np.exp2(joint - joint.max(axis=-1, keepdims=True))
    pa, pb = a.copy(), b.copy()
    total = cpu_ufuncs.exp2_softmax_inplace([pa, pb], [None, hidden])
    got = np.concatenate([pa, pb], axis=-1)
    assert (pb[..., hidden] == 0).all()
    # float32 x - m rounds at ~1e-6 relative to |x| <= 80, hence the 2e-5
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-30)
    np.testing.assert_allclose(total[..., 0], expected.sum(axis=-1), rtol=1e-6)


def test_empty_parts_are_ignored():
    part = np.array([[0.0, 1.0]], dtype=np.float32)
    total = cpu_ufuncs.exp2_softmax_inplace([part[:, :0], part], [None, None])
    np.testing.assert_allclose(part, [[0.5, 1.0]])
    np.testing.assert_allclose(total, [[1.5]])


def test_host_views_write_through_to_the_mlx_array():
    fresh = mx.ones((4, 8)) @ mx.ones((8, 16))
    (view,) = cpu_ufuncs.host_views(fresh)
    view *= 0.5
    assert np.array(fresh).max() == 4.0  # 8 * 0.5: MLX reads the rewritten memory


def test_swiglu_equals_mlx_lm_on_extremes_and_strided_input(always_numpy):
    rng = np.random.default_rng(1)
    gate = rng.standard_normal((2, 9, 64)).astype(np.float32) * 8
    gate[0, 0, :4] = [-200.0, -90.0, 90.0, 0.0]
    up = rng.standard_normal((2, 9, 64)).astype(np.float32)
    # A transposed (non-contiguous) gate must be read through its strides.
    g = mx.array(gate.transpose(1, 0, 2).copy()).transpose(1, 0, 2)
    ours = np.array(cpu_ufuncs.swiglu(g, mx.array(up)))
    expected = np.array(activations.swiglu(mx.array(gate), mx.array(up)))
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def test_gelu_glu_equals_mlx(always_numpy):
    rng = np.random.default_rng(2)
    gate = rng.standard_normal((3, 70)).astype(np.float32) * 6
    gate[0, :3] = [-50.0, 50.0, 0.0]
    up = rng.standard_normal((3, 70)).astype(np.float32)
    ours = np.array(cpu_ufuncs.gelu_approx_glu(mx.array(gate), mx.array(up)))
    expected = np.array(nn.gelu_approx(mx.array(gate)) * mx.array(up))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def test_small_blocks_and_other_dtypes_stay_in_mlx(monkeypatch):
    crossed = []
    monkeypatch.setattr(cpu_ufuncs, "_numpy", lambda *a: crossed.append(a) or [])
    small = mx.ones((1, 1, 64))
    cpu_ufuncs.swiglu(small, small)
    cpu_ufuncs.gelu_approx_glu(small, small)
    big = mx.ones((1, 8, cpu_ufuncs.MIN_ELEMENTS // 8), dtype=mx.bfloat16)
    cpu_ufuncs.swiglu(big, big)
    assert crossed == []


def test_installed_in_the_families_and_stock_restores_mlx_lm():
    stock_gemma = cpu_ufuncs._GEMMA3_MLP_CALL
    assert qwen3.swiglu is cpu_ufuncs.swiglu
    assert gemma3_text.MLP.__call__ is not stock_gemma
    with stock_mlx_lm():
        assert qwen3.swiglu is activations.swiglu
        assert gemma3_text.MLP.__call__ is stock_gemma
    assert qwen3.swiglu is cpu_ufuncs.swiglu
    assert gemma3_text.MLP.__call__ is not stock_gemma
