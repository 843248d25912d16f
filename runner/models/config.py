"""Reading transformers 5 configs for mlx-lm: the helpers every family's adapter uses.

transformers 5 is the reference for what a config means. Its configs nest `rope_theta` and
the scaling under `rope_parameters` and rely on class defaults for absent keys; mlx-lm's
`ModelArgs` read `rope_theta`/`rope_scaling` and have defaults of their own. Each family's
`build_module` turns the transformers config into the dict mlx-lm should see, and refuses
with a ModelLoadError naming the field what neither can express.
"""

from __future__ import annotations

from typing import Any

from runner.source import ModelLoadError

SLIDING = "sliding_attention"
FULL = "full_attention"

# RoPE types whose mlx-lm implementation matches transformers' (checked by the reference tests).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# yarn keys where mlx-lm's formula differs from transformers' (mscale without mscale_all_dim,
# an explicit attention_factor, truncate=False); refused rather than computed differently.
_YARN_UNSUPPORTED = ("attention_factor", "mscale", "mscale_all_dim")


def hf_rope_parameters(
    config: dict[str, Any], params: dict[str, Any] | None = None, *, default_theta: float
) -> dict[str, Any]:
    """transformers 5's standardized rope dict: `rope_parameters`, else the legacy
    `rope_scaling` + `rope_theta`, with its defaults filled in."""
    if params is None:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.pop("type", None)
    params.setdefault("rope_theta", default_theta)
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn"):
        # transformers falls back to the model's own context; mlx-lm to 8192 / 4096
        params.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", config.get("max_position_embeddings")),
        )
    return params


def mlx_rope(params: dict[str, Any], where: str = "rope_parameters") -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for mlx-lm's `initialize_rope`, from a transformers rope dict."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{where}.rope_type {rope_type!r} is not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{where}.partial_rotary_factor is not supported for this model")
    if rope_type == "yarn":
        for key in _YARN_UNSUPPORTED:
            if params.get(key) is not None:
                raise ModelLoadError(f"{where}.{key} is not supported for yarn RoPE")
        if params.get("truncate", True) is not True:
            raise ModelLoadError(f"{where}.truncate=false is not supported for yarn RoPE")
    scaling = None if rope_type == "default" else params
    return float(params["rope_theta"]), scaling


def require(config: dict[str, Any], key: str, *allowed: Any) -> None:
    """Refuse a config value that mlx-lm's implementation would silently ignore."""
    if config.get(key) not in allowed:
        value = config.get(key)
        raise ModelLoadError(f"{key}={value!r} is not supported (expected {allowed[0]!r})")
