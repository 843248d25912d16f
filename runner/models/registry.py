"""Architecture name -> model family.

Families register themselves (runner/models/<family>.py, or <family>/model.py) under their
`architectures[0]` names and their `model_type`; a name is registered once. A config is
looked up by `architectures[0]`, or by `model_type` when it has no `architectures`.
runner/models/build.py builds the family's model from a `ModelSource`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import mlx.nn as nn

from runner.backend import Backend
from runner.backend.install import Kernels
from runner.models.base import Model
from runner.sources.source import ModelLoadError, show

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
