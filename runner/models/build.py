"""`build_model`: a `ModelSource` -> a ready `Model`, and the checks a loaded model passes.

`build_model` follows mlx-lm's `mlx_lm.utils.load_model` step by step (build the module from
the config, `sanitize`, quantize the layers the weights say are quantized (with the global
scales and row dtypes of runner/models/quantized.py), load strictly, evaluate), with the
family's config translation in front (see the family modules: transformers 5 is the
reference for what a config means) and every failure reported as a `ModelLoadError`. Then
the backend's kernels go onto the loaded instances (runner/backend/install.py), the model's
optional load-time hooks run (`SourceReader`, `GenerationConfigReader`:
runner/models/base.py), and `verify_batched_rows` runs on the model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import infer_quant_config

from runner.backend import Backend, library_products
from runner.backend.install import install
from runner.cache.batch import broadcast, forward_suffixes
from runner.cache.kinds import kind_of
from runner.cache.live import live_arrays
from runner.models import halves, quantized
from runner.models.base import GenerationConfigReader, MLXPathSwitch, Model, SourceReader
from runner.models.registry import resolve_architecture
from runner.sources.source import ModelLoadError, ModelSource

log = logging.getLogger(__name__)


def build_model(
    source: ModelSource,
    backend: Backend | None = None,
    distribute: Callable[[nn.Module, str], None] | None = None,
) -> Model:
    """Build, quantize and load the model in `source` for `backend` (default: the one MLX
    runs on): weights cast to its compute dtype, its kernels installed. Run on the MLX
    thread. `distribute(module, architecture)` shards the loaded module over a process group
    before its weights are evaluated (runner/distributed/shard.py), so a rank reads only its
    share; it raises ModelLoadError for a family or mode it cannot shard."""
    backend = Backend.for_device() if backend is None else backend
    architecture, family = resolve_architecture(source.config)
    try:
        module = family.build_module(source.config)
    except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as e:
        # mlx-lm rejecting a config that the family's checks (runner/models/config.py) let by
        raise ModelLoadError(f"cannot build {architecture} from config.json: {e!r}") from e
    weights = dict(source.weights)
    quantization, blocks = quantized.block_layers(source.quantization)
    # GGML blocks (Q2_K to Q6_K, IQ4_XS, IQ4_NL, the grid i-quants): kept where a native step
    # will read them; elsewhere Q4_K / Q5_K MLX's affine 4- / 5-bit, IQ2_XXS / IQ3_XXS / IQ3_S /
    # IQ1_S 8-bit, the others float32
    stepped = (
        backend.native_step_max_tokens is not None
        and distribute is None
        and getattr(family, "NATIVE_STEP", False)
    )
    keep_blocks = bool(blocks) and stepped
    # and where the CPU backend's library computes their products from MLX's graph (stacked
    # experts too, for any family)
    products = library_products.for_backend(backend) if distribute is None else None
    if blocks:
        quantization = quantized.adopt_blocks(
            module, weights, source.quantization or {}, blocks, keep_blocks, products
        )
    if hasattr(module, "sanitize"):
        weights = module.sanitize(weights)
    # a half-precision checkpoint's decoder matrices as stored, where widening them to float32
    # (with the step's half copies) would take too much of the memory (runner/models/halves.py)
    stored = (
        stepped
        and not blocks
        and products is not None
        and halves.store_if_chosen(module, weights, products)
    )
    if quantization is not None:
        _quantize(module, weights, quantization)
        quantized.adopt(module, weights, backend.compute_dtype)  # global scales, row dtypes
    module.eval()  # before loading, as mlx-lm does (some layers pick kernels by `training`)
    _check_weights(module, weights, architecture)
    module.load_weights(list(weights.items()), strict=True)
    if backend.compute_dtype is not None:
        _cast(module, backend.compute_dtype)
    if distribute is not None:
        distribute(module, architecture)
    mx.eval(module.parameters())
    counts = install(module, family.KERNELS, backend)
    log.debug("kernels for backend %s: %s", backend.name, counts)
    model = family(module, source.config, architecture, backend)
    native = isinstance(model, MLXPathSwitch) and model.native is not None
    if keep_blocks and products is None and not native:
        # the native step declined this module: MLX's path would dequantize every forward
        quantized.release_blocks(module)
        model = family(module, source.config, architecture, backend)
    if stored and not native and halves.widen(module):
        # no step reads them: MLX's path computes from float32 weights, as it always has
        model = family(module, source.config, architecture, backend)
    if products is not None:  # after the native step took what it reads (the plain classes)
        changed = quantized.compute_affine(module, products)
        log.debug("affine layers computed by the library: %d", changed)
    if isinstance(model, SourceReader):  # a family that reads more files (its images')
        model.bind_source(source)
    if isinstance(model, GenerationConfigReader):  # e.g. Gemma 4's suppress_tokens
        model.use_generation_config(source.generation_config)
    quantized_module = backend.native_step_max_tokens is not None and _quantized(module)
    verify_batched_rows(
        model,
        (lambda: _stand_in(family, source.config, architecture, backend))
        if quantized_module
        else None,
    )
    return model


def _quantize(module: nn.Module, weights: dict[str, mx.array], quantization: dict) -> None:
    """mlx-lm's load_model quantization: per-layer entries win, else the layers whose
    `P.scales` are in the weights, with group size, bits and mode read off the arrays."""

    def class_predicate(path: str, layer: nn.Module) -> bool | dict:
        if path in quantization:
            return quantization[path]
        if not hasattr(layer, "to_quantized") or f"{path}.scales" not in weights:
            return False
        try:
            return infer_quant_config(path, layer, weights)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None

    nn.quantize(
        module,
        group_size=quantization.get("group_size"),  # type: ignore[arg-type]  # per layer
        bits=quantization.get("bits"),  # type: ignore[arg-type]
        mode=quantization.get("mode", "affine"),
        class_predicate=class_predicate,
    )


def _check_weights(module: nn.Module, weights: dict[str, mx.array], architecture: str) -> None:
    """What `load_weights(strict=True)` checks, said as one clear ModelLoadError, and the
    dtypes it does not check: a floating parameter takes any floating dtype (the cast comes
    later), any other (packed quantized data) exactly its own. An integer or boolean tensor in
    a floating place would otherwise compute garbage, a complex one fail at the first request.
    """
    expected = dict(tree_flatten(module.parameters()))
    problems = [f"missing {k}" for k in sorted(expected.keys() - weights.keys())]
    problems += [f"unexpected {k}" for k in sorted(weights.keys() - expected.keys())]
    for k in sorted(expected.keys() & weights.keys()):
        got, want = weights[k], expected[k]
        if not isinstance(got, mx.array):
            problems.append(f"{k} is not an array")
        elif got.shape != want.shape:
            problems.append(f"{k} has shape {got.shape}, expected {want.shape}")
        elif not _dtype_fits(got.dtype, want.dtype):
            problems.append(
                f"{k} has dtype {_dtype_name(got.dtype)}, expected {_dtype_name(want.dtype)}"
            )
    if problems:
        shown = "; ".join(problems[:8])
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ModelLoadError(f"weights do not match {architecture}: {shown}{more}")


def _dtype_fits(got: mx.Dtype, want: mx.Dtype) -> bool:
    """Any floating dtype for a floating parameter, else exactly the parameter's."""
    if mx.issubdtype(want, mx.floating):
        return mx.issubdtype(got, mx.floating)
    return got == want


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _cast(module: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters to `dtype`, except quantization data and what the mlx-lm
    model's `cast_predicate` keeps (e.g. Qwen3.5's float32 `A_log`)."""
    may_cast = getattr(module, "cast_predicate", None) or (lambda _path: True)
    quantized = {
        path
        for path, m in module.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }

    def cast(path: str, value: mx.array) -> mx.array:
        owner, _, name = path.rpartition(".")
        if (owner in quantized and name != "bias") or not may_cast(path):
            return value
        return value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value

    module.update(tree_map_with_path(cast, module.parameters()))


# Tolerances for `verify_batched_rows`, relative to the largest hidden value: float32 rounding
# differs between the two paths by ~1e-6; half precision by ~1e-2. A batch that lost its
# prefix is off by the whole prefix's attention (tens of percent).
_TOLERANCE = {mx.float32: 1e-3, mx.float16: 5e-2, mx.bfloat16: 5e-2}


def verify_batched_rows(model: Any, stand_in: Callable[[], Any] | None = None) -> None:
    """Raise ModelLoadError unless rows batched over a shared prefix give the hidden states
    the same rows give alone, on `model` itself (a few tokens; run on the MLX thread): on
    every path its forwards may take, MLX's included where a native step usually runs them
    (runner/backend/native_step.py declines some forwards). `stand_in()`, where given, is a
    small float32 model of the same family, config and kernels that MLX's path is checked on
    instead of `model` behind its native step (see `_stand_in`)."""
    _verify_batched_rows(model, 6, (3, 2))
    if isinstance(model, MLXPathSwitch) and model.native is not None:
        if stand_in is not None:
            _verify_batched_rows(stand_in(), 6, (3, 2))
            return
        # fewer tokens (13 rows of forwards, not 29): still a prefix, suffixes of two lengths
        with model.mlx_only():
            _verify_batched_rows(model, 2, (2, 1))


def _quantized(module: nn.Module) -> bool:
    kinds = (
        nn.QuantizedLinear,
        nn.QuantizedEmbedding,
        quantized.GGMLLinear,
        quantized.GGMLEmbedding,
        quantized.GGMLSwitchLinear,
    )
    return any(isinstance(m, kinds) for _, m in module.named_modules())


# What a stand-in keeps smaller than its model: layers, MLP widths (its experts' too),
# vocabulary
_STAND_IN = {
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "moe_intermediate_size": 64,
    "vocab_size": 512,
}
# A mixture of experts' count (transformers' names for it), kept to at most this many, and
# to at least as many as a token takes
_STAND_IN_EXPERTS = 8
_EXPERT_COUNTS = ("num_local_experts", "num_experts")


def _stand_in(family: Any, config: dict[str, Any], architecture: str, backend: Backend) -> Any:
    """A model of `family` from `config` with 2 layers, a 64-wide MLP (and experts: at most 8,
    64 wide) and a 512-token vocabulary (the attention's shapes as configured), float32
    random weights as mlx-lm initializes them, its kernels installed for `backend` without a
    native step: MLX's path through the same classes and kernels as the model's. For a
    quantized model behind a native step, whose forwards on MLX's path run MLX's CPU
    quantized_matmul (~2 s a forward of a 1B Q4_K_M model: the check took 13 s of its load;
    an 8B's would take a minute or more)."""
    small = {**config, **{k: min(v, int(config.get(k) or v)) for k, v in _STAND_IN.items()}}
    # (a stand-in of Qwen3-30B-A3B's 128 experts took 20 s to initialize: 2.4 GB of them)
    chosen = config.get("num_experts_per_tok")
    for key in _EXPERT_COUNTS:
        count = config.get(key)
        if isinstance(count, int) and isinstance(chosen, int) and count > _STAND_IN_EXPERTS:
            small[key] = max(_STAND_IN_EXPERTS, chosen)
    dense = config.get("mlp_only_layers")  # Qwen3-MoE's dense layers, of those kept
    if isinstance(dense, list):
        small["mlp_only_layers"] = [
            i for i in dense if isinstance(i, int) and i < small["num_hidden_layers"]
        ]
    # one layer of each kind the model has (full, sliding), in the order they first come
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        distinct = list(dict.fromkeys(kinds))
        layers = max(small["num_hidden_layers"], len(distinct))
        small["num_hidden_layers"] = layers
        small["layer_types"] = distinct + [distinct[0]] * (layers - len(distinct))
    window_from = config.get("max_window_layers")  # Qwen2: layers from this index slide
    if isinstance(window_from, int) and window_from < int(config.get("num_hidden_layers") or 0):
        small["max_window_layers"] = min(window_from, small["num_hidden_layers"] - 1)
    module = family.build_module(small)
    module.eval()
    mx.eval(module.parameters())
    mlx_path = dataclasses.replace(backend, native_step_max_tokens=None)
    install(module, family.KERNELS, mlx_path)
    return family(module, small, architecture, mlx_path)


def _verify_batched_rows(model: Any, prefix_len: int, suffix_lens: tuple[int, ...]) -> None:
    vocab = model.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(prefix_len + sum(suffix_lens))]
    prefix, suffixes, at = ids[:prefix_len], [], prefix_len
    for n in suffix_lens:
        suffixes.append(ids[at : at + n])
        at += n
    caches = model.make_caches()
    kinds = [kind_of(c) for c in caches]
    # One forward per evaluation: over a pipeline of processes a graph holding two forwards
    # may receive their hidden states in either order (runner/distributed/shard.py).
    mx.eval(model.hidden(mx.array([prefix], dtype=mx.int32), caches), *live_arrays(caches))
    if not all(kind.batches for kind in kinds):  # scoring runs rows one by one
        return
    batched = forward_suffixes(model, broadcast(kinds, caches, len(suffixes)), suffixes)
    mx.eval(batched)
    worst, largest = 0.0, 0.0
    for i, suffix in enumerate(suffixes):
        alone = model.hidden(mx.array([prefix + suffix], dtype=mx.int32), model.make_caches())
        expected = np.array(alone[0, len(prefix) :].astype(mx.float32))
        got = np.array(batched[i, : len(suffix)].astype(mx.float32))
        worst = max(worst, float(np.abs(got - expected).max()))
        largest = max(largest, float(np.abs(expected).max()))
    tolerance = _TOLERANCE.get(batched.dtype, 5e-2)
    if not worst <= tolerance * max(largest, 1.0):
        import mlx_lm

        raise ModelLoadError(
            f"rows batched over a shared prefix differ from the same rows alone by {worst:.3g} "
            f"(largest value {largest:.3g}) on {model.architecture}: the runner's attention is "
            f"not in effect on every attention layer with mlx-lm {mlx_lm.__version__}; "
            "refusing to load rather than score wrongly"
        )
