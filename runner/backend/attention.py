"""The attention call the runner installs on the attention layers of the models it loads.

mlx-lm's attention layers end in one call, `scaled_dot_product_attention(queries, keys,
values, cache, scale, mask, sinks)`. `Attention(backend)` is a drop-in for it, installed on
our instances only (runner/backend/install.py), with two additions:

1. Rows batched over one shared prefix (`SharedPrefixKV`, runner/cache/batch.py): the cache
   hands the layer only the rows' own suffix K/V, and this call attends to the prefix too.
   Broadcasting the prefix KV into an ordinary cache would make every layer write B copies
   of it and attend to them one row at a time (measured on Qwen3-0.6B, CPU: 0.16 s per
   16-token row of extra work over a 512-token prefix, against 0.13 s for the row's whole MLP
   and projections). Here all rows' queries score the prefix in one matmul per KV head, and
   that is combined with the causal attention over the suffix through a shared softmax
   maximum (the log-sum-exp split). This is a correctness dependency: run through mlx-lm's own
   call, such a batch attends to its suffixes alone, which is why loading checks that the
   call is in place (runner/cache/batch.py: `verify_batched_rows`).
2. Where the backend asks for it (the CPU): causal attention in query blocks that only read
   the keys each block may see, with scores kept in base 2 and the softmax numerators made in
   place by numpy (`host.exp2_softmax_inplace`: SIMD exp2, no MLX copies), because MLX's CPU
   exp is scalar (~12.5 ns an element). Measured on [1, 16, 512, 128] a layer: MLX exp 74 ms,
   MLX power(2, x) 46, + query blocks of 256 39, numpy in place 20, blocks of 128 16.5 ms
   (L=1024: 66 -> 55 ms; 64 or 512 are slower).

Everything else (masks given as arrays, quantized caches, attention sinks, decode steps on
the CPU, every plain call on Metal and CUDA) goes to mlx-lm's own call unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as mlx_lm_base

from runner.backend import Backend, host
from runner.cache.batch import SharedPrefixKV

_LOG2E = math.log2(math.e)


class Attention:
    """`scaled_dot_product_attention` with the runner's batched-prefix and CPU paths."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def __call__(
        self,
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
            return self._shared_prefix(queries, keys, values, cache, scale)
        if shared:  # an explicit mask: attend to a full copy of the prefix
            keys, values = cache.materialise(keys, values)
        elif plain and self.backend.blocked_causal(queries.shape[2]):
            return self._blocked_causal(queries, keys, values, scale, causal=mask is not None)
        return mlx_lm_base.scaled_dot_product_attention(
            queries, keys, values, cache, scale, mask, sinks
        )

    def _shared_prefix(
        self, queries: mx.array, keys: mx.array, values: mx.array, cache: SharedPrefixKV, scale
    ) -> mx.array:
        b, hq, n, d = queries.shape
        hkv, s, p = keys.shape[1], keys.shape[2], cache.prefix_len
        rep = hq // hkv
        dtype = queries.dtype
        # Scores in base 2 (scale * log2 e folded into q), so the softmax uses 2**x.
        q = (queries.astype(mx.float32) * (scale * _LOG2E)).reshape(b, hkv, rep, n, d)
        # Prefix: every query sees every prefix key; one [B*rep*n, D] x [D, P] matmul per
        # KV head.
        qp = q.transpose(1, 0, 2, 3, 4).reshape(hkv, b * rep * n, d)
        kp = cache.prefix_keys[0].astype(mx.float32)
        vp = cache.prefix_values[0].astype(mx.float32)
        s1 = qp @ kp.swapaxes(-1, -2)  # [hkv, b*rep*n, p]
        # Suffix: causal, the n queries being the last n of the s suffix keys.
        s2 = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # [b, hkv, rep, n, s]
        v2 = values.astype(mx.float32)[:, :, None]
        if self.backend.host_softmax(s1.size + s2.size):
            # numpy turns both score blocks into softmax numerators in place.
            h1, h2 = host.host_views(s1, s2)
            total = host.exp2_softmax_inplace(
                [h1.reshape(hkv, b, rep, n, p).transpose(1, 0, 2, 3, 4), h2],
                [None, _hidden_keys(n, s)],
            )
            e1, e2, denominator = s1, s2, mx.array(total)
        else:
            s1 = s1.reshape(hkv, b, rep, n, p).transpose(1, 0, 2, 3, 4)
            visible = mx.arange(s)[None, :] <= (s - n + mx.arange(n))[:, None]
            s2 = mx.where(visible, s2, -mx.inf)
            top = mx.maximum(s1.max(axis=-1, keepdims=True), s2.max(axis=-1, keepdims=True))
            e1, e2 = mx.power(2.0, s1 - top), mx.power(2.0, s2 - top)
            denominator = e1.sum(axis=-1, keepdims=True) + e2.sum(axis=-1, keepdims=True)
            e1 = e1.transpose(1, 0, 2, 3, 4).reshape(hkv, b * rep * n, p)
        o1 = (e1 @ vp).reshape(hkv, b, rep, n, d).transpose(1, 0, 2, 3, 4)
        o2 = e2 @ v2
        return ((o1 + o2) / denominator).reshape(b, hq, n, d).astype(dtype)

    def _blocked_causal(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, causal: bool
    ) -> mx.array:
        """Attention of n queries that are the last n of the s keys, in query blocks that only
        read the keys they may see."""
        b, hq, n, d = queries.shape
        hkv, s = keys.shape[1], keys.shape[2]
        rep = hq // hkv
        q = (queries.astype(mx.float32) * (scale * _LOG2E)).reshape(b, hkv, rep, n, d)
        k = keys.astype(mx.float32)[:, :, None]
        v = values.astype(mx.float32)[:, :, None]
        step = self.backend.causal_query_block
        blocks = []
        for start in range(0, n, step):
            end = min(n, start + step)
            seen = s - n + end if causal else s  # the keys any query of this block may see
            scores = q[:, :, :, start:end] @ k[..., :seen, :].swapaxes(-1, -2)
            if self.backend.host_softmax(scores.size):
                hidden = _hidden_keys(n, s, start, end)[:, :seen] if causal else None
                (view,) = host.host_views(scores)
                total = host.exp2_softmax_inplace([view], [hidden])
                weights, denominator = scores, mx.array(total)
            else:
                if causal:
                    rows = s - n + mx.arange(start, end)
                    scores = mx.where(mx.arange(seen)[None, :] <= rows[:, None], scores, -mx.inf)
                weights = mx.power(2.0, scores - scores.max(axis=-1, keepdims=True))
                denominator = weights.sum(axis=-1, keepdims=True)
            blocks.append((weights @ v[..., :seen, :]) / denominator)
        out = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=3)
        return out.reshape(b, hq, n, d).astype(queries.dtype)


def _hidden_keys(n: int, s: int, start: int = 0, end: int | None = None) -> np.ndarray:
    """[end - start, s] True where query i (of the last n of s positions) may not see key j."""
    end = n if end is None else end
    rows = s - n + np.arange(start, end)
    return np.arange(s)[None, :] > rows[:, None]
