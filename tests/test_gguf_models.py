"""GGUF model files load as the checkpoints they came from (runner/sources/gguf/model.py,
architectures.py): a tiny checkpoint written as llama.cpp's converter writes it, float32 or
in a quantized file's mix of types, computes what the checkpoint of its stored values
(gguf-py's dequantization, llama.cpp's) computes through the runner's directory loader,
and, for Llama, what a float64 numpy forward of those values computes."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from runner.models import build_model
from runner.sources.gguf.model import load_gguf
from runner.sources.loader import load_local_dir
from tests.gguf_models import checkpoint_of, float32, mixed, write_gguf
from tests.tiny import tiny_config, write_tiny_model

SEQUENCE = [5, 17, 42, 99, 3, 250, 7, 8, 61, 120, 33]
ARCHES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
# What a GGUF of the architecture cannot say: llama.cpp's qwen2 has no sliding windows.
GGUF_CANNOT = {
    "Qwen2ForCausalLM": {"use_sliding_window": False, "layer_types": ["full_attention"] * 3}
}


def tiny_checkpoint(arch: str, path: Path) -> Path:
    return write_tiny_model(arch, path, config=tiny_config(arch) | GGUF_CANNOT.get(arch, {}))


def logits(model, tokens=SEQUENCE) -> np.ndarray:
    ids = mx.array([tokens], dtype=mx.int32)
    return np.array(model.unembed(model.hidden(ids, model.make_caches()))[0, -1])


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("rule", [float32, mixed], ids=["f32", "mixed"])
def test_a_gguf_computes_what_its_stored_values_compute(tmp_path: Path, arch: str, rule) -> None:
    checkpoint = tiny_checkpoint(arch, tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", rule)
    source = load_gguf(path)
    if rule is mixed:
        assert source.quantization  # kept quantized (repacked), not dequantized
        bits = {v["bits"] for k, v in source.quantization.items() if isinstance(v, dict)}
        assert bits >= {4, 5, 8}
    got = logits(build_model(source))
    expected = logits(build_model(load_local_dir(checkpoint_of(path, checkpoint, tmp_path / "x"))))
    assert np.abs(got - expected).max() <= 1e-4
    if rule is float32:  # the stored values are the checkpoint's: the same model
        assert np.abs(got - logits(build_model(load_local_dir(checkpoint)))).max() <= 1e-4


def test_a_llama_gguf_equals_a_float64_forward_of_its_values(tmp_path: Path) -> None:
    """Independent of the runner's families: Llama's forward in float64 numpy over the
    dequantized values of a quantized GGUF (the llama3 RoPE as its rope_freqs say)."""
    checkpoint = write_tiny_model("LlamaForCausalLM", tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", mixed)
    weights = load_file(str(checkpoint_of(path, checkpoint, tmp_path / "x") / "model.safetensors"))
    source = load_gguf(path)
    want = llama_forward(
        {k: v.astype(np.float64) for k, v in weights.items()}, source.config, SEQUENCE
    )
    got = logits(build_model(source))
    assert np.abs(got - want).max() <= 1e-4


def llama_forward(w: dict[str, np.ndarray], c: dict, tokens: list[int]) -> np.ndarray:
    """transformers' LlamaForCausalLM in float64: RMSNorm, rotate-half RoPE (llama3
    scaling), grouped-query causal attention, SwiGLU; the last position's logits."""
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d, eps = c["head_dim"], c["rms_norm_eps"]
    rope = c["rope_parameters"]
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, d, 2) / d)
    if rope["rope_type"] == "llama3":
        f, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv / f, inv)
        middle = (wavelen >= old / high) & (wavelen <= old / low)
        inv = np.where(middle, (1 - smooth) * inv / f + smooth * inv, scaled)
    n = len(tokens)
    angles = np.outer(np.arange(n), inv)
    cos, sin = (
        np.cos(np.concatenate([angles, angles], 1)),
        np.sin(np.concatenate([angles, angles], 1)),
    )

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rotate(x: np.ndarray) -> np.ndarray:  # [heads, n, d]
        half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + half * sin

    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = norm(x, w[p + "input_layernorm.weight"])
        q = (y @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d).transpose(1, 0, 2)
        k = (y @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, d).transpose(1, 0, 2)
        v = (y @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, d).transpose(1, 0, 2)
        q, k = rotate(q), rotate(k)
        k, v = np.repeat(k, heads // kv, 0), np.repeat(v, heads // kv, 0)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d) + mask
        p_attn = np.exp(scores - scores.max(-1, keepdims=True))
        p_attn /= p_attn.sum(-1, keepdims=True)
        out = (p_attn @ v).transpose(1, 0, 2).reshape(n, heads * d)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        y = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x[-1] @ head.T


def test_an_ollama_store_gguf_model_loads_by_name(tmp_path: Path) -> None:
    """What `ollama pull` stores (a GGUF model layer, template, params and system layers)
    loads by name as the file itself does, with its text layers beside."""
    from runner.sources.ollama_store import load_store_model
    from tests.ollama_store import write_ollama_gguf_model

    path = write_gguf(
        tiny_checkpoint("LlamaForCausalLM", tmp_path / "hf"), tmp_path / "m.gguf", mixed
    )
    template = (
        b"{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ .Prompt }}"
    )
    write_ollama_gguf_model(
        tmp_path / "models",
        "tiny:q4",
        path,
        {
            "application/vnd.ollama.image.template": template,
            "application/vnd.ollama.image.params": b'{"stop": ["<|im_end|>"], "temperature": 0.2}',
            "application/vnd.ollama.image.system": b"You are tiny.",
        },
    )
    source = load_store_model("tiny:q4", tmp_path / "models")
    assert source.name == "tiny:q4"
    assert source.ollama == {
        "template": template.decode(),
        "params": {"stop": ["<|im_end|>"], "temperature": 0.2},
        "system": "You are tiny.",
    }
    assert np.array_equal(logits(build_model(source)), logits(build_model(load_gguf(path))))


def test_unsupported_architectures_and_broken_files_are_refused_naming_them(tmp_path: Path) -> None:
    import gguf as gguf_package

    from runner.sources.source import ModelLoadError

    writer = gguf_package.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture: bert"):
        load_gguf(tmp_path / "bert.gguf")
    path = write_gguf(tiny_checkpoint("LlamaForCausalLM", tmp_path / "hf"), tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_gguf(cut)
