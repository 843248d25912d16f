"""GGUF architectures onto the families the runner serves: a GGUF file's metadata becomes the
config.json transformers 5 would write for the same model, and each of its tensors the
checkpoint tensor it came from, undoing what llama.cpp's converter (convert_hf_to_gguf.py)
did to it. The families (runner/models/) then load them as they load a checkpoint, so a GGUF
model computes what the same weights as safetensors compute.

What the converter does, and what undoes it here:
- llama, mistral3: Q and K rows permuted from the rotate-half layout to llama.cpp's
  interleaved one, per head (`LlamaModel.permute`): the inverse row permutation, which
  applies to a quantized tensor's rows as well (blocks run along a row).
- gemma2, gemma3: every RMSNorm weight stored as 1 + w (llama.cpp multiplies by it; the
  transformers model adds the 1): w = stored - 1, in float32.
- llama's llama3 RoPE: written as `rope_freqs`, the per-frequency factors; the llama3
  parameters are found again from them and checked to give back every factor.
- tied heads: `output.weight` absent.

`plan(metadata, tensor_names)` returns the config and, per GGUF tensor, where it goes (a
`Target`), or None for a tensor the config has consumed (`rope_freqs`); a tensor it does not
know, or an architecture it does not serve, is a ModelLoadError naming it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runner.sources.source import ModelLoadError, show


@dataclass(frozen=True)
class Target:
    """Where a GGUF tensor goes: the checkpoint name, and what undoes the converter's change
    (`rows`: a permutation of axis 0; `minus_one`: a float tensor stored as 1 + w)."""

    name: str
    rows: np.ndarray | None = None
    minus_one: bool = False


@dataclass(frozen=True)
class Plan:
    config: dict[str, Any]
    targets: dict[str, Target | None]  # GGUF name -> target; None: consumed by the config
    notes: list[str] = field(default_factory=list)


class Meta:
    """A GGUF file's metadata under its architecture's prefix, read with checks."""

    def __init__(self, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]):
        self.metadata, self.shapes = metadata, shapes
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelLoadError("GGUF: general.architecture is missing")
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, else `default`."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            if value is None:
                raise ModelLoadError(f"GGUF: {self.arch}.{key} is missing")
            raise ModelLoadError(
                f"GGUF: {self.arch}.{key} must be a positive integer, not {show(value)}"
            )
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            if value is None:
                raise ModelLoadError(f"GGUF: {self.arch}.{key} is missing")
            raise ModelLoadError(f"GGUF: {self.arch}.{key} must be a number, not {show(value)}")
        return float(value)


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes convert_hf_to_gguf's `LlamaModel.permute` of a Q or K
    projection with `heads` heads: GGUF row [h, i, half] holds checkpoint row [h, half, i]."""
    index = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return index.swapaxes(1, 2).reshape(rows)


_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")

# GGUF block tensor -> checkpoint name (under model.layers.N.), shared by the Llama-shaped
# families; each architecture adds or replaces entries.
LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _targets(
    names: list[str],
    block: Mapping[str, str],
    top: Mapping[str, str] = TOP,
    transform: Callable[[str, str, int | None], Target] | None = None,
    consumed: tuple[str, ...] = (),
) -> dict[str, Target | None]:
    out: dict[str, Target | None] = {}
    for name in names:
        if name in consumed:
            out[name] = None
            continue
        match = _BLOCK.fullmatch(name)
        if match:
            layer, part = int(match.group(1)), match.group(2)
            if part not in block:
                raise ModelLoadError(f"GGUF: tensor {name} is not one the runner maps")
            hf = f"model.layers.{layer}.{block[part]}"
        elif name in top:
            layer, part, hf = None, name, top[name]
        else:
            raise ModelLoadError(f"GGUF: tensor {name} is not one the runner maps")
        out[name] = transform(hf, part, layer) if transform else Target(hf)
    return out


def _common(m: Meta, architecture: str, model_type: str) -> dict[str, Any]:
    """The keys every decoder family reads, from the metadata llama.cpp's converter writes
    (the vocabulary: the embedding's rows, which may pad the tokenizer's)."""
    hidden, heads = m.int("embedding_length"), m.int("attention.head_count")
    embedding = m.shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2 or embedding[1] != hidden:
        raise ModelLoadError(f"GGUF: token_embd.weight has shape {show(embedding)}")
    kv_heads = m.int("attention.head_count_kv", heads)
    head_dim = m.int("attention.key_length", hidden // heads)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": embedding[0],
        "hidden_size": hidden,
        "intermediate_size": m.int("feed_forward_length"),
        "num_hidden_layers": m.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # float32 as stored (9.9999997e-06 for 1e-5): the same float32 MLX computes with
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": m.int("context_length", 4096),
    }


def _rope(m: Meta, rope_freqs: np.ndarray | None, head_dim: int) -> dict[str, Any]:
    """transformers 5's `rope_parameters` from the metadata (and llama's `rope_freqs`)."""
    theta = m.float("rope.freq_base", 10000.0)
    kind = m.get("rope.scaling.type", "none")
    if rope_freqs is not None:
        return llama3_rope(rope_freqs, theta, head_dim)
    if kind in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {
            "rope_type": "linear",
            "rope_theta": theta,
            "factor": m.float("rope.scaling.factor"),
        }
    if kind == "yarn":
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": m.float("rope.scaling.factor"),
            "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
        }
        for key, hf in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.yarn_ext_factor", "extrapolation_factor"),
            ("rope.scaling.attn_factor", "attention_factor"),
        ):
            if m.get(key) is not None:
                params[hf] = m.float(key)
        return params
    raise ModelLoadError(f"GGUF: {m.arch}.rope.scaling.type {show(kind)} is not supported")


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 `rope_parameters` whose factors (convert_hf_to_gguf's LlamaModel
    `generate_extra_tensors`) are `factors`, checked to give back every one of them in
    float32, else the file's RoPE is refused rather than computed otherwise.

    `factor` is the largest. In the smooth band 1/f = (1 - s)/factor + s with
    s = (L/wavelen - low)/(high - low), linear in 1/wavelen; the factors depend only on the
    ratios low/L and high/L, where s is 0 and 1, so low is taken as 1 (every released config
    has it) and L, high follow. Released values are tried first (Llama 3.1's and 3.2's)."""
    factors = np.asarray(factors, np.float64)
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    freqs = freqs.astype(np.float32).astype(np.float64)  # the converter's float32 torch
    if factors.shape != freqs.shape:
        raise ModelLoadError(
            f"GGUF: rope_freqs has {factors.size} factors for {head_dim // 2} frequencies"
        )
    factor = float(factors.max())
    candidates: list[tuple[float, float, float]] = [(1.0, 4.0, 8192.0)]
    band = (factors > 1.0) & (factors < factor)
    if factor > 1.0 and band.sum() >= 2:
        s = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
        wavelen = 2 * math.pi / freqs[band]
        slope, intercept = np.polyfit(1.0 / wavelen, s, 1)
        if slope > 0 and intercept < 0:
            context = -1.0 / intercept * slope  # s = 0 at 1/wavelen = low/L = 1/L
            high = 1.0 + slope / context  # s = 1 at 1/wavelen = high/L
            candidates.append((1.0, float(round(high, 6)), float(round(context))))
    elif factor > 1.0:  # too few frequencies to see the band: high = 4, L to fit
        wavelen = 2 * math.pi / freqs
        if band.sum() == 1:  # s = (L / w - 1) / 3 at the one band frequency
            w = float(wavelen[band][0])
            s1 = (1.0 / float(factors[band][0]) - 1.0 / factor) / (1.0 - 1.0 / factor)
            context = w * (1.0 + 3.0 * s1)
            candidates += [(1.0, 4.0, float(round(context))), (1.0, 4.0, context)]
        else:  # L between the factor-1 wavelengths (times 4) and the scaled ones
            below = 4.0 * float(wavelen[factors == 1.0].max(initial=0.0))
            above = float(wavelen[factors == factor].min(initial=math.inf))
            if below < above:
                candidates.append((1.0, 4.0, float(2 ** math.ceil(math.log2(below + 1)))))
    for low, high, context in candidates:
        got = _llama3_factors(freqs, factor, low, high, context)
        if np.array_equal(got.astype(np.float32), factors.astype(np.float32)):
            return {
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(context)
                if context == int(context)
                else context,
            }
    raise ModelLoadError("GGUF: rope_freqs is not a llama3 RoPE the runner can reproduce")


def _llama3_factors(
    freqs: np.ndarray, factor: float, low: float, high: float, context: float
) -> np.ndarray:
    """convert_hf_to_gguf's factors for these parameters (its float64 Python arithmetic)."""
    low_wavelen, high_wavelen = context / low, context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _llama_like(
    m: Meta, names: list[str], rope_freqs: np.ndarray | None, architecture: str, model_type: str
) -> Plan:
    """llama and mistral3: Q/K rows permuted by the converter."""
    c = _common(m, architecture, model_type)
    c["rope_parameters"] = _rope(m, rope_freqs, c["head_dim"])
    c["tie_word_embeddings"] = "output.weight" not in names
    c["attention_bias"] = any(n.endswith("attn_q.bias") for n in names)
    c["mlp_bias"] = False
    heads, kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def transform(hf: str, part: str, layer: int | None) -> Target:
        if part in ("attn_q.weight", "attn_q.bias"):
            return Target(hf, rows=unpermute_rows(heads * head_dim, heads))
        if part in ("attn_k.weight", "attn_k.bias"):
            return Target(hf, rows=unpermute_rows(kv_heads * head_dim, kv_heads))
        return Target(hf)

    targets = _targets(names, LLAMA_BLOCK, transform=transform, consumed=("rope_freqs.weight",))
    return Plan(c, targets)


def _qwen(m: Meta, names: list[str], architecture: str, model_type: str) -> Plan:
    """qwen2 and qwen3: no permutation (the converter writes them as they are)."""
    c = _common(m, architecture, model_type)
    c["rope_parameters"] = _rope(m, None, c["head_dim"])
    c["tie_word_embeddings"] = "output.weight" not in names
    block = dict(LLAMA_BLOCK)
    if model_type == "qwen3":
        block |= {
            "attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight",
        }
        c["attention_bias"] = any(n.endswith("attn_q.bias") for n in names)
    return Plan(c, _targets(names, block))


Planner = Callable[[Meta, list[str], Callable[[str], np.ndarray]], Plan]

ARCHITECTURES: dict[str, Planner] = {
    "llama": lambda m, names, read: _llama_like(
        m,
        names,
        read("rope_freqs.weight") if "rope_freqs.weight" in names else None,
        "LlamaForCausalLM",
        "llama",
    ),
    "qwen2": lambda m, names, read: _qwen(m, names, "Qwen2ForCausalLM", "qwen2"),
    "qwen3": lambda m, names, read: _qwen(m, names, "Qwen3ForCausalLM", "qwen3"),
}


def plan(
    metadata: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
) -> Plan:
    """The checkpoint config and tensor targets of a GGUF model: `shapes` its tensors'
    (numpy order), `read(name)` a small tensor's float32 values, for the tensors a config
    is made from (`rope_freqs`)."""
    m = Meta(metadata, shapes)
    planner = ARCHITECTURES.get(m.arch)
    if planner is None:
        served = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(f"unsupported GGUF architecture: {m.arch} (served: {served})")
    return planner(m, list(shapes), read)
