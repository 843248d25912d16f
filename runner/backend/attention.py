"""Attention of a batch of suffixes over one shared prefix, without a copy of it per row.

Scoring rows that share a prefix runs their suffixes as one batch. Broadcasting the prefix
KV into an ordinary cache makes every layer write B copies of it and attend to them one row
at a time (measured on Qwen3-0.6B, CPU: 0.16 s per 16-token row of extra work over a
512-token prefix, against 0.13 s for the row's whole MLP and projections). `SharedPrefixKV`
keeps the prefix once ([1, Hkv, P, D]) and the suffixes per row; `attention` then scores
all rows' queries against the prefix in one matmul per KV head and combines that with the
causal attention over the suffix through a shared softmax maximum (the log-sum-exp split).

On MLX's CPU backend, plain causal attention (prefill chunks) is computed here too: the
backend's `exp` is scalar (~12.5 ns an element), so scores are kept in base 2 and turned
into softmax numerators in place by numpy (`cpu_ufuncs.exp2_softmax_inplace`: SIMD exp2, no
MLX copies), and query blocks of 128 skip the keys the causal mask would hide. Measured on
[1, 16, 512, 128] a layer: MLX exp 74 ms, MLX power(2, x) 46, + query blocks of 256 39,
numpy in place 20, blocks of 128 16.5 ms (L=1024: 66 -> 55 ms; 64 or 512 are slower).
Everywhere else (Metal, CUDA, masks given as arrays, quantized caches, decode steps)
mlx-lm's fused call runs unchanged.

`install()` points the attention call of the mlx-lm modules our families use at `attention`,
which handles `SharedPrefixKV` and CPU causal prefill, and hands the rest to mlx-lm.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import base, gemma3_text, llama, qwen3, qwen3_next
from mlx_lm.models.cache import ConcatenateKVCache, KVCache

from runner.models import cpu_ufuncs

_MLX_LM_ATTENTION = base.scaled_dot_product_attention
_MODULES = (llama, qwen3, gemma3_text, qwen3_next)
_LOG2E = math.log2(math.e)
CPU_MIN_QUERIES = 16  # below this (decode) the fused call's fewer ops win
CPU_QUERY_BLOCK = 128


class SharedPrefixKV(KVCache):
    """A full-attention cache for B rows: one shared prefix, then each row's own tokens.

    `offset` counts the prefix and the suffix tokens written so far (RoPE positions and
    masks see one sequence per row); `update_and_fetch` stores and returns suffix K/V only.
    """

    def __init__(self, keys: mx.array, values: mx.array, batch: int):
        super().__init__()
        self.prefix_keys, self.prefix_values = keys, values
        self.prefix_len = keys.shape[2]
        self.batch = batch
        # Suffixes are written once per batch; KVCache would zero-fill 256-token steps
        # for every row of every layer first.
        self.suffix = ConcatenateKVCache()
        self.offset = self.prefix_len

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = self.suffix.update_and_fetch(keys, values)
        self.offset = self.prefix_len + self.suffix.offset
        return k, v

    @property
    def state(self) -> tuple[Any, ...]:
        return self.suffix.state

    def segment(self, row: int, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Row `row`'s keys and values for absolute positions [start, end) past the prefix."""
        a, b = start - self.prefix_len, end - self.prefix_len
        assert a >= 0, "the shared prefix is not a row's own"
        return (
            self.suffix.keys[row : row + 1, :, a:b, :],
            self.suffix.values[row : row + 1, :, a:b, :],
        )


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    shared = isinstance(cache, SharedPrefixKV)
    plain = sinks is None and not isinstance(mask, mx.array) and not hasattr(cache, "bits")
    if shared and plain:
        return _shared_prefix(queries, keys, values, cache, scale)
    if shared:  # an explicit mask: attend to a full copy of the prefix
        keys, values = _materialise(cache, keys, values)
    elif plain and queries.shape[2] >= CPU_MIN_QUERIES and mx.default_device() == mx.cpu:
        return _cpu_causal(queries, keys, values, scale, causal=mask is not None)
    return _MLX_LM_ATTENTION(queries, keys, values, cache, scale, mask, sinks)


def _shared_prefix(
    queries: mx.array, keys: mx.array, values: mx.array, cache: SharedPrefixKV, scale: float
) -> mx.array:
    b, hq, n, d = queries.shape
    hkv, s, p = keys.shape[1], keys.shape[2], cache.prefix_len
    rep = hq // hkv
    dtype = queries.dtype
    # Scores in base 2 (scale * log2 e folded into q), so the softmax uses 2**x.
    q = (queries.astype(mx.float32) * (scale * _LOG2E)).reshape(b, hkv, rep, n, d)
    # Prefix: every query sees every prefix key; one [B*rep*n, D] x [D, P] matmul per KV head.
    qp = q.transpose(1, 0, 2, 3, 4).reshape(hkv, b * rep * n, d)
    kp = cache.prefix_keys[0].astype(mx.float32)
    vp = cache.prefix_values[0].astype(mx.float32)
    s1 = qp @ kp.swapaxes(-1, -2)  # [hkv, b*rep*n, p]
    # Suffix: causal, the n queries being the last n of the s suffix keys.
    s2 = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # [b, hkv, rep, n, s]
    v2 = values.astype(mx.float32)[:, :, None]
    if _softmax_in_numpy():
        # numpy turns both score blocks into softmax numerators in place (see cpu_ufuncs).
        h1, h2 = cpu_ufuncs.host_views(s1, s2)
        total = cpu_ufuncs.exp2_softmax_inplace(
            [h1.reshape(hkv, b, rep, n, p).transpose(1, 0, 2, 3, 4), h2],
            [None, _hidden_keys(n, s)],
        )
        e1, e2, total = s1, s2, mx.array(total)
    else:
        s1 = s1.reshape(hkv, b, rep, n, p).transpose(1, 0, 2, 3, 4)
        visible = mx.arange(s)[None, :] <= (s - n + mx.arange(n))[:, None]
        s2 = mx.where(visible, s2, -mx.inf)
        top = mx.maximum(s1.max(axis=-1, keepdims=True), s2.max(axis=-1, keepdims=True))
        e1, e2 = mx.power(2.0, s1 - top), mx.power(2.0, s2 - top)
        total = e1.sum(axis=-1, keepdims=True) + e2.sum(axis=-1, keepdims=True)
        e1 = e1.transpose(1, 0, 2, 3, 4).reshape(hkv, b * rep * n, p)
    o1 = (e1 @ vp).reshape(hkv, b, rep, n, d).transpose(1, 0, 2, 3, 4)
    o2 = e2 @ v2
    return ((o1 + o2) / total).reshape(b, hq, n, d).astype(dtype)


def _softmax_in_numpy() -> bool:
    """Whether softmax numerators are made by numpy in place (the CPU backend) rather than
    by MLX (Metal, CUDA); one place so tests can run the MLX branch on a CPU."""
    return mx.default_device() == mx.cpu


def _hidden_keys(n: int, s: int, start: int = 0, end: int | None = None) -> np.ndarray:
    """[end - start, s] True where query i (of the last n of s positions) may not see key j."""
    end = n if end is None else end
    rows = s - n + np.arange(start, end)
    return np.arange(s)[None, :] > rows[:, None]


def _cpu_causal(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, causal: bool
) -> mx.array:
    """Attention of n queries that are the last n of the s keys, in query blocks that only
    read the keys they may see; the softmax numerators are made in place by numpy."""
    b, hq, n, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    q = (queries.astype(mx.float32) * (scale * _LOG2E)).reshape(b, hkv, rep, n, d)
    k = keys.astype(mx.float32)[:, :, None]
    v = values.astype(mx.float32)[:, :, None]
    blocks = []
    for start in range(0, n, CPU_QUERY_BLOCK):
        end = min(n, start + CPU_QUERY_BLOCK)
        seen = s - n + end if causal else s  # the keys any query of this block may see
        scores = q[:, :, :, start:end] @ k[..., :seen, :].swapaxes(-1, -2)
        hidden = _hidden_keys(n, s, start, end)[:, :seen] if causal else None
        (host,) = cpu_ufuncs.host_views(scores)
        total = cpu_ufuncs.exp2_softmax_inplace([host], [hidden])
        blocks.append((scores @ v[..., :seen, :]) / mx.array(total))
    out = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=3)
    return out.reshape(b, hq, n, d).astype(queries.dtype)


def _materialise(cache: SharedPrefixKV, keys: mx.array, values: mx.array):
    def full(prefix: mx.array, suffix: mx.array) -> mx.array:
        shared = mx.broadcast_to(prefix, (cache.batch, *prefix.shape[1:]))
        return mx.concatenate([shared, suffix], axis=2)

    return full(cache.prefix_keys, keys), full(cache.prefix_values, values)


def install() -> None:
    """Route the families' attention through `attention` (idempotent)."""
    for module in _MODULES:
        module.scaled_dot_product_attention = attention


@contextlib.contextmanager
def stock_attention() -> Iterator[None]:
    """mlx-lm's own attention for the duration (benchmarks of plain mlx-lm use this)."""
    saved = [module.scaled_dot_product_attention for module in _MODULES]
    for module in _MODULES:
        module.scaled_dot_product_attention = _MLX_LM_ATTENTION
    try:
        yield
    finally:
        for module, function in zip(_MODULES, saved, strict=True):
            module.scaled_dot_product_attention = function
