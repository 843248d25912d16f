"""GGUF architectures onto the families the runner serves: a GGUF file's metadata becomes the
config.json transformers 5 would write for the same model, and each of its tensors the
checkpoint tensor it came from, undoing what llama.cpp's converter (convert_hf_to_gguf.py,
its conversion/*.py classes) did to it. The families (runner/models/) then load them as they
load a checkpoint, so a GGUF model computes what the same weights as safetensors compute.

What the converter does, and what undoes it here (where the metadata says nothing, the value
is the one llama.cpp's own loader, src/models/<arch>.cpp, assumes):
- llama, mistral3: Q and K rows permuted from the rotate-half layout to llama.cpp's
  interleaved one, per head (`LlamaModel.permute`): the inverse row permutation, which
  applies to a quantized tensor's rows as well (blocks run along a row). llama's llama3 RoPE
  is written as `rope_freqs`, the per-frequency factors; the llama3 parameters are found
  again from them and checked to give back every factor.
- mistral3 (`Ministral3Model`): a Ministral 3 (`model_type` ministral3) writes yarn with
  `yarn_log_multiplier` = mscale_all_dim (llama.cpp takes mscale as 1) and
  `attention.temperature_scale` = llama_4_scaling_beta: Ministral3ForCausalLM. Without the
  temperature (Mistral Small 3.x's text model) it is MistralForCausalLM, unwindowed.
- gemma2, gemma3: every RMSNorm weight stored as 1 + w (llama.cpp multiplies by it; the
  transformers model adds the 1): w = stored - 1, in float32. query_pre_attn_scalar is not
  written: llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) for the 27B
  models (46 and 62 layers), which is what their configs say. Layer kinds come from
  `attention.sliding_window_pattern` (an array of flags or a period), else llama.cpp's
  period (2, 6), the last layer of each period global. gemma2 writes no RoPE base (10000);
  gemma3 writes the global base and scaling, and the local base as `rope.freq_base_swa`.
  gemma3 drops the embedding rows past the tokenizer's vocabulary (the config's vocab_size
  is the rows kept). Ollama's published gemma3 files spell the bases `rope.global.freq_base`
  and `rope.local.freq_base`, may omit the epsilon (1e-6) and the 4B-27B models' linear
  scaling (8 where the context is 131072), and embed the vision tower (`v.*`, `mm.*`),
  which is left unloaded here, said in a log line: these load as Gemma3ForCausalLM.
- qwen3moe: each layer's experts stacked into [E, out, in] (`ffn_{gate,up,down}_exps`):
  mlx-lm's stacked expert names, which runner/models/moe.py passes through. Its loader has
  no dense layers (mlp_only_layers) and always renormalises the top-k weights.
- phi3: the checkpoint's fused `qkv_proj` and `gate_up_proj` kept fused (`attn_qkv`,
  `ffn_up`); longrope written as `rope_factors_long`/`rope_factors_short` tensors, the
  partial rotation as `rope.dimension_count`, the attention factor as
  `rope.scaling.attn_factor` (kept only where it is not transformers' own from the
  contexts). A `sliding_window` of 0 means none.
- gpt-oss: gate_up_proj de-interleaved and split into `ffn_gate_exps` / `ffn_up_exps`, all
  experts transposed output-major ([E, out, in]), as mlx-lm's switch layers hold them, so
  they pass through (an MXFP4 checkpoint's blocks repacked losslessly: MLX's mxfp4); sinks
  as `attn_sinks`. llama.cpp fixes the clamped SwiGLU's alpha 1.702 and limit 7 and the
  alternating window pattern; yarn is computed untruncated, as transformers' GptOss config
  (`truncate: false`) and OpenAI's reference do. Ollama's own gpt-oss files (`gptoss`)
  spell `attn_out`, `attn_sinks` and `ffn_norm` for the post-attention norm.
- tied heads: `output.weight` absent.

- fused Q/K/V (`attn_qkv`, llama.cpp's `--fuse-qkv`, and Ollama's gpt-oss, converted from
  OpenAI's original checkpoint whose `attn.qkv` is one tensor) where the checkpoint has three
  projections: Q's, K's and V's row ranges (after the permutation, for llama's).

Not mapped (a ModelLoadError names the tensor): `ffn_gate_up_exps` (`--fuse-gate-up-exps`),
[E, 2I, H], whose gate and up halves lie along the second axis, where a `Target`'s rows
select along the first.

`plan(metadata, tensor_names)` returns the config and, per GGUF tensor, where it goes (a
`Target`, or several for a fused tensor: each its rows of it), or None for a tensor the
config has consumed (`rope_freqs`, Phi-3's rope factors) or that is left unloaded (an
embedded vision tower); a tensor it does not know, or an architecture it does not serve, is a
ModelLoadError naming it.
"""

from __future__ import annotations

import builtins
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runner.sources.source import ModelLoadError, show

log = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


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
    # GGUF name -> target (several: a fused tensor's row ranges); None: consumed or unloaded
    targets: dict[str, Target | tuple[Target, ...] | None]
    notes: list[str] = field(default_factory=list)


class Meta:
    """A GGUF file's metadata under its architecture's prefix, read with checks. `aliases`
    maps a key to the other spellings files use for it (tried in order after it)."""

    def __init__(
        self,
        metadata: Mapping[str, Any],
        shapes: Mapping[str, tuple[int, ...]],
        aliases: Mapping[str, tuple[str, ...]] | None = None,
    ):
        self.metadata, self.shapes = metadata, shapes
        self.aliases = dict(aliases or {})
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelLoadError("GGUF: general.architecture is missing")
        self.arch = arch

    def key(self, key: str) -> str:
        """The full name of `key` (or of the first alias the file has)."""
        for k in (key, *self.aliases.get(key, ())):
            if f"{self.arch}.{k}" in self.metadata:
                return f"{self.arch}.{k}"
        return f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self.key(key) in self.metadata

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}` (or an alias of it), else `default`."""
        return self.metadata.get(self.key(key), default)

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            if value is None:
                raise ModelLoadError(f"GGUF: {self.key(key)} is missing")
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ModelLoadError(f"GGUF: {self.key(key)} must be {what}, not {show(value)}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            if value is None:
                raise ModelLoadError(f"GGUF: {self.key(key)} is missing")
            raise ModelLoadError(f"GGUF: {self.key(key)} must be a number, not {show(value)}")
        return float(value)

    def decimal(self, key: str, default: builtins.float | None = None) -> builtins.float:
        """A float the converter wrote as float32 from a config's decimal: the shortest
        decimal that is the same float32 (0.1, not 0.10000000149), as the config had it."""
        return decimal(self.float(key, default))


def decimal(value: float) -> float:
    """The shortest decimal whose float32 is `value`'s float32 (`value` itself if it is no
    float32)."""
    single = np.float32(value)
    return float(str(single)) if float(single) == value else value


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
QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's four norms: llama.cpp's attn_norm, post_attention_norm, ffn_norm, post_ffw_norm
GEMMA_BLOCK = {
    **LLAMA_BLOCK,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Stacked experts [E, out, in] and the router
EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# An embedded vision tower and projector (Ollama's gemma3 and mistral3 files).
VISION_PREFIXES = ("v.", "mm.")
# Fused tensors no mapping splits, and why (one GGUF tensor, several checkpoint tensors whose
# rows are not rows of it: the experts' gate/up concatenated along each expert's rows).
_FUSED = {
    "ffn_gate_up_exps.weight": "fused expert gate/up projections (ffn_gate_up_exps)",
    "ffn_gate_up_exps.bias": "fused expert gate/up projections (ffn_gate_up_exps)",
}
QKV = ("attn_qkv.weight", "attn_qkv.bias")


def _targets(
    names: list[str],
    block: Mapping[str, str],
    top: Mapping[str, str] = TOP,
    transform: Callable[[str, str, int | None], Target] | None = None,
    consumed: tuple[str, ...] = (),
    unloaded: tuple[str, ...] = (),
    qkv: tuple[int, int, int] | None = None,
) -> dict[str, Target | tuple[Target, ...] | None]:
    """Each GGUF tensor's target; `qkv`: the rows of Q, K and V, where a fused `attn_qkv`
    (llama.cpp's --fuse-qkv, Ollama's gpt-oss) goes to the block's three projections."""
    out: dict[str, Target | tuple[Target, ...] | None] = {}
    for name in names:
        if name in consumed or name.startswith(unloaded):
            out[name] = None
            continue
        match = _BLOCK.fullmatch(name)
        if match:
            layer, part = int(match.group(1)), match.group(2)
            if part in QKV and part not in block and qkv is not None:
                out[name] = _split_qkv(layer, part, block, qkv, transform)
                continue
            if part not in block:
                if part in _FUSED:
                    raise ModelLoadError(
                        f"GGUF: tensor {name} is {_FUSED[part]}, which the runner does not "
                        "split (convert without --fuse-gate-up-exps)"
                    )
                raise ModelLoadError(f"GGUF: tensor {name} is not one the runner maps")
            hf = f"model.layers.{layer}.{block[part]}"
        elif name in top:
            layer, part, hf = None, name, top[name]
        else:
            raise ModelLoadError(f"GGUF: tensor {name} is not one the runner maps")
        out[name] = transform(hf, part, layer) if transform else Target(hf)
    return out


def _split_qkv(
    layer: int,
    part: str,
    block: Mapping[str, str],
    qkv: tuple[int, int, int],
    transform: Callable[[str, str, int | None], Target] | None,
) -> tuple[Target, ...]:
    """A fused Q/K/V tensor as the block's Q, K and V: its row ranges, in that order (base
    ModelBase.modify_tensors concatenates them after LlamaModel's permutation, so a Q or K
    transform's rows apply within its range)."""
    suffix = part.removeprefix("attn_qkv")
    parts, offset = [], 0
    for projection, rows in zip(("attn_q", "attn_k", "attn_v"), qkv, strict=True):
        sub = projection + suffix
        hf = f"model.layers.{layer}.{block[sub]}"
        target = transform(hf, sub, layer) if transform else Target(hf)
        own = target.rows if target.rows is not None else np.arange(rows)
        parts.append(Target(target.name, offset + own, target.minus_one))
        offset += rows
    return tuple(parts)


def _qkv_rows(m: Meta, c: dict[str, Any]) -> tuple[int, int, int]:
    """The rows of Q, K and V in a fused attn_qkv."""
    value_dim = m.int("attention.value_length", c["head_dim"])
    kv_heads = c["num_key_value_heads"]
    rows = (
        c["num_attention_heads"] * c["head_dim"],
        kv_heads * c["head_dim"],
        kv_heads * value_dim,
    )
    for name, shape in m.shapes.items():
        if name.endswith(QKV) and name.startswith("blk.") and shape[0] != sum(rows):
            raise ModelLoadError(
                f"GGUF: tensor {name} has {shape[0]} rows, not Q, K and V's {sum(rows)}"
            )
    return rows


def _unloaded_vision(names: list[str], m: Meta) -> list[str]:
    """The embedded vision tensors (`v.*`, `mm.*`), said in a log line: the runner loads the
    text model of such a file (images are refused, as for any model without media)."""
    vision = [n for n in names if n.startswith(VISION_PREFIXES)]
    if vision:
        note = (
            f"GGUF {m.arch}: the file's {len(vision)} vision tensors (v.*, mm.*) are left "
            "unloaded; its text model is served, without images"
        )
        log.warning("%s", note)
        return [note]
    return []


def _common(
    m: Meta, architecture: str, model_type: str, eps_default: float = 1e-5
) -> dict[str, Any]:
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
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", eps_default),
        "max_position_embeddings": m.int("context_length", 4096),
    }


def _tied(c: dict[str, Any], names: list[str]) -> None:
    c["tie_word_embeddings"] = "output.weight" not in names


def _rope(
    m: Meta,
    rope_freqs: np.ndarray | None,
    head_dim: int,
    default_type: str = "none",
    default_factor: float | None = None,
) -> dict[str, Any]:
    """transformers 5's `rope_parameters` from the metadata (and llama's `rope_freqs`); a
    file without a scaling type has `default_type`, without a factor `default_factor`."""
    theta = m.decimal("rope.freq_base", 10000.0)
    kind = m.get("rope.scaling.type", default_type)
    if rope_freqs is not None:
        return llama3_rope(rope_freqs, theta, head_dim)
    if kind in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {
            "rope_type": "linear",
            "rope_theta": theta,
            "factor": m.decimal("rope.scaling.factor", default_factor),
        }
    if kind == "yarn":
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": m.decimal("rope.scaling.factor", default_factor),
            "original_max_position_embeddings": m.int("rope.scaling.original_context_length"),
        }
        for key, hf in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.yarn_ext_factor", "extrapolation_factor"),
            ("rope.scaling.attn_factor", "attention_factor"),
        ):
            if m.get(key) is not None:
                params[hf] = m.decimal(key)
        # llama.cpp's attention factor from `yarn_log_multiplier` (mscale_all_dim), mscale
        # taken as 1 (llama-context.cpp); absent or 0: transformers' default, as llama.cpp's
        log_mul = m.get("rope.scaling.yarn_log_multiplier")
        if log_mul is not None and m.float("rope.scaling.yarn_log_multiplier") != 0:
            params["mscale"] = 1.0
            params["mscale_all_dim"] = m.decimal("rope.scaling.yarn_log_multiplier")
        return params
    raise ModelLoadError(f"GGUF: {m.key('rope.scaling.type')} {show(kind)} is not supported")


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 `rope_parameters` whose factors (convert_hf_to_gguf's LlamaModel
    `generate_extra_tensors`) are `factors`, checked to give back every one of them within
    the rounding of the converter's float32 torch arithmetic (a relative 1e-5), else the
    file's RoPE is refused rather than computed otherwise.

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
        if np.allclose(got, factors, rtol=1e-5, atol=0.0):
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
    """convert_hf_to_gguf's factors for these parameters, in float64 (the converter's own
    float32 torch arithmetic differs from these in the last bits)."""
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


def _layer_kinds(m: Meta, n: int, period: int) -> list[str]:
    """Sliding and full layers as llama.cpp's `load_swa_pattern` reads them: the
    `attention.sliding_window_pattern` flags (true: sliding), or its period, else `period`;
    in a period every layer but the last slides (a period of 0: every layer)."""
    pattern = m.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n or not all(isinstance(p, bool) for p in pattern):
            raise ModelLoadError(
                f"GGUF: {m.key('attention.sliding_window_pattern')} must be {n} flags, "
                f"not {show(pattern)}"
            )
        return [SLIDING if p else FULL for p in pattern]
    if pattern is not None:
        period = m.int("attention.sliding_window_pattern", minimum=0)
    return [SLIDING if period == 0 or i % period < period - 1 else FULL for i in range(n)]


def _permuting(
    heads: int, kv_heads: int, head_dim: int
) -> Callable[[str, str, int | None], Target]:
    """The transform undoing `LlamaModel.permute` of Q and K rows (weights and biases)."""

    def transform(hf: str, part: str, layer: int | None) -> Target:
        if part in ("attn_q.weight", "attn_q.bias"):
            return Target(hf, rows=unpermute_rows(heads * head_dim, heads))
        if part in ("attn_k.weight", "attn_k.bias"):
            return Target(hf, rows=unpermute_rows(kv_heads * head_dim, kv_heads))
        return Target(hf)

    return transform


def _llama_like(
    m: Meta, names: list[str], rope_freqs: np.ndarray | None, architecture: str, model_type: str
) -> Plan:
    """llama: Q/K rows permuted by the converter."""
    c = _common(m, architecture, model_type)
    c["rope_parameters"] = _rope(m, rope_freqs, c["head_dim"])
    _tied(c, names)
    c["attention_bias"] = any(n.endswith(("attn_q.bias", "attn_qkv.bias")) for n in names)
    c["mlp_bias"] = False
    transform = _permuting(c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    targets = _targets(
        names,
        LLAMA_BLOCK,
        transform=transform,
        consumed=("rope_freqs.weight",),
        qkv=_qkv_rows(m, c),
    )
    return Plan(c, targets)


# Ollama's mistral3 files spell the yarn keys and the temperature as transformers does.
MISTRAL3_ALIASES = {
    "rope.scaling.yarn_beta_fast": ("rope.scaling.beta_fast",),
    "rope.scaling.yarn_beta_slow": ("rope.scaling.beta_slow",),
    "rope.scaling.yarn_log_multiplier": ("rope.scaling.mscale_all_dim",),
    "attention.temperature_scale": ("rope.scaling_beta",),
}


def _mistral3(m: Meta, names: list[str]) -> Plan:
    """mistral3: Ministral 3 (yarn and the llama 4 query temperature) or Mistral Small 3.x's
    text model (neither), Q/K rows permuted as llama's; no sliding windows (llama.cpp's
    mistral3 has none)."""
    temperature = m.get("attention.temperature_scale")
    if temperature is None:
        c = _common(m, "MistralForCausalLM", "mistral")
        c["rope_parameters"] = _rope(m, None, c["head_dim"])
    else:
        c = _common(m, "Ministral3ForCausalLM", "ministral3")
        rope = _rope(m, None, c["head_dim"])
        if rope["rope_type"] != "yarn":
            raise ModelLoadError(
                f"GGUF: {m.key('attention.temperature_scale')} without yarn RoPE is not a "
                "Ministral 3 the runner knows"
            )
        c["rope_parameters"] = rope | {
            "llama_4_scaling_beta": m.decimal("attention.temperature_scale")
        }
    c["sliding_window"] = None
    _tied(c, names)
    transform = _permuting(c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    targets = _targets(
        names, LLAMA_BLOCK, transform=transform, unloaded=VISION_PREFIXES, qkv=_qkv_rows(m, c)
    )
    return Plan(c, targets, _unloaded_vision(names, m))


def _qwen(m: Meta, names: list[str], architecture: str, model_type: str) -> Plan:
    """qwen2 and qwen3: no permutation (the converter writes them as they are)."""
    c = _common(m, architecture, model_type)
    c["rope_parameters"] = _rope(m, None, c["head_dim"])
    _tied(c, names)
    block = dict(LLAMA_BLOCK)
    if model_type == "qwen3":
        block |= QK_NORMS
        c["attention_bias"] = any(n.endswith(("attn_q.bias", "attn_qkv.bias")) for n in names)
    return Plan(c, _targets(names, block, qkv=_qkv_rows(m, c)))


def _qwen3moe(m: Meta, names: list[str]) -> Plan:
    """qwen3moe: Qwen3's attention, experts on every layer (llama.cpp's loader has no dense
    ones), the top-k weights renormalised (its graph always does)."""
    c = _common(m, "Qwen3MoeForCausalLM", "qwen3_moe")
    c["rope_parameters"] = _rope(m, None, c["head_dim"])
    _tied(c, names)
    c |= {
        "attention_bias": any(n.endswith(("attn_q.bias", "attn_qkv.bias")) for n in names),
        "hidden_act": "silu",
        "num_local_experts": m.int("expert_count"),
        "num_experts_per_tok": m.int("expert_used_count"),
        "moe_intermediate_size": m.int("expert_feed_forward_length"),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }
    block = {k: v for k, v in LLAMA_BLOCK.items() if not k.startswith("ffn_")}
    block |= {"ffn_norm.weight": "post_attention_layernorm.weight", **QK_NORMS, **EXPERTS}
    return Plan(c, _targets(names, block, qkv=_qkv_rows(m, c)))


GEMMA3_ALIASES = {
    "rope.freq_base": ("rope.global.freq_base",),
    "rope.freq_base_swa": ("rope.local.freq_base",),
}


def _ollama_gemma3(m: Meta, names: list[str]) -> bool:
    """llama.cpp's reading of Ollama's own gemma3 files (ollama's
    llama/compat/llama-ollama-compat.cpp `detect_ollama_gemma3`)."""
    keys = ("mm.tokens_per_image", "rope.global.freq_base", "rope.local.freq_base")
    return (
        any(f"gemma3.{k}" in m.metadata for k in keys)
        or any(n.startswith(VISION_PREFIXES) for n in names)
        or any(
            f"tokenizer.ggml.{k}" in m.metadata for k in ("add_padding_token", "add_unknown_token")
        )
        or "gemma3.attention.layer_norm_rms_epsilon" not in m.metadata
    )


def _gemma(m: Meta, names: list[str], version: int) -> Plan:
    """gemma2 and gemma3: norms stored as 1 + w, queries scaled as llama.cpp scales them,
    layer kinds by the window pattern (see the module's docstring)."""
    architecture = f"Gemma{version}ForCausalLM"
    c = _common(m, architecture, "gemma2" if version == 2 else "gemma3_text", 1e-6)
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    large = 46 if version == 2 else 62  # llama.cpp's 27B: 1/sqrt(hidden / heads)
    c["query_pre_attn_scalar"] = c["hidden_size"] // heads if n == large else c["head_dim"]
    c["hidden_activation"] = "gelu_pytorch_tanh"
    c["attention_bias"] = False
    _tied(c, names)
    if version == 2:
        theta = m.decimal("rope.freq_base", 10000.0)
        if m.has("rope.freq_base_swa") and m.decimal("rope.freq_base_swa") != theta:
            raise ModelLoadError(
                f"GGUF: {m.key('rope.freq_base_swa')} differs from the global base, which "
                "Gemma2ForCausalLM cannot express"
            )
        c["rope_parameters"] = _rope(m, None, c["head_dim"])
        c["sliding_window"] = m.int("attention.sliding_window", 4096)
        c["layer_types"] = _layer_kinds(m, n, 2)
        c["attn_logit_softcapping"] = m.decimal("attn_logit_softcapping", 50.0)
        c["final_logit_softcapping"] = m.decimal("final_logit_softcapping", 30.0)
    else:
        if _ollama_gemma3(m, names) and c["max_position_embeddings"] >= 131072:
            # Ollama's files without their 4B-27B scaling: llama.cpp injects it
            full = _rope(m, None, c["head_dim"], "linear", 8.0)
        else:
            full = _rope(m, None, c["head_dim"])
        local = {"rope_type": "default", "rope_theta": m.decimal("rope.freq_base_swa", 10000.0)}
        c["rope_parameters"] = {FULL: full, SLIDING: local}
        window = m.int("attention.sliding_window", 0, minimum=0)
        c["sliding_window"] = window or None
        c["layer_types"] = _layer_kinds(m, n, 6) if window else [FULL] * n
        cap = m.get("final_logit_softcapping")
        c["final_logit_softcapping"] = m.decimal("final_logit_softcapping") if cap else None
        c["attn_logit_softcapping"] = None
        c["use_bidirectional_attention"] = False

    def transform(hf: str, part: str, layer: int | None) -> Target:
        return Target(hf, minus_one=part.endswith("norm.weight"))

    block = GEMMA_BLOCK | (QK_NORMS if version == 3 else {})
    unloaded = VISION_PREFIXES if version == 3 else ()
    targets = _targets(names, block, transform=transform, unloaded=unloaded, qkv=_qkv_rows(m, c))
    notes = _unloaded_vision(names, m) if version == 3 else []
    return Plan(c, targets, notes)


def _phi3(m: Meta, names: list[str], read: Callable[[str], np.ndarray]) -> Plan:
    """phi3: fused projections as the checkpoint has them; longrope from its factor tensors,
    partial rotation from `rope.dimension_count`."""
    c = _common(m, "Phi3ForCausalLM", "phi3")
    head_dim = c["head_dim"]
    rotated = m.int("rope.dimension_count", head_dim)
    if rotated > head_dim or rotated % 2:
        raise ModelLoadError(
            f"GGUF: {m.key('rope.dimension_count')} {rotated} for heads of {head_dim}"
        )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": m.decimal("rope.freq_base", 10000.0),
    }
    if rotated != head_dim:
        rope["partial_rotary_factor"] = rotated / head_dim
    if m.get("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(
            f"GGUF: {m.key('rope.scaling.type')} {show(m.get('rope.scaling.type'))} is not "
            "a Phi-3 RoPE (longrope comes as rope_factors_long/short)"
        )
    factors = ("rope_factors_long.weight", "rope_factors_short.weight")
    if any(f in names for f in factors):
        long, short = ([decimal(float(x)) for x in read(f).reshape(-1)] for f in factors)
        if len(long) != rotated // 2 or len(short) != rotated // 2:
            raise ModelLoadError(
                f"GGUF: rope_factors_long/short have {len(long)}/{len(short)} factors for "
                f"{rotated // 2} rotated frequencies"
            )
        context = c["max_position_embeddings"]
        original = m.int("rope.scaling.original_context_length", context)
        rope |= {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": original,
        }
        c["original_max_position_embeddings"] = original
        # transformers' attention factor from the contexts, unless the file's differs
        scale = context / original
        own = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        stored = m.get("rope.scaling.attn_factor")
        if stored is not None and np.float32(m.float("rope.scaling.attn_factor")) != np.float32(
            own
        ):
            rope["attention_factor"] = m.decimal("rope.scaling.attn_factor")
    c["rope_parameters"] = rope
    c["hidden_act"] = "silu"
    c["sliding_window"] = m.int("attention.sliding_window", 0, minimum=0) or None
    _tied(c, names)
    block = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    return Plan(c, _targets(names, block, consumed=factors))


# Ollama's gpt-oss files (architecture `gptoss`) name three tensors their own way.
GPT_OSS_BLOCK = {
    **LLAMA_BLOCK,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_sinks": "self_attn.sinks",
    "attn_out.weight": "self_attn.o_proj.weight",
    "attn_out.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{
        f"ffn_{p}_exps.{part}": f"mlp.experts.{p}_proj.{part}"
        for p in ("gate", "up", "down")
        for part in ("weight", "bias")
    },
}
for _dense in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
    del GPT_OSS_BLOCK[_dense]


def _gpt_oss(m: Meta, names: list[str]) -> Plan:
    """gpt-oss (and Ollama's `gptoss`): sinks, experts with biases, alternating windows,
    yarn untruncated; the clamped SwiGLU's constants are llama.cpp's."""
    c = _common(m, "GptOssForCausalLM", "gpt_oss")
    gate = m.shapes.get("blk.0.ffn_gate_exps.weight")
    experts_ff = gate[1] if gate is not None and len(gate) == 3 else None
    c["intermediate_size"] = m.int("expert_feed_forward_length", experts_ff)
    rope = _rope(m, None, c["head_dim"], default_type="yarn")
    if rope["rope_type"] != "yarn":
        raise ModelLoadError(f"GGUF: gpt-oss with {rope['rope_type']} RoPE is not supported")
    rope.setdefault("beta_fast", 32.0)
    rope.setdefault("beta_slow", 1.0)
    c["rope_parameters"] = rope | {"truncate": False}
    c["sliding_window"] = m.int("attention.sliding_window")
    c["layer_types"] = _layer_kinds(m, c["num_hidden_layers"], 2)
    c |= {
        "num_local_experts": m.int("expert_count"),
        "num_experts_per_tok": m.int("expert_used_count"),
        "attention_bias": any(n.endswith(("attn_q.bias", "attn_qkv.bias")) for n in names),
        "hidden_act": "silu",
        "swiglu_alpha": 1.702,  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
        "swiglu_limit": 7.0,
    }
    _tied(c, names)
    return Plan(c, _targets(names, GPT_OSS_BLOCK, qkv=_qkv_rows(m, c)))


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
    "qwen3moe": lambda m, names, read: _qwen3moe(m, names),
    "gemma2": lambda m, names, read: _gemma(m, names, 2),
    "gemma3": lambda m, names, read: _gemma(m, names, 3),
    "phi3": _phi3,
    "mistral3": lambda m, names, read: _mistral3(m, names),
    "gpt-oss": lambda m, names, read: _gpt_oss(m, names),
    "gptoss": lambda m, names, read: _gpt_oss(m, names),
}
ALIASES: dict[str, Mapping[str, tuple[str, ...]]] = {
    "gemma3": GEMMA3_ALIASES,
    "mistral3": MISTRAL3_ALIASES,
}


def plan(
    metadata: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
) -> Plan:
    """The checkpoint config and tensor targets of a GGUF model: `shapes` its tensors'
    (numpy order), `read(name)` a small tensor's float32 values, for the tensors a config
    is made from (`rope_freqs`, Phi-3's rope factors)."""
    arch = metadata.get("general.architecture")
    m = Meta(metadata, shapes, ALIASES.get(arch) if isinstance(arch, str) else None)
    planner = ARCHITECTURES.get(m.arch)
    if planner is None:
        served = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(f"unsupported GGUF architecture: {m.arch} (served: {served})")
    return planner(m, list(shapes), read)
