"""The backend layer: every decision that depends on which MLX backend runs, made in one place.

MLX runs on Metal (Apple Silicon), CUDA, or its CPU backend. On Metal and CUDA the runner
uses MLX as it is. On the CPU backend several of MLX's paths are slow in ways that are
measured (docs/DESIGN.md §4 has the figures), and the runner computes them another way:

- float32 compute: bfloat16/float16 matmuls have no fast CPU kernel (5.6 vs 200 GFLOP/s);
- attention softmax numerators and gated-MLP activations through numpy's SIMD ufuncs
  (MLX's CPU exp/sigmoid/tanh are scalar), for blocks large enough to pay for leaving MLX's
  lazy graph (`backend.host`);
- causal attention in query blocks that skip the keys the mask hides (`backend.attention`);
- one-row products (decode) through a gemv: the runner's sgemm dispatch under MLX
  (runner/native/preload.py) where it could be built, else numpy's gemv (`backend.gemv`);
- narrower batches of scoring rows (wide ones fall out of the CPU's caches);
- short forwards of Llama-shaped models in one native call (`backend.native_step`), reading
  exact half-precision copies of a half-precision checkpoint's weights.

A `Backend` is a frozen value: the policy for one backend, with every threshold. The runner
builds one at load (`Backend.for_device`) and installs the kernels it asks for on the model
instances it loads (`backend.install`); nothing is rebound in mlx-lm's modules, so a program
that imports `runner` and uses mlx-lm itself gets stock mlx-lm. Tests build other policies
(every block through numpy, the GPU softmax on a CPU) by replacing fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx

from runner.native import preload


@dataclass(frozen=True)
class Backend:
    """The policy for one MLX backend.

    Thresholds count elements (or query rows) of the block an op works on; `None` means
    never. Every field is read by exactly one kernel or caller, named in its comment.
    """

    name: str
    # float32 on the CPU (as stored elsewhere); service.Runner.load casts weights to it.
    compute_dtype: mx.Dtype | None
    # backend.attention: score blocks of at least this many elements get their softmax
    # numerators from numpy in place; smaller ones (and every block when None) from MLX.
    host_softmax_min_elements: int | None
    # backend.attention: causal attention of at least this many queries runs in query blocks
    # of `causal_query_block`; fewer queries (and every call when None) use MLX's fused call.
    blocked_causal_min_queries: int | None
    causal_query_block: int
    # backend.host: SwiGLU / GELU-GLU blocks of at least this many elements run in numpy.
    host_activation_min_elements: int | None
    # backend.rope: plain rotary embeddings from one cos/sin table a forward (MLX's CPU
    # fallback of fast.rope recomputes it in ~30 operations per call).
    table_rope: bool
    # backend.gemv: one-row float32 products (decode steps) through numpy's gemv; only
    # where the runner's sgemm dispatch is not under MLX (it does the same inside MLX's graph,
    # without a synchronisation per product).
    gemv: bool
    # backend.native_step: forwards of at most this many tokens (decode steps, short
    # prompts) of Llama-shaped models run their decoder layers in one native call; None:
    # never (no dispatch library, or not the CPU).
    native_step_max_tokens: int | None
    # backend.native_step: the half-precision formats tried, in order, for exact copies of
    # the float32 weights (a checkpoint stored in float16 or bfloat16), which the step's
    # products of up to 128 rows and a decode step's head read instead (as panels): half
    # the bytes, at half again the weights' memory. Empty: float32 only.
    native_half_formats: tuple[str, ...]
    # cache.session: suffix tokens per batched scoring forward.
    batch_tokens: int
    # cache.session: prompt tokens per prefill forward, and so the work between two checks
    # for cancellation (a forward cannot be interrupted).
    prefill_chunk_tokens: int

    @classmethod
    def cpu(cls) -> Backend:
        return cls(
            name="cpu",
            compute_dtype=mx.float32,
            # Leaving MLX's graph costs a synchronisation (~0.1-0.2 ms); MLX's scalar exp costs
            # 11-27 ns an element, numpy's 0.5-2.5: numpy pays from a few thousand elements.
            host_softmax_min_elements=8192,
            blocked_causal_min_queries=16,  # below this (decode) the fused call's fewer ops win
            causal_query_block=128,  # L=1024: 64 or 512 are slower (docs/DESIGN.md §4)
            # A 20-token forward's SwiGLU ([20, 1536] on SmolLM2) took 0.83 ms a layer in MLX.
            host_activation_min_elements=8192,
            table_rope=True,
            gemv=not preload.dispatch_active(),
            # After 480 cached tokens, native against MLX (bench/native_step.py), SmolLM2: 1
            # token 38/54 ms, 16: 68/87, 64: 178/251, 128: 364/455, 512 (a prompt chunk, its
            # products in OpenBLAS): 1590/2138; Qwen3-0.6B shape: 1: 157/199, 128: 1535/1942.
            native_step_max_tokens=512 if preload.dispatch_active() else None,
            # SmolLM2 (a float16 checkpoint), decode steps after 512 tokens in process: 30-41
            # tok/s against 20-22 from the float32 weights, the same minutes.
            native_half_formats=("float16", "bfloat16"),
            # 64 rows x 16 tokens over a 512-token prefix: 6.5 s in batches of 256 suffix
            # tokens, 5.9 s in batches of 512 (Qwen3-0.6B shape).
            batch_tokens=512,
            # A 2048-token chunk of Qwen3-0.6B is ~12 s of CPU work before a cancellation is
            # seen; 512 costs one more read of the weights every 512 tokens (~3%).
            prefill_chunk_tokens=512,
        )

    @classmethod
    def gpu(cls) -> Backend:
        return cls(
            name="gpu",
            compute_dtype=None,
            host_softmax_min_elements=None,
            blocked_causal_min_queries=None,
            causal_query_block=128,
            host_activation_min_elements=None,
            table_rope=False,  # Metal and CUDA have a fast.rope kernel
            gemv=False,
            native_step_max_tokens=None,
            native_half_formats=(),
            batch_tokens=8192,  # GPUs want wide batches
            prefill_chunk_tokens=2048,
        )

    @classmethod
    def for_device(cls, device: mx.Device | None = None) -> Backend:
        """The policy for `device` (default: MLX's default device)."""
        device = mx.default_device() if device is None else device
        return cls.cpu() if device == mx.cpu else cls.gpu()

    def replace(self, **changes: object) -> Backend:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def on_host(self) -> bool:
        """Whether any kernel here leaves MLX for numpy (the CPU backend's policies)."""
        return (
            self.host_softmax_min_elements is not None
            or self.host_activation_min_elements is not None
            or self.gemv
        )

    def host_softmax(self, elements: int) -> bool:
        limit = self.host_softmax_min_elements
        return limit is not None and elements >= limit

    def host_activation(self, elements: int) -> bool:
        limit = self.host_activation_min_elements
        return limit is not None and elements >= limit

    def blocked_causal(self, queries: int) -> bool:
        limit = self.blocked_causal_min_queries
        return limit is not None and queries >= limit
