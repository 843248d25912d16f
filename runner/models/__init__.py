"""Model families over mlx-lm, and the registry that builds them from a `ModelSource`."""

# The family modules are imported for their `@register` side effect.
from runner.models import attention, gemma3, llama, qwen3, qwen3_5  # noqa: F401
from runner.models.base import RunnerModel, ScoresRequests
from runner.models.registry import build_model, registered_architectures

attention.install()  # batched scoring's shared-prefix attention; other caches unchanged

__all__ = ["RunnerModel", "ScoresRequests", "build_model", "registered_architectures"]
