"""Our attention paths equal MLX's fused attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runner.models import attention as attn


def fused(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize(("n", "past"), [(16, 0), (300, 0), (600, 40), (20, 700)])
@pytest.mark.parametrize("mask", ["causal", None])
def test_cpu_block_attention_equals_fused(n, past, mask):
    rng = np.random.default_rng(n + past)
    q = mx.array(rng.standard_normal((1, 8, n, 32)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, past + n, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, past + n, 32)).astype(np.float32))
    ours = attn._cpu_causal(q, k, v, 32**-0.5, causal=mask is not None)
    assert np.abs(np.array(ours) - np.array(fused(q, k, v, 32**-0.5, mask))).max() < 1e-5


@pytest.mark.parametrize("numpy_softmax", [True, False], ids=["cpu-numpy", "mlx-gpu-branch"])
def test_shared_prefix_attention_equals_attention_over_a_full_copy(numpy_softmax, monkeypatch):
    monkeypatch.setattr(attn, "_softmax_in_numpy", lambda: numpy_softmax)
    rng = np.random.default_rng(0)
    b, n, p = 3, 5, 40
    prefix_k = mx.array(rng.standard_normal((1, 2, p, 16)).astype(np.float32))
    prefix_v = mx.array(rng.standard_normal((1, 2, p, 16)).astype(np.float32))
    cache = attn.SharedPrefixKV(prefix_k, prefix_v, b)
    k = mx.array(rng.standard_normal((b, 2, n, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((b, 2, n, 16)).astype(np.float32))
    keys, values = cache.update_and_fetch(k, v)
    assert cache.offset == p + n
    q = mx.array(rng.standard_normal((b, 6, n, 16)).astype(np.float32))
    ours = attn.attention(q, keys, values, cache, 0.25, "causal")
    full_k, full_v = attn._materialise(cache, keys, values)
    expected = fused(q, full_k, full_v, 0.25, "causal")
    assert np.abs(np.array(ours) - np.array(expected)).max() < 1e-5


def test_stock_attention_restores_mlx_lm_for_the_duration():
    from mlx_lm.models import llama

    assert llama.scaled_dot_product_attention is attn.attention
    with attn.stock_attention():
        assert llama.scaled_dot_product_attention is attn._MLX_LM_ATTENTION
    assert llama.scaled_dot_product_attention is attn.attention
