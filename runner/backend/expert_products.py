"""Routed experts' products over GGML blocks on the CPU backend, by the native library.

A mixture-of-experts GGUF (Qwen3-MoE's Q4_K_M: Q4_K gate and up experts, Q6_K down experts in
half the layers) holds nearly all its bytes in its experts' matrices, [experts, out, in] of
GGML blocks. MLX's formats hold Q4_K only as 6 bits a weight (float32 scales) and Q6_K only as
float32 (4.9x the file); a Qwen3-30B-A3B's experts would take ~100 GB. The runner keeps them
in their blocks (runner/models/quantized.py's `GGMLSwitchLinear`) where the library can read
them, and `BlockExperts` computes a switch layer's products there: the tokens routed to each
chosen expert are gathered into one product of as many rows (`runner_weight_product`, the
library's block tiles and thread pool), never a dequantized copy.

Invariants:
- The numbers are float32 sums of llama.cpp's dequantized values (the library's products;
  runner/native/quantized.c), what `mx.gather_mm` over the dequantized experts computes up
  to float32 rounding. A call whose tokens are a single token (a decode step) takes the
  decode steps' integer limbs where the build has them (within ~1e-6 of sum |w x|), as the
  native decoder step does; every other call the float tiles.
- Leaving MLX's graph evaluates the call's input first (as runner/backend/gemv.py does): the
  product itself runs synchronously, and its result is a fresh MLX array.
- Experts no token is routed to are not read at all.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import mlx.core as mx
import numpy as np

from runner.backend import Backend
from runner.native import abi
from runner.sources.gguf import quants


def _pointer(view: np.ndarray) -> Any:
    return view.ctypes.data_as(abi.F32)


class BlockExperts:
    """A switch layer's products over its experts' GGML blocks through `functions` (a checked
    library's entry points: runner/native/abi.py)."""

    def __init__(self, functions: abi.Functions):
        self._product = functions.weight_product
        self._supported = functions.weight_supported
        self._probe = ctypes.c_uint8()

    def reads(self, ggml_type: str, rows: int, columns: int) -> bool:
        """Whether the library's products read an expert [rows, columns] of `ggml_type`."""
        form = abi.BLOCK_FORMATS.get(ggml_type)
        if form is None:
            return False
        # the library asks for the data's address only to be set
        weight = abi.Weight(format=form, data=ctypes.addressof(self._probe))
        return bool(self._supported(ctypes.byref(weight), rows, columns))

    def __call__(
        self, x: mx.array, indices: mx.array, blocks: mx.array, ggml_type: str
    ) -> mx.array:
        """`mx.gather_mm(x, W.swapaxes(-1, -2), rhs_indices=indices)` for the experts W whose
        blocks [experts, n, bytes a row] are `blocks`: x [..., m, k] and indices [...] broadcast
        to the batch; returns [batch..., m, n] in x's dtype."""
        mx.eval(x, indices, blocks)
        info = quants.BY_NAME[ggml_type]
        experts, n, width = (int(d) for d in blocks.shape)
        k = width // info.type_size * info.block_size
        m = int(x.shape[-2])
        if x.shape[-1] != k:
            raise ValueError(f"experts of {k} columns, input of {x.shape[-1]}")
        batch = tuple(np.broadcast_shapes(tuple(x.shape[:-2]), tuple(indices.shape)))
        a = np.asarray(x.astype(mx.float32) if x.dtype != mx.float32 else x)
        a = np.broadcast_to(a, (*batch, m, k)).reshape(-1, m, k)
        chosen = np.broadcast_to(np.asarray(indices), batch).reshape(-1).astype(np.int64)
        if chosen.size and (chosen.min() < 0 or chosen.max() >= experts):
            raise ValueError(f"an expert index outside [0, {experts})")
        view = np.asarray(blocks)
        if not view.flags.c_contiguous:
            raise ValueError("expert blocks that are not contiguous")
        out = np.empty((chosen.size, m, n), np.float32)
        # a decode step: one token (its rows routed to distinct experts), as the native
        # decoder step's `decode`
        decode = int(math.prod(indices.shape[:-1]) == 1 and m == 1)
        order = np.argsort(chosen, kind="stable")
        starts = np.flatnonzero(np.diff(chosen[order], prepend=-1))
        for start, stop in zip(starts, [*starts[1:], order.size], strict=True):
            take = order[start:stop]
            rows = np.ascontiguousarray(a[take].reshape(-1, k))
            c = np.empty((rows.shape[0], n), np.float32)
            weight = abi.Weight(
                format=abi.BLOCK_FORMATS[ggml_type], data=view[chosen[take[0]]].ctypes.data
            )
            code = self._product(
                rows.shape[0], n, k, _pointer(rows), ctypes.byref(weight), _pointer(c), decode
            )
            if code != 0:
                raise RuntimeError(f"the native library refused a {ggml_type} expert product")
            out[take] = c.reshape(-1, m, n)
        y = mx.array(out.reshape(*batch, m, n))
        return y if x.dtype == mx.float32 else y.astype(x.dtype)


def for_backend(backend: Backend) -> BlockExperts | None:
    """The products for `backend`: where it runs the native library's paths (the CPU
    backend's `native_step_max_tokens`) and the library preloaded into this process is the
    runner's; else None (experts' blocks are then converted to MLX's formats)."""
    if backend.native_step_max_tokens is None:
        return None
    functions = abi.load()
    return None if functions is None else BlockExperts(functions)
