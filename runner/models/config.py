"""Reading transformers 5 configs for mlx-lm: the helpers every family's adapter uses.

transformers 5 is the reference for what a config means. Its configs nest `rope_theta` and
the scaling under `rope_parameters` and rely on class defaults for absent keys; mlx-lm's
`ModelArgs` read `rope_theta`/`rope_scaling` and have defaults of their own. Each family's
`build_module` turns the transformers config into the dict mlx-lm should see, and refuses
with a ModelLoadError naming the field what neither can express.

Invariant: a config value no model can have is refused at load, by the checks here, with a
ModelLoadError that names the key; it is never left to fail inside mlx-lm (TypeError,
ZeroDivisionError) or to build a model that fails at the first request. Every family's
`build_module` runs `check_decoder`, and the helpers below for its own keys, on the config with
its defaults filled in, before anything reads it. The rules are transformers 5's types (a size
is a JSON integer, a flag a JSON boolean, null only where transformers derives the value) and
what the arithmetic needs (positive sizes, heads that divide as the attention requires).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from runner.sources.source import ModelLoadError, show
from runner.sources.values import flag, integer, json_object, number

SLIDING = "sliding_attention"
FULL = "full_attention"

# RoPE types whose mlx-lm implementation matches transformers' (checked by the reference tests).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# yarn keys where mlx-lm's formula differs from transformers' (an explicit attention_factor;
# mscale or mscale_all_dim without the other; truncate=False unless built by `rope_module`);
# refused rather than computed differently. Both mscales given is the same ratio in both.
_YARN_MSCALES = ("mscale", "mscale_all_dim")


# MLX's array dimensions and RoPE offsets are 32-bit: no cache can hold a longer context.
MAX_CONTEXT = 2**31 - 1

# The sizes every family here is built from, by their transformers names.
DECODER_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def check_decoder(
    c: dict[str, Any],
    *,
    nullable: tuple[str, ...] = (),
    hidden_by_heads: bool = False,
    rotary_fraction: float = 1.0,
) -> None:
    """Refuse the shared sizes and flags of a decoder that no model can have, before mlx-lm
    divides by them or builds arrays of them.

    `c` has the family's defaults filled in. `nullable` keys may be null where transformers
    derives them (head_dim = hidden_size // heads, num_key_value_heads = heads);
    `hidden_by_heads` is the `validate_architecture` of the transformers classes that have
    one; `rotary_fraction` of head_dim is what RoPE rotates, in pairs.
    """
    for key in DECODER_SIZES:
        if key not in nullable or c.get(key) is not None:
            integer(c.get(key), key)
    integer(c.get("max_position_embeddings"), "max_position_embeddings", maximum=MAX_CONTEXT)
    number(c.get("rms_norm_eps"), "rms_norm_eps")
    for key in ("tie_word_embeddings", "attention_bias"):
        flag(c.get(key, False), key)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"config.json: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    if hidden_by_heads and hidden % heads:
        raise ModelLoadError(
            f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    head_dim = c.get("head_dim") or hidden // heads
    rotary = int(head_dim * rotary_fraction)
    if rotary <= 0 or rotary % 2:
        raise ModelLoadError(
            f"config.json: RoPE would rotate {rotary} of the {head_dim} dimensions of each head; "
            "it rotates pairs"
        )


def check_derived_head_dim(c: dict[str, Any], family: str) -> None:
    """For an mlx-lm attention whose heads are hidden_size // num_attention_heads wide: refuse
    a `head_dim` of another width, which transformers would read (null or absent: derived,
    as mlx-lm does). `c` has passed `check_decoder`."""
    derived = c["hidden_size"] // c["num_attention_heads"]
    if c.get("head_dim") is not None and c["head_dim"] != derived:
        raise ModelLoadError(
            f"config.json: head_dim {c['head_dim']} is not hidden_size // num_attention_heads "
            f"({derived}), the only width {family} is computed with here"
        )


def check_layer_kinds(kinds: Any, allowed: tuple[str, ...], n: int) -> list[str]:
    """transformers' `validate_layer_type`: one allowed kind per layer."""
    if (
        not isinstance(kinds, list)
        or len(kinds) != n
        or not all(isinstance(kind, str) and kind in allowed for kind in kinds)
    ):
        raise ModelLoadError(
            f"config.json: layer_types must give one of {', '.join(allowed)} for each of the "
            f"{n} layers, not {show(kinds)}"
        )
    return kinds


def hf_rope_parameters(
    config: dict[str, Any],
    params: dict[str, Any] | None = None,
    *,
    default_theta: float,
    where: str = "rope_parameters",
) -> dict[str, Any]:
    """transformers 5's standardized rope dict: `rope_parameters`, else the legacy
    `rope_scaling` + `rope_theta`, with its defaults filled in."""
    if params is None:
        params = json_object(config.get("rope_parameters"), "rope_parameters") or json_object(
            config.get("rope_scaling"), "rope_scaling"
        )
    params = dict(json_object(params, where))
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


def mlx_rope(
    params: dict[str, Any], where: str = "rope_parameters", *, untruncated_yarn: bool = False
) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for mlx-lm's `initialize_rope`, from a transformers rope dict.
    `untruncated_yarn`: the caller builds the rope with `rope_module`, which computes yarn's
    truncate=false as transformers does."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{where}.rope_type {rope_type!r} is not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{where}.partial_rotary_factor is not supported for this model")
    if rope_type == "yarn":
        if params.get("attention_factor") is not None:
            raise ModelLoadError(f"{where}.attention_factor is not supported for yarn RoPE")
        given = [key for key in _YARN_MSCALES if params.get(key)]
        if len(given) == 1:
            raise ModelLoadError(
                f"{where}.{given[0]} is not supported for yarn RoPE without "
                f"{where}.{(set(_YARN_MSCALES) - set(given)).pop()}"
            )
        for key in given:
            number(params[key], f"{where}.{key}")
        if params.get("truncate", True) is not True and not untruncated_yarn:
            raise ModelLoadError(f"{where}.truncate=false is not supported for yarn RoPE")
    check_rope(params, where)
    # mlx-lm passes on every key present, a null one too; transformers reads null (and a zero
    # mscale) as absent, where mlx-lm's defaults give its result
    scaling = None
    if rope_type != "default":
        scaling = {
            k: v for k, v in params.items() if v is not None and (v or k not in _YARN_MSCALES)
        }
    return float(params["rope_theta"]), scaling


def rope_module(
    params: dict[str, Any], dims: int, max_position_embeddings: int, where: str = "rope_parameters"
) -> nn.Module:
    """mlx-lm's RoPE module for a transformers rope dict (`hf_rope_parameters`), with yarn's
    `truncate: false` as transformers computes it: mlx-lm's YarnRoPE always rounds the
    correction range outwards to whole dimensions, transformers only when truncating."""
    theta, scaling = mlx_rope(params, where, untruncated_yarn=True)
    rope = initialize_rope(dims, theta, False, scaling, max_position_embeddings)
    if scaling is not None and scaling["rope_type"] == "yarn" and scaling.get("truncate") is False:
        rope._freqs = _untruncated_yarn_periods(dims, theta, scaling)
    return rope


def _untruncated_yarn_periods(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """YarnRoPE's `_freqs` (wavelengths over 2 pi, as mx.fast.rope takes them) with the
    correction range left unrounded (transformers' `_compute_yarn_parameters`)."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(correction_dim(scaling.get("beta_fast") or 32), 0)
    high = min(correction_dim(scaling.get("beta_slow") or 1), dims - 1)
    if low == high:
        high += 0.001  # as transformers, against a division by zero
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolate = 1.0 - ramp  # the share of each dimension's original frequency
    periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    interpolated = factor * periods
    return (interpolated * periods) / (interpolated * extrapolate + periods * (1 - extrapolate))


def check_rope(params: dict[str, Any], where: str = "rope_parameters") -> None:
    """Refuse RoPE values that leave no meaningful frequencies: bases and factors that are
    not positive numbers, a rotated fraction outside (0, 1], and the divisions by zero of
    llama3's smoothing. `params` is an `hf_rope_parameters` dict of a supported type."""
    number(params.get("rope_theta"), f"{where}.rope_theta")
    fraction = params.get("partial_rotary_factor", 1.0)
    if number(fraction, f"{where}.partial_rotary_factor") > 1:
        raise ModelLoadError(f"config.json: {where}.partial_rotary_factor {fraction} is above 1")
    rope_type = params["rope_type"]
    if rope_type != "default":
        number(params.get("factor"), f"{where}.factor")
    if rope_type in ("llama3", "yarn"):
        original = params.get("original_max_position_embeddings")
        integer(original, f"{where}.original_max_position_embeddings")
    if rope_type == "llama3":
        low = number(params.get("low_freq_factor", 1.0), f"{where}.low_freq_factor")
        high = number(params.get("high_freq_factor", 4.0), f"{where}.high_freq_factor")
        if low == high:  # the smoothing divides by their difference
            raise ModelLoadError(
                f"config.json: {where}.low_freq_factor and high_freq_factor are both {low}"
            )


def require(config: dict[str, Any], key: str, *allowed: Any) -> None:
    """Refuse a config value that mlx-lm's implementation would silently ignore."""
    if config.get(key) not in allowed:
        value = config.get(key)
        raise ModelLoadError(f"{key}={value!r} is not supported (expected {allowed[0]!r})")
