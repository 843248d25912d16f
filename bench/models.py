"""Model directories for the benchmarks: random-weight Qwen3s written here, or any existing one.

`write_model_dir(shape, path)` writes config.json (transformers 5's Qwen3 key set, copied from
tests/data/configs/Qwen3ForCausalLM.json, with the shape's dimensions), model.safetensors
(float16 from seeded numpy normals), tokenizer.json (bench/text.py's byte-level BPE, its
vocabulary padded to the model's so every id the model can emit decodes to distinct text)
and tokenizer_config.json, so the runner, mlx-lm and transformers all load the same directory.
A directory that already holds the same shape and seed (bench-model.json) is reused.
`Shape.from_config` reads the same dimensions from an existing directory (`--model DIR`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.text import TOKENIZER_VOCAB, pad_vocabulary, train_tokenizer

CONFIGS = Path(__file__).parents[1] / "tests/data/configs"
CONFIG_TEMPLATE = CONFIGS / "Qwen3ForCausalLM.json"
GEMMA3_TEMPLATE = CONFIGS / "Gemma3ForCausalLM.json"
STAMP = "bench-model.json"
FORMAT_VERSION = 2


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int = 40960
    qk_norm: bool = True  # Qwen3's per-head RMSNorm of queries and keys
    tied: bool = True  # the output head is the embedding
    # "qwen3", or "gemma3": Gemma3's layers (four norms a layer scaling by 1 + weight, GELU),
    # five sliding-window layers of `window` positions to one full, scaled embeddings
    family: str = "qwen3"
    window: int = 0

    def params(self, embedding: bool = True) -> int:
        """Weights of the model; without the embedding (and an untied output head, which
        scoring computes only for the candidates) when asked."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q * 2 + h * kv * 2 + (2 * self.head_dim if self.qk_norm else 0)
        layer = attention + 3 * h * self.intermediate + 2 * h
        body = self.layers * layer + h
        return body + (self.vocab * h * (1 if self.tied else 2) if embedding else 0)

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> Shape:
        """The shape of an existing Llama/Qwen-family model from its config.json (biases, a
        few thousand weights where a family has them, are not counted)."""
        heads = config["num_attention_heads"]
        return cls(
            name=name,
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            context=config.get("max_position_embeddings") or 4096,
            qk_norm=config.get("model_type") == "qwen3",
            tied=bool(config.get("tie_word_embeddings", False)),
        )


SHAPES = {
    # Qwen3-0.6B's shape.
    "default": Shape("qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936),
    "small": Shape("qwen3-small", 256, 4, 4, 2, 64, 768, 4096),
    # Gemma3-1B's shape (google/gemma-3-1b-pt's config)
    "gemma3-1b": Shape(
        "gemma3-1b", 1152, 26, 4, 1, 256, 6912, 262144, 32768, family="gemma3", window=512
    ),
}

TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "bos_token": "<|endoftext|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "model_max_length": 40960,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def _dimensions(shape: Shape) -> dict[str, Any]:
    """A transformers config's keys for the shape's dimensions."""
    return {
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.context,
    }


def gemma3_config(shape: Shape) -> dict[str, Any]:
    """transformers 5's Gemma3 text config (the tests' key set) with the shape's dimensions
    and Gemma3-1B's windows, rotary bases and query scale; no soft-caps, as Gemma3 has."""
    config = json.loads(GEMMA3_TEMPLATE.read_text())
    config.update(
        _dimensions(shape),
        layer_types=[
            "full_attention" if (n + 1) % 6 == 0 else "sliding_attention"
            for n in range(shape.layers)
        ],
        sliding_window=shape.window,
        query_pre_attn_scalar=shape.head_dim,
        rope_parameters={
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    )
    return config


def model_config(shape: Shape) -> dict[str, Any]:
    if shape.family == "gemma3":
        return gemma3_config(shape)
    config = json.loads(CONFIG_TEMPLATE.read_text())
    config.update(
        _dimensions(shape),
        layer_types=["full_attention"] * shape.layers,
        tie_word_embeddings=True,
    )
    return config


def weight_shapes(shape: Shape) -> dict[str, tuple[tuple[int, ...], float | None]]:
    """Hugging Face names -> (shape, std); std None means a norm (1 + small noise; Gemma's,
    which scale by 1 + weight, small noise)."""
    h, d, i = shape.hidden, shape.head_dim, shape.intermediate
    q, kv = shape.heads * d, shape.kv_heads * d
    spec: dict[str, tuple[tuple[int, ...], float | None]] = {
        "model.embed_tokens.weight": ((shape.vocab, h), 0.02),
        "model.norm.weight": ((h,), None),
    }
    for n in range(shape.layers):
        p = f"model.layers.{n}"
        spec |= {
            f"{p}.self_attn.q_proj.weight": ((q, h), 0.1),  # q/k larger: non-uniform attention
            f"{p}.self_attn.k_proj.weight": ((kv, h), 0.1),
            f"{p}.self_attn.v_proj.weight": ((kv, h), 0.02),
            f"{p}.self_attn.o_proj.weight": ((h, q), 0.02),
            f"{p}.self_attn.q_norm.weight": ((d,), None),
            f"{p}.self_attn.k_norm.weight": ((d,), None),
            f"{p}.mlp.gate_proj.weight": ((i, h), 0.02),
            f"{p}.mlp.up_proj.weight": ((i, h), 0.02),
            f"{p}.mlp.down_proj.weight": ((h, i), 0.02),
            f"{p}.input_layernorm.weight": ((h,), None),
            f"{p}.post_attention_layernorm.weight": ((h,), None),
        }
        if shape.family == "gemma3":
            spec |= {
                f"{p}.pre_feedforward_layernorm.weight": ((h,), None),
                f"{p}.post_feedforward_layernorm.weight": ((h,), None),
            }
    return spec


def random_weights(shape: Shape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, (dims, std) in sorted(weight_shapes(shape).items()):
        w = rng.standard_normal(dims, dtype=np.float32)
        w *= 0.1 if std is None else std
        if std is None and shape.family != "gemma3":
            w += 1.0
        weights[name] = w.astype(np.float16)
    return weights


def write_model_dir(shape: Shape, path: Path, seed: int = 0) -> Path:
    """Write (or reuse) a random `shape` model directory at `path`; returns `path`."""
    from safetensors.numpy import save_file

    path = Path(path)
    stamp = {"shape": asdict(shape), "seed": seed, "format": FORMAT_VERSION}
    if (path / STAMP).exists() and json.loads((path / STAMP).read_text()) == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(shape), indent=2, sort_keys=True))
    trained = train_tokenizer(min(shape.vocab, TOKENIZER_VOCAB), seed)
    (path / "tokenizer.json").write_text(pad_vocabulary(trained, shape.vocab))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    save_file(random_weights(shape, seed), str(path / "model.safetensors"), {"format": "pt"})
    (path / STAMP).write_text(json.dumps(stamp))
    return path


def _optional_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def load_tokenizer(path: Path):
    """Our runner's tokenizer for a model directory (any, not only ours), without loading
    the weights; tokenizer_config.json and generation_config.json are optional, as for the
    runner."""
    from runner.text.tokenizer import Tokenizer

    return Tokenizer(
        (path / "tokenizer.json").read_text(),
        config=json.loads((path / "config.json").read_text()),
        tokenizer_config=_optional_json(path / "tokenizer_config.json"),
        generation_config=_optional_json(path / "generation_config.json"),
    )


def llama_cpp_pre_tokenizer(path: Path) -> str | None:
    """The llama.cpp pre-tokenizer name of a directory written here, None for any other.

    llama.cpp's convert_hf_to_gguf.py recognises a BPE pre-tokenizer by the hash of the
    tokens a known model's tokenizer gives for a test string, which a vocabulary trained here
    can never match, so it refuses our directories. Ours splits text with GPT-2's byte-level
    regex (bench/text.py), which is llama.cpp's "gpt-2" pre-tokenizer: bench/llamacpp.py
    names it for the converter. Other directories are left to the converter's recognition.
    """
    return "gpt-2" if (path / STAMP).exists() else None
