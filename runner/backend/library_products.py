"""Products over GGML blocks, and over MLX's affine weights, on the CPU backend by the native
library, from MLX's graph.

A GGUF's K-quant and i-quant matrices stay in their blocks (runner/models/quantized.py's GGML
layers). The native decoder step reads them for the families it serves; everywhere else, and
for the stacked experts of a mixture of experts, MLX's formats hold them only at a cost: Q4_K
as 6 bits a weight (float32 scales), Q6_K and most other types as float32 (4.9x the file and
more). A Qwen3-30B-A3B Q4_K_M (18.6 GB, nearly all of it Q4_K and Q6_K experts) would take
~40 GB. `LibraryProducts` computes the GGML layers' products from the blocks instead, through
the library's product tiles and thread pool (`runner_weight_product`), never a dequantized
copy:
- `matmul`: a linear layer's (or a tied head's) x W^T;
- `gather`: a switch layer's, mlx-lm's `gather_mm` over stacked experts: the tokens routed to
  each chosen expert gathered into one product of as many rows.
`matmul_affine` and `gather_affine` do the same for layers of MLX's affine quantization
(mlx-lm's conversions: `QuantizedLinear`, a tied `QuantizedEmbedding`'s head, a mixture of
experts' `QuantizedSwitchLinear`) and of its mxfp4 mode (gpt-oss's experts: e2m1 codes, e8m0
scales, no biases; a GGUF's MXFP4) where no native step reads them: MLX's CPU
`quantized_matmul` and `gather_qmm` run at ~1-6 GFLOP/s, where the library's tiles read the
same codes at the float products' rate.

Invariants:
- The numbers are float32 sums of llama.cpp's dequantized values, or of MLX's (the library's
  products, runner/native/quantized.c): what MLX's product over the dequantized weights
  computes up to float32 rounding. A call of a single token (a decode step) takes the decode
  steps' integer limbs where the build has them (within ~1e-6 of sum |w x|), as the native
  decoder step does; every other call the float tiles.
- Leaving MLX's graph evaluates the call's input first (as runner/backend/gemv.py does): the
  product runs synchronously, and its result is a fresh MLX array.
- Experts no token is routed to are not read at all.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from runner.backend import Backend
from runner.backend.native_step import AFFINE_BITS, AFFINE_GROUPS, SCALE_DTYPES, raw_view
from runner.native import abi
from runner.sources.gguf import quants


class LibraryProducts:
    """Products over GGML blocks and MLX's affine weights through `functions` (a checked
    library's entry points: runner/native/abi.py)."""

    def __init__(self, functions: abi.Functions):
        self._product = functions.weight_product
        self._supported = functions.weight_supported
        # a data address for runner_weight_supported, which asks only that it be set
        self._probe = ctypes.c_uint8()
        self._probe_address = ctypes.addressof(self._probe)

    def reads(self, ggml_type: str, rows: int, columns: int) -> bool:
        """Whether the library's products read a matrix [rows, columns] of `ggml_type`."""
        form = abi.BLOCK_FORMATS.get(ggml_type)
        if form is None:
            return False
        weight = abi.Weight(format=form, data=self._probe_address)
        return bool(self._supported(ctypes.byref(weight), rows, columns))

    def matmul(self, x: mx.array, blocks: mx.array, ggml_type: str) -> mx.array:
        """`x @ W.T` for the matrix W whose blocks [n, bytes a row] are `blocks`: x [..., k];
        returns [..., n] in x's dtype."""
        mx.eval(x, blocks)
        n, k = self._shape(blocks, ggml_type)
        if x.shape[-1] != k:
            raise ValueError(f"a matrix of {k} columns, input of {x.shape[-1]}")
        a = np.ascontiguousarray(self._host(x).reshape(-1, k))
        form, data = abi.BLOCK_FORMATS[ggml_type], self._view(blocks).ctypes.data
        out = self._product_rows(a, abi.Weight(format=form, data=data), n, a.shape[0] == 1)
        return self._result(out.reshape(*x.shape[:-1], n), x.dtype)

    def gather(self, x: mx.array, indices: mx.array, blocks: mx.array, ggml_type: str) -> mx.array:
        """`mx.gather_mm(x, W.swapaxes(-1, -2), rhs_indices=indices)` for the experts W whose
        blocks [experts, n, bytes a row] are `blocks`: x [..., m, k] and indices [...] broadcast
        to the batch; returns [batch..., m, n] in x's dtype."""
        n, k = self._shape(blocks, ggml_type)
        view, form = self._view(blocks), abi.BLOCK_FORMATS[ggml_type]
        return self._gather(
            x, indices, int(blocks.shape[0]), n, k,
            lambda e: abi.Weight(format=form, data=view[e].ctypes.data),
        )  # fmt: skip

    def reads_affine(self, layer: Any) -> bool:
        """Whether the library's products read the weight of `layer`, an `nn.QuantizedLinear`
        / `QuantizedEmbedding` [n, k] or an mlx-lm `QuantizedSwitchLinear` [experts, n, k]:
        MLX's affine mode, 2, 3, 4, 5, 6 or 8 bits, groups of 32, 64 or 128, scales and biases
        of one dtype (float32, float16, bfloat16); or its mxfp4 mode (4-bit e2m1 codes, a uint8
        e8m0 scale a group of 32, no biases: gpt-oss's experts, a GGUF's MXFP4); no global
        scale."""
        mode, bits, group = layer.mode, int(layer.bits), int(layer.group_size)
        codes, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
        if layer.get("global_scale") is not None:
            return False
        if codes.dtype != mx.uint32 or codes.ndim not in (2, 3):
            return False
        n, k = int(codes.shape[-2]), int(codes.shape[-1]) * 32 // bits
        if mode == "mxfp4":
            form_ok = bits == 4 and group == 32 and biases is None and scales.dtype == mx.uint8
        else:
            form_ok = (
                mode == "affine" and bits in AFFINE_BITS and group in AFFINE_GROUPS
                and biases is not None and scales.dtype in SCALE_DTYPES
                and biases.dtype == scales.dtype and biases.shape == scales.shape
            )  # fmt: skip
        if not form_ok or scales.shape != (*codes.shape[:-1], k // group):
            return False
        probe = self._probe_address
        weight = self._affine(layer, probe, probe, 0 if biases is None else probe)
        return bool(self._supported(ctypes.byref(weight), n, k))

    def matmul_affine(self, x: mx.array, layer: Any) -> mx.array:
        """`x @ W.T` for the affine weight W [n, k] of a `layer` that `reads_affine` (MLX's
        `quantized_matmul` of its codes, scales and biases: their float32 values), without
        its bias: [..., n] in x's dtype."""
        codes, scales, biases = self._affine_views(layer)
        n, k = int(codes.shape[0]), int(codes.shape[1]) * 32 // int(layer.bits)
        mx.eval(x)
        if x.shape[-1] != k:
            raise ValueError(f"a matrix of {k} columns, input of {x.shape[-1]}")
        a = np.ascontiguousarray(self._host(x).reshape(-1, k))
        weight = self._affine(layer, codes.ctypes.data, scales.ctypes.data, _address(biases))
        out = self._product_rows(a, weight, n, a.shape[0] == 1)
        return self._result(out.reshape(*x.shape[:-1], n), x.dtype)

    def gather_affine(self, x: mx.array, indices: mx.array, layer: Any) -> mx.array:
        """`gather` for a `QuantizedSwitchLinear` `layer` that `reads_affine`: MLX's
        `gather_qmm` of its codes, scales and biases (their float32 values)."""
        codes, scales, biases = self._affine_views(layer)
        n, k = int(codes.shape[1]), int(codes.shape[2]) * 32 // int(layer.bits)
        return self._gather(
            x, indices, int(codes.shape[0]), n, k,
            lambda e: self._affine(
                layer, codes[e].ctypes.data, scales[e].ctypes.data,
                0 if biases is None else biases[e].ctypes.data,
            ),
        )  # fmt: skip

    @staticmethod
    def _affine_views(layer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """numpy's views of an affine layer's codes, scales and biases (bfloat16 as uint16;
        mxfp4: no biases)."""
        codes, scales = raw_view(layer["weight"], "weight"), raw_view(layer["scales"], "scales")
        biases = layer.get("biases")
        return codes, scales, None if biases is None else raw_view(biases, "biases")

    def _gather(
        self,
        x: mx.array,
        indices: mx.array,
        experts: int,
        n: int,
        k: int,
        weight_of: Callable[[int], abi.Weight],
    ) -> mx.array:
        """The gathered products of x [..., m, k] with the experts [n, k] `indices` [...]
        choose, expert e's weight being `weight_of(e)`."""
        mx.eval(x, indices)
        m = int(x.shape[-2])
        if x.shape[-1] != k:
            raise ValueError(f"experts of {k} columns, input of {x.shape[-1]}")
        batch = tuple(np.broadcast_shapes(tuple(x.shape[:-2]), tuple(indices.shape)))
        a = np.broadcast_to(self._host(x), (*batch, m, k)).reshape(-1, m, k)
        chosen = np.broadcast_to(np.asarray(indices), batch).reshape(-1).astype(np.int64)
        if chosen.size and (chosen.min() < 0 or chosen.max() >= experts):
            raise ValueError(f"an expert index outside [0, {experts})")
        out = np.empty((chosen.size, m, n), np.float32)
        # a decode step: one token (its rows routed to distinct experts)
        decode = math.prod(indices.shape[:-1]) == 1 and m == 1
        order = np.argsort(chosen, kind="stable")
        starts = np.flatnonzero(np.diff(chosen[order], prepend=-1))
        stops = [*starts[1:], order.size] if order.size else []
        for start, stop in zip(starts, stops, strict=True):
            take = order[start:stop]
            rows = np.ascontiguousarray(a[take].reshape(-1, k))
            c = self._product_rows(rows, weight_of(int(chosen[take[0]])), n, decode)
            out[take] = c.reshape(-1, m, n)
        return self._result(out.reshape(*batch, m, n), x.dtype)

    @staticmethod
    def _affine(layer: Any, codes: int, scales: int, biases: int) -> abi.Weight:
        """The struct step_weight of one of `layer`'s affine experts at these addresses
        (`biases` 0: none, mxfp4's)."""
        if layer.mode == "mxfp4":
            scale_format = abi.E8M0
        else:
            scale_format = abi.SCALE_FORMATS[SCALE_DTYPES[layer["scales"].dtype]]
        return abi.Weight(
            format=abi.AFFINE, bits=int(layer.bits), group=int(layer.group_size),
            scale_format=scale_format, data=codes, scales=scales, biases=biases,
        )  # fmt: skip

    def _product_rows(self, a: np.ndarray, weight: abi.Weight, n: int, decode: bool) -> np.ndarray:
        """a [rows, k] (contiguous float32) times the matrix [n, k] of `weight`."""
        c = np.empty((a.shape[0], n), np.float32)
        if a.shape[0] == 0:  # (as MLX's products: an empty input, an empty result)
            return c
        code = self._product(
            a.shape[0], n, a.shape[1], _pointer(a), ctypes.byref(weight), _pointer(c), int(decode)
        )
        if code != 0:
            raise RuntimeError(f"the native library refused a product of format {weight.format}")
        return c

    @staticmethod
    def _shape(blocks: mx.array, ggml_type: str) -> tuple[int, int]:
        """(n, k) of each matrix of `blocks` [..., n, bytes a row]."""
        info = quants.BY_NAME[ggml_type]
        return int(blocks.shape[-2]), int(blocks.shape[-1]) // info.type_size * info.block_size

    @staticmethod
    def _host(x: mx.array) -> np.ndarray:
        return np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))

    @staticmethod
    def _view(blocks: mx.array) -> np.ndarray:
        view = np.asarray(blocks)
        if not view.flags.c_contiguous:
            raise ValueError("GGML blocks that are not contiguous")
        return view

    @staticmethod
    def _result(out: np.ndarray, dtype: mx.Dtype) -> mx.array:
        y = mx.array(out)
        return y if dtype == mx.float32 else y.astype(dtype)


def for_backend(backend: Backend) -> LibraryProducts | None:
    """The products for `backend`: where it runs the native library's paths (the CPU
    backend's `native_step_max_tokens`) and the library preloaded into this process is the
    runner's; else None (GGML blocks are then made MLX's formats, or read by a native step)."""
    if backend.native_step_max_tokens is None:
        return None
    functions = abi.load()
    return None if functions is None else LibraryProducts(functions)


def _address(view: np.ndarray | None) -> int:
    return 0 if view is None else view.ctypes.data


def _pointer(view: np.ndarray) -> Any:
    return view.ctypes.data_as(abi.F32)
