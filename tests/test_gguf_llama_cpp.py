"""The default model's GGUF (SmolLM2-135M-Instruct, Q4_1, loaded straight from the wheel's
file) and its float32 form agree with llama.cpp on the same files (`llama` marker: skipped
without llama-cpp-python, as in CI).

Equality is impossible: llama.cpp rounds the activations of its quantized products to 8 bits
(Q8_0 / Q8_1) and of its float16 ones to float16, where the runner computes float32 sums of
the dequantized weights. The agreement asked for: every position's full-vocabulary logits,
NMSE (sum of squared differences over sum of squares) under 1e-3 and the mean KL divergence of
the two softmaxes under 5e-3 for a quantized file; for a float32 file, much tighter (the
figures measured are printed: `pytest -s`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from runner.models import build_model
from runner.sources.gguf.model import load_gguf

pytestmark = [pytest.mark.llama, pytest.mark.slow]

PROMPTS = [  # short and long, prose, code, chat, numbers: 206 positions in all
    "The capital of France is",
    "Question: Is the sky blue on a clear day?\nAnswer:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the river, there lived a baker who",
    "The following is a long passage about the history of astronomy. " * 4
    + "Question: Is this passage about astronomy?\nAnswer:",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and "
    "Buzz Aldrin",
    "A list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23,",
]


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def ours(path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    model = build_model(load_gguf(path))
    out = []
    for tokens in prompts:
        hidden = model.hidden(mx.array([tokens], dtype=mx.int32), model.make_caches())
        out.append(np.array(model.unembed(hidden)[0].astype(mx.float32), np.float64))
    return out


def theirs(llama_cpp, path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2
    )
    out = []
    for tokens in prompts:
        llm.reset()
        llm.eval(tokens)
        out.append(np.array(llm.scores[: len(tokens)], np.float64))
    return out


def agreement(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, float, float]:
    """NMSE, mean KL(b || a) over positions, and the share of positions whose argmax agrees."""
    a_all, b_all = np.concatenate(a), np.concatenate(b)
    nmse = float(((a_all - b_all) ** 2).sum() / (b_all**2).sum())

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    la, lb = log_softmax(a_all), log_softmax(b_all)
    kl = float((np.exp(lb) * (lb - la)).sum(-1).mean())
    top1 = float((a_all.argmax(-1) == b_all.argmax(-1)).mean())
    return nmse, kl, top1


def tokenized(llama_cpp, path: Path) -> list[list[int]]:
    """The prompts as the runner tokenizes them (no BOS: the default model adds none)."""
    from runner.text.tokenizer import Tokenizer

    source = load_gguf(path)
    tokenizer = Tokenizer(source.tokenizer_json, tokenizer_config=source.tokenizer_config)
    return [tokenizer.encode(p) for p in PROMPTS]


def test_the_default_models_gguf_agrees_with_llama_cpp(llama_cpp, default_model_dir) -> None:
    from runner.sources.default_model import GGUF_NAME

    path = default_model_dir / GGUF_NAME
    prompts = tokenized(llama_cpp, path)
    nmse, kl, top1 = agreement(ours(path, prompts), theirs(llama_cpp, path, prompts))
    print(f"\nQ4_1 (the default model): NMSE {nmse:.3g}, mean KL {kl:.3g}, top-1 {top1:.3f}")
    assert nmse < 1e-3 and kl < 5e-3


def test_its_float32_form_agrees_much_more_closely(llama_cpp, default_model_dir, tmp_path) -> None:
    """The same weights, dequantized exactly, as a float32 GGUF written as llama.cpp's
    converter writes one (tests/gguf_models.py): only the float32 summation orders differ."""
    from runner.sources.default_model import GGUF_NAME
    from tests.gguf_models import float32, write_gguf
    from tools.default_model import convert_gguf

    checkpoint = tmp_path / "checkpoint"
    convert_gguf(default_model_dir / GGUF_NAME, checkpoint, dtype="float32")
    config = json.loads((checkpoint / "config.json").read_text())  # as transformers 5 writes
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    (checkpoint / "config.json").write_text(json.dumps(config))
    path = write_gguf(checkpoint, tmp_path / "f32.gguf", float32)
    prompts = tokenized(llama_cpp, default_model_dir / GGUF_NAME)
    nmse, kl, top1 = agreement(ours(path, prompts), theirs(llama_cpp, path, prompts))
    print(f"\nF32 (its exact values): NMSE {nmse:.3g}, mean KL {kl:.3g}, top-1 {top1:.3f}")
    assert nmse < 1e-6 and kl < 1e-5 and math.isfinite(nmse)


def test_the_quantized_file_computes_its_float32_values(default_model_dir, tmp_path) -> None:
    """Where the runner and llama.cpp part on the Q4_1 file is llama.cpp's rounding of its
    activations: the runner's Q4_1 products (repacked, native) compute what the float32 file
    of the same values computes, to float32 rounding."""
    from runner.sources.default_model import GGUF_NAME
    from tests.gguf_models import float32, write_gguf
    from tools.default_model import convert_gguf

    checkpoint = tmp_path / "checkpoint"
    convert_gguf(default_model_dir / GGUF_NAME, checkpoint, dtype="float32")
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    (checkpoint / "config.json").write_text(json.dumps(config))
    path = write_gguf(checkpoint, tmp_path / "f32.gguf", float32)
    prompts = [[1, 504, 2411, 314, 260, 4119, 30, 198, 5248, 314]]
    quantized, exact = ours(default_model_dir / GGUF_NAME, prompts), ours(path, prompts)
    nmse, kl, top1 = agreement(quantized, exact)
    print(f"\nQ4_1 against its float32 values, both the runner: NMSE {nmse:.3g}, KL {kl:.3g}")
    assert nmse < 1e-9 and top1 == 1.0
