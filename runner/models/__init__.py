"""Model families over mlx-lm, the model contract, and the registry that builds them."""

# The family modules are imported for their `@register` side effect.
from runner.models import (  # noqa: F401
    cohere2_moe,
    gemma2,
    gemma3,
    gemma3_vision,
    gemma4,
    glimmer,
    glm4_moe_lite,
    gpt_oss,
    laguna,
    llama,
    mistral,
    nemotron_h,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_5_vision,
    qwen3_moe,
)
from runner.models.base import CachedScorer, CandidateUnembedder, HiddenRows, ImageModel, Model
from runner.models.build import build_model
from runner.models.registry import registered_architectures

__all__ = [
    "CachedScorer",
    "CandidateUnembedder",
    "HiddenRows",
    "ImageModel",
    "Model",
    "build_model",
    "registered_architectures",
]
