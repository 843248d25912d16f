"""Install the backend's kernels on the model instances the runner loads.

A family declares which of mlx-lm's classes its model is built from, by what each calls
(`Kernels`); `install` gives every instance of those classes in one loaded model a subclass
made here, whose method is mlx-lm's own code with that one name resolved to the runner's
kernel. Nothing in mlx-lm changes: its modules and classes keep their functions, other
models (the runner's or a program's own) compute stock results, and two runner models with
different backends do not see each other's kernels.

Invariants:
- Only instances inside the given module change class; the classes made here subclass
  mlx-lm's, so `isinstance` and parameters are unchanged.
- A declared class whose method no longer calls the expected name fails the load
  (`ModelLoadError`): an mlx-lm that moved the call would otherwise run without the kernel,
  and for attention that means wrong batched scores (runner/cache/batch.py).
- Attention is installed on every backend (batched scoring needs it); activations, gemv and
  table rotary embeddings (runner/backend/rope.py) only where the backend's policy uses them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from runner.backend import Backend, gemv, rope
from runner.backend.attention import Attention
from runner.backend.host import Activations
from runner.sources.source import ModelLoadError

ATTENTION_CALL = "scaled_dot_product_attention"
SWIGLU_CALL = "swiglu"


@dataclass(frozen=True)
class Kernels:
    """What a family's mlx-lm classes call that the runner replaces on its instances.

    - `attention`: classes whose `__call__` ends in `scaled_dot_product_attention`;
    - `swiglu`: gated MLPs whose `__call__` calls `swiglu(gate, up)`;
    - `gelu_glu`: Gemma's MLP, `down(gelu_approx(gate(x)) * up(x))`;
    - `sparse_moe`: mixtures of experts shaped as mlx-lm's Qwen3MoeSparseMoeBlock (a router
      `gate`, softmax, `top_k`, `norm_topk_prob`, a SwiGLU `switch_mlp`): nothing is installed
      on them; the native step (runner/backend/native_step.py) computes them.
    """

    attention: tuple[type[nn.Module], ...] = ()
    swiglu: tuple[type[nn.Module], ...] = ()
    gelu_glu: tuple[type[nn.Module], ...] = ()
    sparse_moe: tuple[type[nn.Module], ...] = ()


def install(module: nn.Module, kernels: Kernels, backend: Backend) -> dict[str, int]:
    """Install `kernels` on `module`'s instances as `backend` asks; returns how many
    instances got each kernel."""
    replacements: dict[type, type] = {}
    attention = Attention(backend)
    for cls in kernels.attention:
        replacements[cls] = _calling(cls, ATTENTION_CALL, attention, "attention")
    activations = Activations(backend)
    if backend.host_activation_min_elements is not None:
        for cls in kernels.swiglu:
            replacements[cls] = _calling(cls, SWIGLU_CALL, activations.swiglu, "swiglu")
        for cls in kernels.gelu_glu:
            replacements[cls] = _gelu_glu_mlp(cls, activations)
    counts = dict.fromkeys(("attention", "swiglu", "gelu_glu", "gemv", "rope"), 0)
    for _, instance in module.named_modules():
        made = replacements.get(type(instance))
        if made is not None:
            instance.__class__ = made
            counts[made.kernel] += 1  # type: ignore[attr-defined]
    if kernels.attention and not counts["attention"]:
        raise ModelLoadError(
            "no attention layer of the declared classes "
            f"({', '.join(c.__qualname__ for c in kernels.attention)}) in the model"
        )
    if backend.gemv:
        counts["gemv"] = gemv.install(module)
    if backend.table_rope:
        counts["rope"] = rope.install(module)
    return counts


def _calling(cls: type, name: str, kernel: Any, label: str) -> type:
    """A subclass of `cls` whose `__call__` is mlx-lm's, with the global `name` -> `kernel`."""
    method = cls.__call__
    code = getattr(method, "__code__", None)
    if code is None or name not in code.co_names:
        raise ModelLoadError(
            f"{cls.__module__}.{cls.__qualname__}.__call__ no longer calls {name}; "
            "this mlx-lm version is not one the runner supports"
        )
    scope = {**method.__globals__, name: kernel}
    call = types.FunctionType(code, scope, method.__name__, method.__defaults__, method.__closure__)
    call.__kwdefaults__ = method.__kwdefaults__
    return type(cls.__name__, (cls,), {"__call__": call, "kernel": label, "__module__": __name__})


def _gelu_glu_mlp(cls: type, activations: Activations) -> type:
    """A subclass of Gemma's MLP computing its GELU-GLU through `activations`."""
    names = cls.__call__.__code__.co_names
    if not {"gate_proj", "up_proj", "down_proj", "gelu_approx"} <= set(names):
        raise ModelLoadError(
            f"{cls.__module__}.{cls.__qualname__} is no longer down(gelu_approx(gate) * up); "
            "this mlx-lm version is not one the runner supports"
        )

    def __call__(self, x):
        return self.down_proj(activations.gelu_glu(self.gate_proj(x), self.up_proj(x)))

    return type(
        cls.__name__, (cls,), {"__call__": __call__, "kernel": "gelu_glu", "__module__": __name__}
    )
