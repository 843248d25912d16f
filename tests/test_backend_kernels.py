"""The backend's kernels equal MLX's own computations, and run only where the policy says.

Attention (the batched shared-prefix path and the CPU's blocked causal path, each with the
softmax from numpy and from MLX), numpy's softmax numerators and gated activations, and
one-row products through numpy's gemv, and rotary embeddings from shared tables.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import activations

from runner.backend import Backend, gemv, host
from runner.backend.attention import Attention
from runner.cache.shared_prefix import SharedPrefixKV

CPU = Backend.cpu()
# The MLX softmax branch (what Metal and CUDA run), exercised on this CPU.
MLX_SOFTMAX = CPU.replace(host_softmax_min_elements=None)
SOFTMAX_POLICIES = pytest.mark.parametrize(
    "backend", [CPU, MLX_SOFTMAX], ids=["numpy-softmax", "mlx-softmax"]
)


def fused(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# --- attention ---------------------------------------------------------------------------


@SOFTMAX_POLICIES
@pytest.mark.parametrize(
    ("n", "past"), [(1, 0), (1, 37), (3, 20), (16, 0), (300, 0), (600, 40), (20, 700)]
)
@pytest.mark.parametrize("mask", ["causal", None])
def test_blocked_causal_attention_equals_fused(backend, n, past, mask):
    rng = np.random.default_rng(n + past)
    q = mx.array(rng.standard_normal((1, 8, n, 32)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, past + n, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, past + n, 32)).astype(np.float32))
    ours = Attention(backend)._blocked_causal(q, k, v, 32**-0.5, causal=mask is not None)
    assert np.abs(np.array(ours) - np.array(fused(q, k, v, 32**-0.5, mask))).max() < 1e-5


@SOFTMAX_POLICIES
def test_shared_prefix_attention_equals_attention_over_a_full_copy(backend):
    rng = np.random.default_rng(0)
    b, n, p = 3, 5, 40
    prefix_k = mx.array(rng.standard_normal((1, 2, p, 16)).astype(np.float32))
    prefix_v = mx.array(rng.standard_normal((1, 2, p, 16)).astype(np.float32))
    cache = SharedPrefixKV(prefix_k, prefix_v, b)
    k = mx.array(rng.standard_normal((b, 2, n, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((b, 2, n, 16)).astype(np.float32))
    keys, values = cache.update_and_fetch(k, v)
    assert cache.offset == p + n
    q = mx.array(rng.standard_normal((b, 6, n, 16)).astype(np.float32))
    ours = Attention(backend)(q, keys, values, cache, 0.25, "causal")
    full_k, full_v = cache.materialise(keys, values)
    expected = fused(q, full_k, full_v, 0.25, "causal")
    assert np.abs(np.array(ours) - np.array(expected)).max() < 1e-5


def test_gpu_policy_hands_plain_attention_to_mlx_lm(monkeypatch):
    from mlx_lm.models import base

    calls = []
    stock = base.scaled_dot_product_attention
    monkeypatch.setattr(
        base, "scaled_dot_product_attention", lambda *a: calls.append(1) or stock(*a)
    )
    q = k = v = mx.ones((1, 2, 32, 8))
    Attention(Backend.gpu())(q, k, v, None, 0.3, "causal")
    assert calls == [1]
    Attention(CPU)(q, k, v, None, 0.3, "causal")  # 32 queries: blocked on the CPU
    assert calls == [1]


# --- numpy kernels ------------------------------------------------------------------------


def test_softmax_numerators_in_place_over_two_parts_with_a_mask():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 5, 40)).astype(np.float32) * 20
    b = rng.standard_normal((2, 3, 5, 7)).astype(np.float32) * 20
    hidden = np.arange(7)[None, :] > (2 + np.arange(5))[:, None]  # causal over the last 5 of 7
    joint = np.concatenate([a, np.where(hidden, -np.inf, b)], axis=-1).astype(np.float64)
    expected = np.exp(joint - joint.max(axis=-1, keepdims=True))
    pa, pb = a.copy(), b.copy()
    total = host.softmax_numerators_inplace([pa, pb], [None, hidden])
    got = np.concatenate([pa, pb], axis=-1)
    assert (pb[..., hidden] == 0).all()
    # float32 x - m rounds at ~1e-6 relative to |x| <= 80, hence the 2e-5
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-30)
    np.testing.assert_allclose(total[..., 0], expected.sum(axis=-1), rtol=1e-6)


def test_empty_parts_are_ignored():
    part = np.array([[0.0, 1.0]], dtype=np.float32)
    total = host.softmax_numerators_inplace([part[:, :0], part], [None, None])
    np.testing.assert_allclose(part, [[np.exp(-1.0), 1.0]], rtol=1e-6)
    np.testing.assert_allclose(total, [[1.0 + np.exp(-1.0)]], rtol=1e-6)


def test_host_views_write_through_to_the_mlx_array():
    fresh = mx.ones((4, 8)) @ mx.ones((8, 16))
    (view,) = host.host_views(fresh)
    view *= 0.5
    assert np.array(fresh).max() == 4.0  # 8 * 0.5: MLX reads the rewritten memory


def test_swiglu_equals_mlx_lm_on_extremes_and_strided_input():
    rng = np.random.default_rng(1)
    gate = rng.standard_normal((2, 9, 64)).astype(np.float32) * 8
    gate[0, 0, :4] = [-200.0, -90.0, 90.0, 0.0]
    up = rng.standard_normal((2, 9, 64)).astype(np.float32)
    # A transposed (non-contiguous) gate must be read through its strides.
    g = mx.array(gate.transpose(1, 0, 2).copy()).transpose(1, 0, 2)
    ours = np.array(host.swiglu_host(g, mx.array(up)))
    expected = np.array(activations.swiglu(mx.array(gate), mx.array(up)))
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def test_gelu_glu_equals_mlx():
    rng = np.random.default_rng(2)
    gate = rng.standard_normal((3, 70)).astype(np.float32) * 6
    gate[0, :3] = [-50.0, 50.0, 0.0]
    up = rng.standard_normal((3, 70)).astype(np.float32)
    ours = np.array(host.gelu_glu_host(mx.array(gate), mx.array(up)))
    expected = np.array(nn.gelu_approx(mx.array(gate)) * mx.array(up))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def test_activations_leave_mlx_only_for_large_float32_blocks(monkeypatch):
    crossed = []
    for name in ("swiglu_host", "gelu_glu_host"):
        monkeypatch.setattr(host, name, lambda *a, n=name: crossed.append(n) or a[0])
    limit = CPU.host_activation_min_elements
    assert limit
    act = host.Activations(CPU)
    small = mx.ones((1, 1, 64))
    act.swiglu(small, small)
    act.gelu_glu(small, small)
    big16 = mx.ones((1, 8, limit // 8), dtype=mx.bfloat16)
    act.swiglu(big16, big16)
    host.Activations(Backend.gpu()).swiglu(mx.ones((1, 8, limit)), mx.ones((1, 8, limit)))
    assert crossed == []
    big = mx.ones((1, 8, limit // 8))
    act.swiglu(big, big)
    act.gelu_glu(big, big)
    assert crossed == ["swiglu_host", "gelu_glu_host"]


# --- gemv ---------------------------------------------------------------------------------


def test_matvec_equals_mlx_with_and_without_bias():
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((300, 64)).astype(np.float32))
    b = mx.array(rng.standard_normal(300).astype(np.float32))
    x = mx.array(rng.standard_normal((1, 1, 64)).astype(np.float32))
    got = gemv.matvec(x, w, b)
    assert got.shape == (1, 1, 300)
    np.testing.assert_allclose(np.array(got), np.array(x @ w.T + b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(gemv.matvec(x, w)), np.array(x @ w.T), atol=1e-5)


def test_gemv_linear_takes_only_one_float32_row(monkeypatch):
    layer = nn.Linear(32, 48)
    mx.eval(layer.parameters())
    plain = {"one": mx.ones((1, 1, 32)), "rows": mx.ones((1, 3, 32))}
    expected = {k: layer(v) for k, v in plain.items()}
    assert gemv.install(layer) == 1 and isinstance(layer, gemv.GemvLinear)
    calls = []
    matvec = gemv.matvec
    monkeypatch.setattr(gemv, "matvec", lambda *a: calls.append(a[0].shape) or matvec(*a))
    for key, x in plain.items():
        np.testing.assert_allclose(np.array(layer(x)), np.array(expected[key]), atol=1e-5)
    assert calls == [(1, 1, 32)]
    assert not gemv.one_row(mx.ones((1, 32), dtype=mx.bfloat16), layer.weight)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_models_loaded_with_numpy_gemv_decode_through_it_with_the_same_logits(tmp_path, arch):
    from tests.tiny import load_tiny_model

    model = load_tiny_model(arch, tmp_path / arch, backend=CPU.replace(gemv=True))
    linears = [m for _, m in model.module.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is gemv.GemvLinear for m in linears)
    caches = model.make_caches()
    model.hidden(mx.array([[3, 5, 7, 11]]), caches)
    step = model.unembed(model.hidden(mx.array([[13]]), caches)[0, -1:])  # numpy, one row
    whole = model.module.model(mx.array([[3, 5, 7, 11, 13]]))[0, -1:]  # MLX, five rows
    np.testing.assert_allclose(np.array(step), np.array(model.unembed(whole)), atol=1e-4)


# --- rotary embeddings from shared tables -------------------------------------------------


def _rope_modules():
    from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return [
        nn.RoPE(16, base=10000.0),
        nn.RoPE(16, base=1e6, scale=0.125),  # linear scaling
        nn.RoPE(8, base=10000.0),  # partial: 8 of 16 dims rotated
        Llama3RoPE(
            16,
            max_position_embeddings=2048,
            base=500000.0,
            scaling_config={**llama3, "original_max_position_embeddings": 16},
        ),
        # YaRN with an input scale (mscale 0.1 ln 16 + 1): Ministral3's, DeepSeek's rule
        YarnRoPE(16, base=1e6, scaling_factor=16.0, original_max_position_embeddings=16),
        # longrope (Phi3): per-pair factors and an input scale, 12 of 16 dims rotated
        SuScaledRoPE(
            12,
            base=10000.0,
            max_position_embeddings=256,
            original_max_position_embeddings=16,
            long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
        ),
    ]


def rope_float64(
    x: np.ndarray, inv_freq: np.ndarray, offset: int, amplitude: float = 1.0
) -> np.ndarray:
    """The rotate-half rotary embedding of the leading 2 * len(inv_freq) dims, times
    `amplitude` (YaRN's input scale), in float64."""
    x = x.astype(np.float64)
    x[..., : 2 * len(inv_freq)] *= amplitude
    half = len(inv_freq)
    angles = np.arange(offset, offset + x.shape[-2])[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


@pytest.mark.parametrize(
    "index", range(6), ids=["plain", "scaled", "partial", "llama3", "yarn", "longrope"]
)
@pytest.mark.parametrize(("length", "offset"), [(1, 0), (1, 900), (37, 0), (5, 3000)])
def test_table_rope_equals_mlx_rope(index, length, offset):
    """Equal to mx.fast.rope within its float32 angles (x * inv_freq rounded near 3000 rad is
    off by ~1e-4), and to the float64 rotation within float32 rounding."""
    from runner.backend.rope import RopeTables, TableRoPE, amplitude, inverse_frequencies

    original = _rope_modules()[index]
    inv_freq, scale = inverse_frequencies(original), amplitude(original)
    assert inv_freq is not None and (scale > 1) == (index >= 4)
    table = TableRoPE(original, inv_freq, RopeTables(), scale)
    x = mx.random.normal((2, 3, length, 16), key=mx.random.key(index))
    got = np.array(table(x, offset=offset))
    np.testing.assert_allclose(got, np.array(original(x, offset=offset)), atol=3e-4)
    want = rope_float64(np.array(x), inv_freq, offset, scale)
    np.testing.assert_allclose(got, want, atol=3e-6 * scale)


def test_the_native_steps_rope_rows_are_the_tables_rows():
    """The native step's rotary rows (`_RopeRows`: blocks of positions computed once, a few
    kept) equal the tables MLX's path computes for the same positions, bit for bit: within
    a block, across block boundaries, for two tables at once (Gemma3's), after evictions."""
    from runner.backend import rope
    from runner.backend.native_step import ROPE_BLOCK, _RopeRows

    tables = rope.RopeTables()
    ropes = [
        rope.TableRoPE(m, rope.inverse_frequencies(m), tables, rope.amplitude(m))
        for m in (_rope_modules()[0], _rope_modules()[4])  # plain; YaRN (an amplitude)
    ]
    rows = _RopeRows(ropes)
    spans = [(0, 1), (5, 37), (ROPE_BLOCK - 3, 9), (3 * ROPE_BLOCK - 1, 2 * ROPE_BLOCK + 5)]
    spans += [(b * ROPE_BLOCK + 7, 1) for b in range(8)] + [(5, 37), (900, 1)]
    for offset, length in spans:
        cos, sin = rows.rows(offset, length)
        assert cos.shape == (2, length, ropes[0].dims) and cos.flags.c_contiguous
        for i, r in enumerate(ropes):
            want_cos, want_sin = r.table(offset, length)
            np.testing.assert_array_equal(cos[i], np.array(want_cos))
            np.testing.assert_array_equal(sin[i], np.array(want_sin))
    assert len(rows._blocks) <= _RopeRows.KEPT


def test_table_rope_hands_array_offsets_and_other_rules_to_mlx():
    from runner.backend import rope

    assert rope.inverse_frequencies(nn.RoPE(16, traditional=True)) is None
    original = nn.RoPE(16)
    table = rope.TableRoPE(original, rope.inverse_frequencies(original), rope.RopeTables())
    x = mx.random.normal((2, 1, 3, 16), key=mx.random.key(1))
    offsets = mx.array([4, 9])  # per-row offsets, as mlx-lm's batch caches give
    assert mx.array_equal(table(x, offset=offsets), original(x, offset=offsets))


def test_table_rope_installs_on_plain_modules_and_shares_one_table():
    from runner.backend import rope

    class Layer(nn.Module):
        def __init__(self, traditional: bool):
            super().__init__()
            self.rope = nn.RoPE(16, traditional=traditional)
            self.proj = nn.Linear(4, 4)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Layer(False), Layer(False), Layer(True)]

    model = Model()
    before = sorted(k for k, _ in tree_flatten(model.parameters()))
    assert rope.install(model) == 2
    after = sorted(k for k, _ in tree_flatten(model.parameters()))
    assert before == after  # no parameters added or lost
    first, second, third = (layer.rope for layer in model.layers)
    assert isinstance(first, rope.TableRoPE) and isinstance(second, rope.TableRoPE)
    assert type(third) is nn.RoPE  # traditional: mlx-lm's
    x = mx.ones((1, 2, 5, 16))
    first(x, offset=3)
    second(x, offset=3)
    assert first._tables is second._tables
    ((span, _),) = first._tables._last.values()
    assert span == (3, 5) and len(first._tables._last) == 1  # one table for both layers
