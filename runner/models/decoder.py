"""`DecoderModel`: the adapter every family here extends, and the pieces families share.

A decoder-only mlx-lm `Model` has `.model` (embeddings, layers, final norm) and a head,
`lm_head` or the tied `embed_tokens`. `DecoderModel` implements the required `Model`
contract and `CandidateUnembedder` (runner/models/base.py) over it: `hidden` is the inner
model's output, `unembed` the head with the family's `postprocess`, and
`unembed_candidates` gathers only the requested rows of the head (dequantizing only those).
Among the shared pieces, `splice_features` writes an image family's features over its image
tokens' embeddings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU

from runner.backend import Backend, gemv, native_step
from runner.backend.install import Kernels
from runner.models.config import SLIDING
from runner.models.quantized import (
    BLOCKS,
    GLOBAL_SCALE,
    GGMLEmbedding,
    GGMLLinear,
    float32_affine,
)


def gather_rows(layer: nn.Module, ids: mx.array) -> mx.array:
    """Rows `ids` of a Linear/Embedding weight as float32, dequantizing only those rows (and
    multiplying them by their global scale, runner/models/quantized.py)."""
    if isinstance(layer, (GGMLLinear, GGMLEmbedding)):
        return layer.dequantized(ids)
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        biases = layer.get("biases")
        scales, biases = float32_affine(
            layer["scales"][ids], None if biases is None else biases[ids]
        )
        rows = mx.dequantize(
            layer["weight"][ids],
            scales=scales,
            biases=biases,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
            dtype=mx.float32,  # MLX's default for the microscaled formats is bfloat16
        )
        scale = layer.get(GLOBAL_SCALE)
        if scale is not None:
            scale = scale.reshape(-1).astype(mx.float32)
            rows = rows * (scale[ids][:, None] if scale.size > 1 else scale)
        return rows
    return layer["weight"][ids].astype(mx.float32)


def run_layers(
    layers: list[Any], kinds: list[str], h: mx.array, cache: list[Any] | None, window: int | None
) -> mx.array:
    """Run decoder layers with one attention mask per layer kind (full or sliding)."""
    cache = cache or [None] * len(layers)
    masks: dict[str, Any] = {}
    for kind, c in zip(kinds, cache, strict=True):
        if kind not in masks:
            size = window if kind == SLIDING else None
            masks[kind] = create_attention_mask(h, c, window_size=size)
    for layer, kind, c in zip(layers, kinds, cache, strict=True):
        h = layer(h, masks[kind], c)
    return h


def splice_features(h: mx.array, media: list[tuple[int, mx.array]]) -> mx.array:
    """Embeddings [1, n, H] with each (pos, rows) of image features written over positions
    pos .. pos + len(rows): what an image model's tokens of an image embed as."""
    b, n, width = h.shape
    if b != 1:
        raise ValueError("media is computed one row at a time")
    parts, at = [], 0
    for pos, rows in sorted(media, key=lambda m: m[0]):
        length = rows.shape[0]
        if pos < at or pos + length > n or tuple(rows.shape[1:]) != (width,):
            raise ValueError(
                f"media at {pos} with features {list(rows.shape)} does not fit a chunk of "
                f"{n} tokens and hidden size {width}"
            )
        parts += [h[:, at:pos], rows[None].astype(h.dtype)]
        at = pos + length
    return mx.concatenate([*parts, h[:, at:]], axis=1)


def layer_caches(kinds: list[str], window: int | None) -> list[Any]:
    """One live cache per layer: a rotating cache of the window on sliding layers, a KV cache
    on the others."""
    return [RotatingKVCache(max_size=window) if k == SLIDING else KVCache() for k in kinds]


class LayerKinds:
    """Mixin for an mlx-lm text model (`embed_tokens`, `layers`, `norm`, built from `args`)
    whose layers are full or sliding-window as `kinds` says (transformers' `layer_types`),
    where mlx-lm's own model decides otherwise or has no windows: one mask per kind."""

    embed_tokens: Any
    layers: list[Any]
    norm: Any

    def __init__(self, args: Any, kinds: list[str], window: int | None):
        super().__init__(args)  # type: ignore[call-arg]  # the mlx-lm model's
        self.kinds = kinds
        self.window = window

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        return self.norm(run_layers(self.layers, self.kinds, h, cache, self.window))


def add_attention_bias(layers: list[Any]) -> None:
    """Give q/k/v/o biases, as transformers does for `attention_bias`, where mlx-lm has none."""
    for layer in layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out_dims, in_dims = getattr(attn, name).weight.shape
            setattr(attn, name, nn.Linear(in_dims, out_dims, bias=True))


class FloatSwitchGLU(SwitchGLU):
    """mlx-lm's SwitchGLU (the routed experts), in float32 on the CPU: MLX's CPU gather_mm
    computes only float32, so a bfloat16 model would fail at its first forward."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if x.dtype == mx.float32 or mx.default_device() != mx.cpu:
            return super().__call__(x, indices)
        return super().__call__(x.astype(mx.float32), indices).astype(x.dtype)


def switch_mlp_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Routed experts under mlx-lm's `<layer>.mlp.switch_mlp.<proj>` names, stacked
    [E, out, in], from any of the layouts they arrive in: one tensor per expert
    (`experts.<e>.<proj>.weight`, and its `scales` / `biases`: a transformers checkpoint),
    already stacked (`experts.<proj>.weight`: the Go runner's import), or transformers'
    in-memory fused `experts.gate_up_proj` / `experts.down_proj`."""
    out: dict[str, mx.array] = {}
    per_expert: dict[str, dict[int, mx.array]] = {}
    for k, v in weights.items():
        head, sep, tail = k.partition(".mlp.experts.")
        if not sep:
            out[k] = v
            continue
        switch = f"{head}.mlp.switch_mlp"
        index, dot, rest = tail.partition(".")
        if index.isdigit() and dot:
            per_expert.setdefault(f"{switch}.{rest}", {})[int(index)] = v
        elif tail == "gate_up_proj":
            gate, up = mx.split(v, 2, axis=1)
            out[f"{switch}.gate_proj.weight"], out[f"{switch}.up_proj.weight"] = gate, up
        elif tail == "down_proj":
            out[f"{switch}.down_proj.weight"] = v
        else:
            out[f"{switch}.{tail}"] = v
    for name, experts in per_expert.items():
        out[name] = mx.stack([experts[e] for e in sorted(experts)])
    return out


class DecoderModel:
    """A decoder-only mlx-lm `Model` with `.model` (embed, layers, final norm) and a head.

    Families subclass it with `build_module` (the mlx-lm module for a transformers config),
    `KERNELS` (which of its mlx-lm classes get the backend's kernels) and, where the family
    post-processes logits, `postprocess`.
    """

    DEFAULT_CONTEXT = 2048  # transformers' max_position_embeddings default for the family
    KERNELS: ClassVar[Kernels] = Kernels()
    # Whether short forwards may run in one native call (runner/backend/native_step.py): for
    # mlx-lm's Llama-shaped modules only; the builder still checks every layer.
    NATIVE_STEP: ClassVar[bool] = False
    _native: native_step.NativeStep | None = None  # families with their own __init__: none

    @classmethod
    def build_module(cls, config: dict[str, Any]) -> nn.Module:
        raise NotImplementedError

    def __init__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ):
        self.module = module
        self.config = config
        self.architecture = architecture
        self.backend = backend
        self._tied = "lm_head" not in module
        self._head = module.model.embed_tokens if self._tied else module.lm_head
        self.context_length = int(config.get("max_position_embeddings") or self.DEFAULT_CONTEXT)
        table = self._head[BLOCKS if BLOCKS in self._head else "weight"]
        self.vocab_size = int(table.shape[0])
        self._native = (
            native_step.build(
                module,
                self.KERNELS,
                backend.native_step_max_tokens,
                backend.native_half_formats,
                shape=self.native_shape(),
            )
            if self.NATIVE_STEP
            else None
        )

    def native_shape(self) -> native_step.NativeShape:
        """What the family's model does around its layers that the native step must do too
        (Gemma's norms and embedding scale); nothing here."""
        return native_step.NativeShape()

    def make_caches(self) -> list[Any]:
        return make_prompt_cache(self.module)

    @property
    def native(self) -> native_step.NativeStep | None:
        """The native step that runs this model's short forwards on the CPU, if any."""
        return self._native

    @contextlib.contextmanager
    def mlx_only(self) -> Iterator[None]:
        """Every forward inside runs MLX's path (no native step): what the load-time checks
        of that path use. MLX thread only."""
        native, self._native = self._native, None
        try:
            yield
        finally:
            self._native = native

    @contextlib.contextmanager
    def decode_steps(self) -> Iterator[None]:
        """`DecodeSteps`: the native step's one-token forwards inside are decode steps. MLX
        thread only."""
        if self._native is None:
            yield
            return
        with self._native.decoding():
            yield

    def hidden(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        if self._native is not None:
            hidden = self._native(tokens, caches)
            if hidden is not None:
                return hidden
        return self.module.model(tokens, cache=caches)

    def restore_kv(self, cache: Any, segments: list[Any], target: int, kept: int = 0) -> bool:
        """`KVRestorer`: into the native step's own buffers for `cache`, where it has them."""
        return self._native is not None and self._native.restore(cache, segments, target, kept)

    def postprocess(self, logits: mx.array) -> mx.array:
        """Element-wise logit post-processing (soft-capping, ...); identity here."""
        return logits

    def postprocess_is_identity(self) -> bool:
        """Whether `postprocess` returns its logits as they are (a family that overrides it
        says when its own does)."""
        return type(self).postprocess is DecoderModel.postprocess

    def unembed(self, hidden: mx.array) -> mx.array:
        if self._native is not None:  # the head's half-precision copy, where it has one
            logits = self._native.unembed(hidden)
            if logits is not None:
                return self.postprocess(logits)
        head = self._head
        if not self._tied:
            logits = head(hidden)  # a GemvLinear where the backend asks for gemv
        elif self.backend.gemv and "weight" in head and gemv.one_row(hidden, head.weight):
            logits = gemv.matvec(hidden, head.weight)
        else:
            logits = head.as_linear(hidden)
        return self.postprocess(logits)

    def host_logits(self, hidden: mx.array) -> np.ndarray | None:
        """`HostLogits`: where the native step's head computes `unembed(hidden)` and this
        family adds nothing to it (no post-processing, no `unembed` of its own), those logits
        as numpy's [rows, vocab] float32; else None."""
        if (
            self._native is None
            or type(self).unembed is not DecoderModel.unembed
            or not self.postprocess_is_identity()
        ):
            return None
        return self._native.host_logits(hidden)

    def unembed_candidates(self, hidden: mx.array, ids: mx.array) -> mx.array:
        logits = hidden.astype(mx.float32) @ gather_rows(self._head, ids).T
        if not self._tied and "bias" in self._head:
            logits = logits + self._head["bias"][ids].astype(mx.float32)
        return self.postprocess(logits)


class Float32ExpertsOnCPU:
    """Mixin for mlx-lm's expert layers (gather_mm): MLX's CPU gather_mm computes float32
    only, so there a half-precision input is computed in float32 (the weights promote) and
    the result cast back. The runner computes float32 on the CPU; this keeps a model loaded
    in half precision there (tests, tools) working instead of failing at its first MoE layer.
    """

    def __call__(self, x: mx.array, *args: Any) -> mx.array:
        call = super().__call__  # type: ignore[misc]
        if x.dtype == mx.float32 or mx.default_device() != mx.cpu:
            return call(x, *args)
        wide = tuple(
            a.astype(mx.float32)
            if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating)
            else a
            for a in args
        )
        return call(x.astype(mx.float32), *wide).astype(x.dtype)
