"""Architecture name -> model family, and `build_model`: a `ModelSource` -> a ready `Model`.

Families register themselves (runner/models/<family>.py) under their `architectures[0]` names
and their `model_type`; a name is registered once. A config is looked up by `architectures[0]`,
or by `model_type` when it has no `architectures`.

`build_model` follows mlx-lm's `mlx_lm.utils.load_model` step by step (build the module from
the config, `sanitize`, quantize the layers the weights say are quantized (with the global
scales and row dtypes of runner/models/quantized.py), load strictly,
evaluate), with the family's config translation in front (see the family modules: transformers
5 is the reference for what a config means) and every failure reported as a `ModelLoadError`.
Then the backend's kernels go onto the loaded instances (runner/backend/install.py), a family
that asks for it reads generation_config.json (runner/models/base.py), and the batched-rows
check runs on the model (runner/cache/batch.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import infer_quant_config

from runner.backend import Backend
from runner.backend.install import Kernels, install
from runner.cache.batch import verify_batched_rows
from runner.models import quantized
from runner.models.base import Model
from runner.source import ModelLoadError, ModelSource, show

log = logging.getLogger(__name__)


class ModelFamily(Protocol):
    """What a registered class provides: the mlx-lm module for a config, the kernels its
    mlx-lm classes take, and the adapter."""

    KERNELS: Kernels

    def build_module(self, config: dict[str, Any]) -> nn.Module: ...

    def __call__(
        self, module: nn.Module, config: dict[str, Any], architecture: str, backend: Backend
    ) -> Model: ...


F = TypeVar("F", bound=ModelFamily)

_REGISTRY: dict[str, ModelFamily] = {}


def register(*names: str) -> Callable[[F], F]:
    """Class decorator: serve `names` (architectures and model types) with this family."""

    def add(family: F) -> F:
        for name in names:
            if name in _REGISTRY:
                raise ValueError(f"architecture {name!r} is already registered")
        for name in names:
            _REGISTRY[name] = family
        return family

    return add


def registered_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(config: dict[str, Any]) -> tuple[str, ModelFamily]:
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise ModelLoadError(
            f"config.json: architectures must be a list of names, not {show(architectures)}"
        )
    name = architectures[0] if architectures else config.get("model_type")
    if not name:
        raise ModelLoadError("no architectures found in config.json")
    if not isinstance(name, str):
        raise ModelLoadError(f"config.json: model_type must be a name, not {show(name)}")
    family = _REGISTRY.get(name)
    if family is None:
        raise ModelLoadError(f"unsupported architecture: {name}")
    return name, family


def build_model(source: ModelSource, backend: Backend | None = None) -> Model:
    """Build, quantize and load the model in `source` for `backend` (default: the one MLX
    runs on): weights cast to its compute dtype, its kernels installed. Run on the MLX
    thread."""
    backend = Backend.for_device() if backend is None else backend
    architecture, family = resolve_architecture(source.config)
    try:
        module = family.build_module(source.config)
    except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as e:
        # mlx-lm rejecting a config that the family's checks (runner/models/config.py) let by
        raise ModelLoadError(f"cannot build {architecture} from config.json: {e!r}") from e
    weights = dict(source.weights)
    if hasattr(module, "sanitize"):
        weights = module.sanitize(weights)
    if source.quantization is not None:
        _quantize(module, weights, source.quantization)
        quantized.adopt(module, weights, backend.compute_dtype)  # global scales, row dtypes
    module.eval()  # before loading, as mlx-lm does (some layers pick kernels by `training`)
    _check_weights(module, weights, architecture)
    module.load_weights(list(weights.items()), strict=True)
    if backend.compute_dtype is not None:
        _cast(module, backend.compute_dtype)
    mx.eval(module.parameters())
    counts = install(module, family.KERNELS, backend)
    log.debug("kernels for backend %s: %s", backend.name, counts)
    model = family(module, source.config, architecture, backend)
    bind_source = getattr(model, "bind_source", None)
    if bind_source is not None:  # a family that reads more of the files (Gemma3's images)
        bind_source(source)
    read_generation_config = getattr(model, "use_generation_config", None)
    if read_generation_config is not None:  # e.g. Gemma 4's suppress_tokens
        read_generation_config(source.generation_config)
    verify_batched_rows(model)
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
