"""Model families over mlx-lm, and the registry that builds them from a `ModelSource`."""

# The family modules are imported for their `@register` side effect.
import contextlib
from collections.abc import Iterator

from runner.models import attention, cpu_ufuncs, gemma3, llama, qwen3, qwen3_5  # noqa: F401
from runner.models.base import RunnerModel, ScoresRequests
from runner.models.registry import build_model, registered_architectures

attention.install()  # batched scoring's shared-prefix attention; other caches unchanged
cpu_ufuncs.install()  # MLP activations through numpy's SIMD exp/tanh on the CPU backend


@contextlib.contextmanager
def stock_mlx_lm() -> Iterator[None]:
    """mlx-lm's own attention and activations for the duration (for plain mlx-lm baselines:
    importing `runner` re-routes them)."""
    with attention.stock_attention(), cpu_ufuncs.stock_activations():
        yield


__all__ = [
    "RunnerModel",
    "ScoresRequests",
    "build_model",
    "registered_architectures",
    "stock_mlx_lm",
]
