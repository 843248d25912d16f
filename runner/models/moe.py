"""Helpers shared by the mixture-of-experts families: expert weights and routing sizes.

A Hugging Face checkpoint stores each expert's projections apart
(`<layer>.mlp.experts.<e>.<proj>.weight`), Ollama's importer stores them stacked
(`<layer>.mlp.experts.<proj>.weight`, [E, out, in]), and mlx-lm's switch layers read them
stacked under another name (`<layer>.mlp.switch_mlp.<proj>.weight`). `stack_experts` turns
either into mlx-lm's, quantization arrays (`scales`, `biases`) included, so a quantized
checkpoint's experts load as quantized switch layers.

MLX's CPU backend multiplies gathered experts (`gather_mm`) in float32 only: on the CPU the
dense switch layers take float32 inputs (`gather_in_float32`) whatever the compute dtype.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from runner.backend import Backend
from runner.models.config import integer
from runner.sources.source import ModelLoadError

_PARTS = ("weight", "scales", "biases", "bias")


def stack_experts(
    weights: dict[str, mx.array],
    n_experts: int,
    projections: tuple[str, ...],
    source: str = "experts",
    target: str = "switch_mlp",
) -> dict[str, mx.array]:
    """`weights` with every layer's per-expert (or pre-stacked) `source` projections stacked
    under `target`: `<p>.mlp.<source>.<e>.<proj>.<part>` for e < n_experts, or
    `<p>.mlp.<source>.<proj>.<part>`, become `<p>.mlp.<target>.<proj>.<part>`."""
    pattern = re.compile(
        rf"^(?P<p>.+\.mlp)\.{source}\.(?:(?P<e>\d+)\.)?(?P<proj>{'|'.join(projections)})"
        rf"\.(?P<part>{'|'.join(_PARTS)})$"
    )
    groups: dict[str, dict[int, mx.array]] = {}
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        m = pattern.match(name)
        if m is None:
            out[name] = value
            continue
        stacked = f"{m['p']}.{target}.{m['proj']}.{m['part']}"
        if m["e"] is None:
            out[stacked] = value
        else:
            groups.setdefault(stacked, {})[int(m["e"])] = value
    for stacked, experts in groups.items():
        if sorted(experts) != list(range(n_experts)):
            raise ModelLoadError(
                f"weights: {stacked} needs experts 0..{n_experts - 1}, found {sorted(experts)[:8]}"
            )
        shapes = {tuple(experts[e].shape) for e in range(n_experts)}
        if len(shapes) > 1:
            raise ModelLoadError(f"weights: the experts of {stacked} differ in shape: {shapes}")
        out[stacked] = mx.stack([experts[e] for e in range(n_experts)])
    return out


def split_gate_up(weights: dict[str, mx.array], target: str = "switch_mlp") -> dict[str, mx.array]:
    """`weights` with fused expert projections (`<p>.mlp.experts.gate_up_proj` [E, 2I, H], gate
    rows first, and `<p>.mlp.experts.down_proj` [E, H, I], as transformers' fused experts hold
    them) split and renamed into mlx-lm's `<p>.mlp.<target>.<proj>.weight`."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        prefix, _, last = name.rpartition(".experts.")
        if last == "gate_up_proj" and prefix.endswith(".mlp"):
            mid = value.shape[-2] // 2
            # each half in its own memory: the native step reads stacked experts in place,
            # contiguous (runner/backend/native_step.py)
            out[f"{prefix}.{target}.gate_proj.weight"] = mx.contiguous(value[..., :mid, :])
            out[f"{prefix}.{target}.up_proj.weight"] = mx.contiguous(value[..., mid:, :])
        elif last == "down_proj" and prefix.endswith(".mlp"):
            out[f"{prefix}.{target}.down_proj.weight"] = value
        else:
            out[name] = value
    return out


def check_routing(c: dict[str, Any], experts_key: str = "num_experts") -> tuple[int, int]:
    """(experts, experts per token): positive integers, no more chosen than there are."""
    n = integer(c.get(experts_key), experts_key)
    k = integer(c.get("num_experts_per_tok"), "num_experts_per_tok")
    if k > n:
        raise ModelLoadError(f"config.json: num_experts_per_tok {k} is more than {experts_key} {n}")
    return n, k


class Float32SwitchLinear(SwitchLinear):
    """mlx-lm's `SwitchLinear` multiplying in float32: MLX's CPU `GatherMM` refuses half
    precision. The result is cast back to the input's dtype."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return super().__call__(x.astype(mx.float32), indices, sorted_indices).astype(x.dtype)


def gather_in_float32(module: nn.Module, backend: Backend) -> int:
    """On the CPU backend, make every dense switch layer in `module` multiply in float32
    (quantized ones, `gather_qmm`, take any dtype); returns how many changed."""
    if backend.name != "cpu":
        return 0
    changed = 0
    for _, m in module.named_modules():
        if type(m) is SwitchLinear:
            m.__class__ = Float32SwitchLinear
            changed += 1
    return changed
