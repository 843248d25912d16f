"""Tiny GGUF models for the GGUF loading tests, written as llama.cpp's converter
(convert_hf_to_gguf.py) writes them: from a tiny checkpoint directory (tests/tiny.py), its
config as the converter's metadata keys, its tokenizer as `tokenizer.ggml.*`, its tensors
under GGUF names with the converter's changes (Q/K rows permuted for llama, norms stored
as 1 + w for Gemma), each tensor stored in the GGML type a rule gives it (quantized by the
gguf package where it can quantize that type).

`checkpoint_of(gguf_path, like)` writes the checkpoint the GGUF's stored values are: the
dequantized tensors (gguf-py's values, llama.cpp's) with the converter's changes undone, the
config and tokenizer of `like`: what the GGUF model must compute.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file

from runner.sources.gguf.architectures import unpermute_rows

# checkpoint name (under model.layers.N.) -> GGUF block name, per architecture
LLAMA_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
PERMUTED = {"llama"}  # Q/K rows permuted by the converter

Rule = Callable[[str, tuple[int, ...]], "gguf.GGMLQuantizationType"]


def float32(name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType.F32


def mixed(name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
    """A quantized file's mix, as llama.cpp's quantizer makes one: norms and biases F32,
    the embedding Q8_0, attention Q4_0 / Q5_0 / Q4_1, the MLP Q5_1 and Q8_0, the head F16,
    each where its rows divide into the type's blocks (else F16)."""
    t = gguf.GGMLQuantizationType
    if len(shape) < 2:
        return t.F32
    by_name = [
        ("token_embd", t.Q8_0),
        ("attn_q.", t.Q4_0),
        ("attn_k.", t.Q5_0),
        ("attn_v.", t.Q4_1),
        ("attn_output", t.Q8_0),
        ("ffn_gate", t.Q5_1),
        ("ffn_up", t.Q4_0),
        ("ffn_down", t.Q8_0),
        ("output.", t.F16),
    ]
    chosen = next((q for key, q in by_name if key in name), t.F16)
    block = gguf.GGML_QUANT_SIZES[chosen][0]
    return chosen if shape[-1] % block == 0 else t.F16


def write_gguf(model_dir: Path, out: Path, rule: Rule = float32) -> Path:
    """The GGUF llama.cpp's converter would write for the tiny checkpoint in `model_dir`,
    each tensor stored as `rule` says."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0}
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    elif rope["rope_type"] != "default":
        raise NotImplementedError(rope["rope_type"])
    _tokenizer(writer, model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    for name, array in sorted(weights.items()):
        gname = _gguf_name(name)
        values = array.astype(np.float32)
        if arch in PERMUTED and gname.endswith(("attn_q.weight", "attn_q.bias")):
            values = _permute(values, heads)
        if arch in PERMUTED and gname.endswith(("attn_k.weight", "attn_k.bias")):
            values = _permute(values, kv_heads)
        kind = rule(gname, values.shape)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gname, values)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gname, values.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def checkpoint_of(gguf_path: Path, like: Path, out: Path) -> Path:
    """The checkpoint whose weights are the GGUF's stored values (gguf-py's dequantization,
    the converter's changes undone), with `like`'s config and tokenizer."""
    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(reader.fields["general.architecture"].contents())
    config = json.loads((like / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    names = {v: k for k, v in TOP.items()}
    weights = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        values = np.asarray(values, np.float32).reshape([int(d) for d in reversed(t.shape)])
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if match:
            block = {v: k for k, v in LLAMA_BLOCK.items()}[match.group(2)]
            name = f"model.layers.{match.group(1)}.{block}"
        else:
            name = names[t.name]
        if arch in PERMUTED and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            values = values[unpermute_rows(heads * head_dim, heads)]
        if arch in PERMUTED and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            values = values[unpermute_rows(kv_heads * head_dim, kv_heads)]
        weights[name] = np.ascontiguousarray(values)
    out.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like / file, out / file)
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
    return out


def _gguf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    assert match, name
    return f"blk.{match.group(1)}.{LLAMA_BLOCK[match.group(2)]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `LlamaModel.permute`."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _llama3_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's `rope_freqs` for a llama3 RoPE (LlamaModel.generate_extra_tensors)."""
    import math

    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """A byte-level BPE tokenizer.json as the converter's `_set_vocab_gpt2` writes it."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    size = max([*vocab.values(), *(t["id"] for t in added.values())]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for text, token in added.items():
        tokens[token["id"]] = text
        types[token["id"]] = (
            gguf.TokenType.CONTROL if token.get("special") else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_bos_token_id(ids[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(ids[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
