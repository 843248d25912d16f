"""The attention call the runner installs on the attention layers of the models it loads.

mlx-lm's attention layers end in one call, `scaled_dot_product_attention(queries, keys,
values, cache, scale, mask, sinks)`. `Attention(backend)` is a drop-in for it, installed on
our instances only (runner/backend/install.py), with two additions:

1. Rows batched over one shared prefix (`SharedPrefixKV`, runner/cache/shared_prefix.py): the cache
   hands the layer only the rows' own suffix K/V, and this call attends to the prefix too.
   Broadcasting the prefix KV into an ordinary cache would make every layer write B copies
   of it and attend to them one row at a time (measured on Qwen3-0.6B, CPU: 0.16 s per
   16-token row of extra work over a 512-token prefix, against 0.13 s for the row's whole MLP
   and projections). Here all rows' queries score the prefix in one matmul per KV head, and
   that is combined with the causal attention over the suffix through a shared softmax
   maximum (the log-sum-exp split). This is a correctness dependency: run through mlx-lm's own
   call, such a batch attends to its suffixes alone, which is why loading checks that the
   call is in place (runner/models/build.py: `verify_batched_rows`).
2. Where the backend asks for it (the CPU, decode steps included): causal attention in query
   blocks that only read the keys each block may see, each KV head's query heads stacked into
   one product (one BLAS call per KV head, not per query head), with the softmax numerators
   made in place by numpy (`host.softmax_numerators_inplace`: SIMD exp, no MLX copies) for
   blocks large enough to pay for leaving MLX's graph, else by MLX's power(2, x) on scores
   kept in base 2. MLX's CPU exp is scalar: measured 27 ns an element on the 2-core AVX2 CI
   machine (power(2, x) 11 ns, numpy exp 2.5 ns); on [1, 16, 512, 128] a layer (AVX-512
   machine): MLX exp 74 ms, power(2, x) 46, + query blocks of 256 39, numpy in place 20,
   blocks of 128 16.5 ms (L=1024: 66 -> 55 ms; 64 or 512 are slower).

Everything else (masks given as arrays, quantized caches, attention sinks, every plain call
on Metal and CUDA) goes to mlx-lm's own call unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as mlx_lm_base

from runner.backend import Backend, host
from runner.cache.shared_prefix import SharedPrefixKV

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
        on_host = self.backend.host_softmax(b * hq * n * (p + s))
        q = _scaled(queries, scale, on_host).reshape(b, hkv, rep, n, d)
        # Prefix: every query sees every prefix key; one [B*rep*n, D] x [D, P] matmul per
        # KV head.
        qp = q.transpose(1, 0, 2, 3, 4).reshape(hkv, b * rep * n, d)
        kp = cache.prefix_keys[0].astype(mx.float32)
        vp = cache.prefix_values[0].astype(mx.float32)
        s1 = qp @ kp.swapaxes(-1, -2)  # [hkv, b*rep*n, p]
        # Suffix: causal, the n queries being the last n of the s suffix keys; each KV head's
        # rep query heads stacked into one product.
        qs = q.reshape(b, hkv, rep * n, d)
        s2 = qs @ keys.astype(mx.float32).swapaxes(-1, -2)  # [b, hkv, rep*n, s]
        if on_host:
            # numpy turns both score blocks into softmax numerators in place.
            h1, h2 = host.host_views(s1, s2)
            total = host.softmax_numerators_inplace(
                [
                    h1.reshape(hkv, b, rep, n, p).transpose(1, 0, 2, 3, 4),
                    h2.reshape(b, hkv, rep, n, s),
                ],
                [None, _hidden_keys(n, s)],
            )
            e1, e2, denominator = s1, s2, mx.array(total)
        else:
            s1 = s1.reshape(hkv, b, rep, n, p).transpose(1, 0, 2, 3, 4)
            visible = mx.arange(s)[None, :] <= (s - n + mx.arange(n))[:, None]
            s2 = mx.where(visible, s2.reshape(b, hkv, rep, n, s), -mx.inf)
            top = mx.maximum(s1.max(axis=-1, keepdims=True), s2.max(axis=-1, keepdims=True))
            e1, e2 = mx.power(2.0, s1 - top), mx.power(2.0, s2 - top)
            denominator = e1.sum(axis=-1, keepdims=True) + e2.sum(axis=-1, keepdims=True)
            e1 = e1.transpose(1, 0, 2, 3, 4).reshape(hkv, b * rep * n, p)
            e2 = e2.reshape(b, hkv, rep * n, s)
        o1 = (e1 @ vp).reshape(hkv, b, rep, n, d).transpose(1, 0, 2, 3, 4)
        o2 = (e2 @ values.astype(mx.float32)).reshape(b, hkv, rep, n, d)
        return ((o1 + o2) / denominator).reshape(b, hq, n, d).astype(dtype)

    def _blocked_causal(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, causal: bool
    ) -> mx.array:
        """Attention of n queries that are the last n of the s keys, in query blocks that only
        read the keys they may see; each KV head's rep query heads stacked into one product."""
        b, hq, n, d = queries.shape
        hkv, s = keys.shape[1], keys.shape[2]
        rep = hq // hkv
        k = keys.astype(mx.float32).swapaxes(-1, -2)  # [b, hkv, d, s]
        v = values.astype(mx.float32)
        step = self.backend.causal_query_block
        blocks = []
        for start in range(0, n, step):
            end = min(n, start + step)
            m = end - start
            seen = s - n + end if causal else s  # the keys any query of this block may see
            on_host = self.backend.host_softmax(b * hq * m * seen)
            q = _scaled(queries[:, :, start:end], scale, on_host).reshape(b, hkv, rep * m, d)
            scores = q @ k[..., :seen]  # [b, hkv, rep*m, seen]
            if on_host:
                hidden = _hidden_keys(n, s, start, end)[:, :seen] if causal else None
                (view,) = host.host_views(scores)
                per_head = view.reshape(b, hkv, rep, m, seen)
                total = host.softmax_numerators_inplace([per_head], [hidden])
                weights, denominator = scores, mx.array(total.reshape(b, hkv, rep * m, 1))
            else:
                if causal:
                    last = mx.tile(s - n + mx.arange(start, end), rep)  # each row's last key
                    scores = mx.where(mx.arange(seen)[None, :] <= last[:, None], scores, -mx.inf)
                weights = mx.power(2.0, scores - scores.max(axis=-1, keepdims=True))
                denominator = weights.sum(axis=-1, keepdims=True)
            out = (weights @ v[..., :seen, :]) / denominator  # [b, hkv, rep*m, d]
            blocks.append(out.reshape(b, hkv, rep, m, d))
        out = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=3)
        return out.reshape(b, hq, n, d).astype(queries.dtype)


def _scaled(queries: mx.array, scale: float, natural: bool) -> mx.array:
    """Queries in float32 with the softmax scale folded in: for numpy's exp (natural), or in
    base 2 for MLX's power(2, x), which is 2.5x faster than its scalar exp on a CPU."""
    return queries.astype(mx.float32) * (scale if natural else scale * _LOG2E)


def _hidden_keys(n: int, s: int, start: int = 0, end: int | None = None) -> np.ndarray:
    """[end - start, s] True where query i (of the last n of s positions) may not see key j."""
    end = n if end is None else end
    rows = s - n + np.arange(start, end)
    return np.arange(s)[None, :] > rows[:, None]
