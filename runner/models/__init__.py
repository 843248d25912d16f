"""Model families over mlx-lm, the model contract, and the registry that builds them."""

# The family modules are imported for their `@register` side effect.
from runner.models import (  # noqa: F401
    gemma3,
    gemma4,
    glimmer,
    laguna,
    llama,
    nemotron_h,
    qwen3,
    qwen3_5,
)
from runner.models.base import CachedScorer, CandidateUnembedder, HiddenRows, Model
from runner.models.registry import build_model, registered_architectures

__all__ = [
    "CachedScorer",
    "CandidateUnembedder",
    "HiddenRows",
    "Model",
    "build_model",
    "registered_architectures",
]
