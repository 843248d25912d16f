"""GGUF model files load as the checkpoints they came from (runner/sources/gguf/model.py,
architectures.py): a tiny checkpoint of every architecture served, written as llama.cpp's
converter writes it (tests/gguf_models.py), float32 or in a quantized file's mix of types,
computes what the checkpoint of its stored values (gguf-py's dequantization, llama.cpp's)
computes through the runner's directory loader, and, float32, what the checkpoint itself
computes; for Llama also what a float64 numpy forward of those values computes. Ollama's own
files (embedded vision towers, other spellings) load as the converter's do; files the runner
cannot map fail naming what it cannot. tests/test_gguf_convert.py holds the files written here
to llama.cpp's real converter."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from runner.models import build_model
from runner.sources.gguf import quants
from runner.sources.gguf.model import load_gguf
from runner.sources.loader import load_local_dir
from runner.sources.source import ModelLoadError
from tests.gguf_models import (
    GGUF_ARCHITECTURES,
    T,
    checkpoint_of,
    float32,
    fuse_qkv,
    gguf_names,
    iq4_mixed,
    k2_mixed,
    k3_mixed,
    k5_mixed,
    k_mixed,
    mixed,
    tiny_checkpoint,
    write_gguf,
)
from tests.tiny import write_tiny_model

SEQUENCE = [5, 17, 42, 99, 3, 250, 7, 8, 61, 120, 33]


def logits(model, tokens=SEQUENCE) -> np.ndarray:
    ids = mx.array([tokens], dtype=mx.int32)
    return np.array(model.unembed(model.hidden(ids, model.make_caches()))[0, -1])


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
@pytest.mark.parametrize("rule", [float32, mixed], ids=["f32", "mixed"])
def test_a_gguf_computes_what_its_stored_values_compute(tmp_path: Path, arch: str, rule) -> None:
    checkpoint = tiny_checkpoint(arch, tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", rule)
    source = load_gguf(path)
    if rule is mixed:
        assert source.quantization  # kept quantized (repacked), not dequantized
        entries = {k: v for k, v in source.quantization.items() if isinstance(v, dict)}
        layers = {k: v for k, v in entries.items() if "bits" in v}
        assert {v["bits"] for v in layers.values()} >= {4, 5, 8}
        # the F16 matrices (an untied head, rows not whole blocks) as stored, for the step
        assert {v["ggml_type"] for k, v in entries.items() if k not in layers} <= {"F16"}
        if arch == "GptOssForCausalLM":  # the experts in MLX's own mxfp4
            experts = {k: v["mode"] for k, v in layers.items() if ".experts." in k}
            assert len(experts) == 6 and set(experts.values()) == {"mxfp4"}
    got = logits(build_model(source))
    expected = logits(build_model(load_local_dir(checkpoint_of(path, checkpoint, tmp_path / "x"))))
    assert np.abs(got - expected).max() <= 1e-4
    if rule is float32:  # the stored values are the checkpoint's: the same model
        original = logits(build_model(load_local_dir(checkpoint)))
        # (Gemma3's converter drops the embedding rows past the tokenizer's vocabulary)
        assert np.abs(got - original[: len(got)]).max() <= 1e-4


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


# A tiny Llama whose rows are whole Q6_K blocks (256 weights)
K_QUANT_LLAMA = {
    "hidden_size": 256, "intermediate_size": 512, "head_dim": 32, "num_attention_heads": 8,
    "num_key_value_heads": 4, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}  # fmt: skip


def llama_file(
    tmp_path: Path, dims: dict[str, Any], rule: Any, tied: bool | None = None
) -> tuple[dict[str, Any], Path, dict[str, np.ndarray]]:
    """A tiny Llama of `dims` (tied: as the config says where None) written as a GGUF by
    `rule`: its config, the file, and the checkpoint of the file's own values (what a float64
    reference computes from)."""
    from tests.tiny import edit_text_config, tiny_config

    config = edit_text_config(tiny_config("LlamaForCausalLM"), dims)
    checkpoint = write_tiny_model(
        "LlamaForCausalLM", tmp_path / "hf", config=config, tie_word_embeddings=tied
    )
    path = write_gguf(checkpoint, tmp_path / "model.gguf", rule)
    weights = load_file(str(checkpoint_of(path, checkpoint, tmp_path / "x") / "model.safetensors"))
    return config, path, weights


# Each K-quant file's GGML type per layer of the checkpoint (the rules of tests/gguf_models.py;
# None: every other matrix)
Q6_K_MOST = {"embed_tokens": "Q6_K", "v_proj": "Q6_K", "down_proj": "Q6_K"}
K_FILES = {
    "q4_k_m": (k_mixed, {**Q6_K_MOST, None: "Q4_K"}),
    "q5_k_m": (k5_mixed, {**Q6_K_MOST, None: "Q5_K"}),
    "q3_k_m": (
        k3_mixed,
        {"embed_tokens": "Q3_K", "v_proj": "Q5_K", "o_proj": "Q4_K", "down_proj": "Q4_K",
         None: "Q3_K"},
    ),
    "q2_k": (
        k2_mixed,
        {"embed_tokens": "Q2_K", "v_proj": "Q3_K", "down_proj": "Q3_K", "o_proj": "Q4_K",
         None: "Q2_K"},
    ),
    "iq4_xs": (iq4_mixed, {None: "IQ4_XS"}),
}  # fmt: skip
BLOCK_BYTES = {
    "Q6_K": 210, "Q5_K": 176, "Q4_K": 144, "Q3_K": 110, "Q2_K": 84, "IQ4_XS": 136,
}  # a 256 weights  # fmt: skip


def k_file_type(kinds: dict[str | None, str], name: str) -> str:
    """The GGML type K_FILES' `kinds` give the checkpoint tensor `name` (the head: Q6_K)."""
    if "lm_head" in name:
        return "Q6_K"
    return next((kind for key, kind in kinds.items() if key and key in name), kinds[None])


@pytest.mark.parametrize("file", list(K_FILES))
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_k_quant_blocks_are_kept_and_computed_as_stored(
    tmp_path: Path, tied: bool, file: str
) -> None:
    """A Q4_K_M-like file's Q6_K tensors (the embedding or head, attn_v, ffn_down) and Q4_K
    ones (the other matrices), a Q5_K_M-like file's (Q5_K for Q4_K), a Q3_K_M-like and a
    Q2_K-like file's (Q3_K, Q2_K for most, with Q4_K, Q5_K, Q6_K as llama.cpp mixes them)
    and an IQ4_XS file's stay in their blocks: resident at the file's bytes, not float32's
    (Q6_K, Q3_K, Q2_K, IQ4_XS: 4.9x, 9.3x, 12.2x, 7.5x them) or the affine repack's (Q4_K,
    Q5_K), and read by the native step (runner/native/quantized.c) on the CPU; what the model
    computes is the float64 forward of their values (llama.cpp's dequantization) within 1e-4,
    on the native step, on MLX's own path over the blocks, and from what a backend without the
    native step keeps (Q4_K / Q5_K as MLX's affine 4 / 5 bits, the others float32 weights)."""
    import mlx.nn as nn

    from runner.backend import Backend
    from runner.models.quantized import GGMLEmbedding, GGMLLinear

    rule, kinds = K_FILES[file]
    config, path, weights = llama_file(tmp_path, K_QUANT_LLAMA, rule, tied)
    source = load_gguf(path)
    kept = {k for k in source.weights if k.endswith(".blocks")}
    head = "model.embed_tokens.blocks" if tied else "lm_head.blocks"
    heads = 1 if tied else 2  # the embedding, and the head where it has its own
    # every matrix: q, k, v, o, gate, up, down
    assert head in kept and len(kept) == heads + 7 * config["num_hidden_layers"], kept
    for name in kept:  # the type's bytes a 256 weights, as stored
        rows, width = weights[name.replace(".blocks", ".weight")].shape
        kind = k_file_type(kinds, name)
        assert source.weights[name].shape == (rows, width // 256 * BLOCK_BYTES[kind])
        assert source.quantization[name.removesuffix(".blocks")]["ggml_type"] == kind
    want = llama_forward(
        {k: v.astype(np.float64) for k, v in weights.items()}, source.config, SEQUENCE
    )
    model = build_model(source)
    layers = [
        m for _, m in model.module.named_modules() if isinstance(m, GGMLLinear | GGMLEmbedding)
    ]
    assert len(layers) == len(kept)
    got = logits(model)
    assert model._native is not None and model._native.quantized  # the step reads codes
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    with model.mlx_only():
        assert np.abs(logits(model) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    plain = dataclasses.replace(Backend.cpu(), native_step_max_tokens=None)
    floats = build_model(load_gguf(path), plain)
    modules = dict(floats.module.named_modules())
    assert not any(isinstance(m, GGMLLinear | GGMLEmbedding) for m in modules.values())
    for name in kept:  # Q4_K / Q5_K: MLX's affine codes; the others float32
        layer, kind = modules[name.removesuffix(".blocks")], k_file_type(kinds, name)
        if kind in ("Q4_K", "Q5_K"):
            assert isinstance(layer, nn.QuantizedLinear | nn.QuantizedEmbedding), name
            assert (layer.bits, layer.group_size, layer.mode) == (int(kind[1]), 32, "affine")
        else:
            assert type(layer) in (nn.Linear, nn.Embedding), name
            assert layer.weight.dtype == mx.float32
    assert np.abs(logits(floats) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


# A Llama whose hidden size (160) is whole 32s but not 256s, as SmolLM2's 576 and
# Qwen2.5-0.5B's 896: an IQ4_XS file of it is mostly IQ4_NL (tests/gguf_models.py)
IQ4_NL_LLAMA = {**K_QUANT_LLAMA, "hidden_size": 160}


def block_types(source: Any) -> dict[str, str]:
    """The GGML type of each layer a GGUF source keeps in blocks, by its path."""
    return {
        name.removesuffix(".blocks"): source.quantization[name.removesuffix(".blocks")]["ggml_type"]
        for name in source.weights
        if name.endswith(".blocks")
    }


def kept_model(
    source: Any, weights: dict[str, np.ndarray], types: dict[str, str]
) -> tuple[Any, np.ndarray, float]:
    """The model of `source`, checked: each layer of `types` holds its blocks as stored and is
    a GGML layer the native step reads, and the logits are the float64 forward's of
    `weights` (the file's own values) within 1e-4, on the native step and on MLX's path over
    the blocks. Returns the model, the float64 logits and their scale."""
    from runner.models.quantized import GGMLEmbedding, GGMLLinear

    for name in types:  # as stored: bytes a block per weights a block
        rows, width = weights[f"{name}.weight"].shape
        info = quants.TYPES[getattr(quants, types[name])]
        assert source.weights[f"{name}.blocks"].shape == (
            rows, width // info.block_size * info.type_size,
        )  # fmt: skip
    want = llama_forward(
        {k: v.astype(np.float64) for k, v in weights.items()}, source.config, SEQUENCE
    )
    scale = max(1.0, np.abs(want).max())
    model = build_model(source)
    modules = dict(model.module.named_modules())
    assert all(isinstance(modules[k], GGMLLinear | GGMLEmbedding) for k in types)
    assert model._native is not None and model._native.quantized  # the step reads the blocks
    assert np.abs(logits(model) - want).max() <= 1e-4 * scale
    with model.mlx_only():
        assert np.abs(logits(model) - want).max() <= 1e-4 * scale
    return model, want, scale


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_iq4_nl_blocks_are_kept_and_computed_as_stored(tmp_path: Path, tied: bool) -> None:
    """An IQ4_XS file of a model whose rows are not all whole 256s, as llama.cpp's quantizer
    writes one: IQ4_NL (blocks of 32) for the matrices of 160 columns and the embedding,
    IQ4_XS for those of 256 and 512, a Q8_0 head where it has its own. Every IQ4_NL and
    IQ4_XS tensor stays in its blocks (the file's bytes, not float32's 7.1x) and is read by
    the native step, a layer's q, k, v (IQ4_NL) beside its o and down (IQ4_XS); the logits
    are the float64 forward's of llama.cpp's values within 1e-4, on the native step (forwards,
    and decode steps, whose IQ4_XS products take limbs where the library has them, IQ4_NL's
    the float tiles), on MLX's own path over the blocks, and from the float32 weights a
    backend without the native step keeps."""
    import mlx.nn as nn

    from runner.backend import Backend
    from tests.gguf_models import iq4_fallback

    config, path, weights = llama_file(tmp_path, IQ4_NL_LLAMA, iq4_fallback, tied)
    source = load_gguf(path)
    types = block_types(source)
    layers = config["num_hidden_layers"]
    nl = {k for k, t in types.items() if t == "IQ4_NL"}
    assert nl == {"model.embed_tokens"} | {
        f"model.layers.{i}.{m}"
        for i in range(layers)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj")
    }  # fmt: skip
    wide = ("self_attn.o_proj", "mlp.down_proj")  # of 256 and 512 columns
    assert set(types) - nl == {f"model.layers.{i}.{m}" for i in range(layers) for m in wide}
    assert all(types[k] == "IQ4_XS" for k in set(types) - nl)
    model, want, scale = kept_model(source, weights, types)  # 18 bytes a 32 weights, 136 a 256
    w64 = {k: v.astype(np.float64) for k, v in weights.items()}
    caches, plain_caches = model.make_caches(), model.make_caches()
    model.hidden(mx.array([SEQUENCE[:4]]), caches)
    model.hidden(mx.array([SEQUENCE[:4]]), plain_caches)
    differ = []
    for i in range(4, len(SEQUENCE)):
        with model.decode_steps():
            hidden = model.hidden(mx.array([[SEQUENCE[i]]]), caches)
            got = np.array(model.unembed(hidden)[0, -1])
        step_want = llama_forward(w64, source.config, SEQUENCE[: i + 1])
        assert np.abs(got - step_want).max() <= 1e-4 * max(1.0, np.abs(step_want).max())
        plain = model.hidden(mx.array([[SEQUENCE[i]]]), plain_caches)
        differ.append(not np.array_equal(np.array(hidden[0, -1]), np.array(plain[0, -1])))
    # the decode steps' IQ4_XS products by limbs where the library has them (the same steps
    # outside decode_steps: the float tiles)
    assert any(differ) == model._native.limb_products
    plain = dataclasses.replace(Backend.cpu(), native_step_max_tokens=None)
    floats = build_model(load_gguf(path), plain)
    float_modules = dict(floats.module.named_modules())
    for name in types:  # float32 weights of the same values
        assert type(float_modules[name]) in (nn.Linear, nn.Embedding), name
        assert float_modules[name].weight.dtype == mx.float32
    assert np.abs(logits(floats) - want).max() <= 1e-4 * scale


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_grid_blocks_are_kept_and_computed_as_stored(tmp_path: Path, tied: bool) -> None:
    """A file of the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: a
    layer's seven matrices one of each, the embedding IQ3_S, a head of its own IQ2_XS): every
    one stays in its blocks (2.06 to 3.44 bits a weight, where they were 8-bit codes or
    float32) and is read by the native step; the logits are the float64 forward's of
    llama.cpp's values within 1e-4 on the native step (forwards, and decode steps, whose
    products take limbs where the library has them: not the bits of the same steps outside
    `decode_steps`, the float tiles'), on MLX's own path over the blocks, and from what a
    backend without the native step keeps (IQ2_XXS, IQ3_XXS, IQ3_S and IQ1_S MLX's 8-bit
    codes, the others float32)."""
    import mlx.nn as nn

    from runner.backend import Backend
    from runner.models.quantized import AFFINE_REPACKS
    from tests.gguf_models import GRID_FILE, grid_types

    config, path, weights = llama_file(tmp_path, K_QUANT_LLAMA, grid_types, tied)
    source = load_gguf(path)
    types = block_types(source)
    matrices = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for i in range(config["num_hidden_layers"]):
        layer = {
            m: types[k]
            for k in types
            for m in matrices
            if k.startswith(f"model.layers.{i}.") and k.endswith(m)
        }
        assert len(layer) == 7 and set(layer.values()) == {t.name for t in GRID_FILE.values()}
    assert types["model.embed_tokens"] == "IQ3_S"
    assert types.get("lm_head") == (None if tied else "IQ2_XS")
    model, want, scale = kept_model(source, weights, types)
    w64 = {k: v.astype(np.float64) for k, v in weights.items()}
    caches, plain_caches = model.make_caches(), model.make_caches()
    model.hidden(mx.array([SEQUENCE[:4]]), caches)
    model.hidden(mx.array([SEQUENCE[:4]]), plain_caches)
    differ = []
    for i in range(4, len(SEQUENCE)):
        with model.decode_steps():
            hidden = model.hidden(mx.array([[SEQUENCE[i]]]), caches)
            got = np.array(model.unembed(hidden)[0, -1])
        step_want = llama_forward(w64, source.config, SEQUENCE[: i + 1])
        assert np.abs(got - step_want).max() <= 1e-4 * max(1.0, np.abs(step_want).max())
        plain = model.hidden(mx.array([[SEQUENCE[i]]]), plain_caches)
        differ.append(not np.array_equal(np.array(hidden[0, -1]), np.array(plain[0, -1])))
    assert any(differ) == model._native.limb_products  # by limbs where the library has them
    plain_backend = dataclasses.replace(Backend.cpu(), native_step_max_tokens=None)
    floats = build_model(load_gguf(path), plain_backend)
    float_modules = dict(floats.module.named_modules())
    for name, kind in types.items():
        if kind in AFFINE_REPACKS:
            assert isinstance(float_modules[name], nn.QuantizedLinear | nn.QuantizedEmbedding)
            assert float_modules[name].bits == 8, name
        else:
            assert type(float_modules[name]) in (nn.Linear, nn.Embedding), name
    assert np.abs(logits(floats) - want).max() <= 1e-4 * scale


def five_bits(name: str, shape: tuple[int, ...], arch: str) -> T:
    """Q5_0 for the layers' matrices (the runner maps them onto MLX's 5-bit affine codes, as
    most of the default model's "Q4_K_M" file), `mixed` elsewhere."""
    if name.startswith("blk.") and len(shape) == 2 and shape[-1] % 32 == 0:
        return T.Q5_0
    return mixed(name, shape, arch)


@pytest.mark.parametrize(
    "rule", [k_mixed, k5_mixed, k3_mixed, k2_mixed, iq4_mixed, five_bits],
    ids=["k_quants", "q5_k_m", "q3_k_m", "q2_k", "iq4_xs", "q5_0"],
)  # fmt: skip
def test_decode_steps_of_quantized_files_are_within_float32_grade(
    tmp_path: Path, rule: Any
) -> None:
    """A Q4_K_M-like file's decode steps (what the generation pipeline computes inside the
    model's `decode_steps`, runner/models/base.py), a Q5_K_M-like and a Q5_0 file's: each
    step's logits are the float64 forward's of the blocks' values within 1e-4, as a forward's
    are, its hidden row within 1e-5 of a whole forward's last; where the library has limb
    products for them (K-quants: AVX512-VNNI or AVX2; 5-bit codes: VNNI and VBMI, or AVX2)
    the step's products take them (not the bits of the same steps outside `decode_steps`),
    elsewhere the float tiles (those bits exactly); so does the step's head. Only one token
    a row inside `decode_steps` is a decode step: prompts, and forwards outside it, are not.
    Generation enters it for every decode step and for nothing else."""
    from runner.engine import Job
    from runner.generate.pipeline import GenerateOptions, Generator, Stats
    from runner.generate.sampling import SamplerOptions
    from runner.text.tokenizer import Tokenizer
    from tests.tiny import prefix_cache

    _, path, weights = llama_file(tmp_path, K_QUANT_LLAMA, rule)
    w64 = {k: v.astype(np.float64) for k, v in weights.items()}
    source = load_gguf(path)
    model = build_model(source)
    native = model._native
    assert native is not None and native.quantized
    flags: list[tuple[int, int]] = []  # each native call's (tokens, decode)
    real_step = native._step

    def step(args: Any) -> int:
        flags.append((args._obj.tokens, args._obj.decode))
        return real_step(args)

    native._step = step
    heads: list[int] = []  # each head product's `decode`
    real_product = native._weight_product

    def product(*args: Any) -> int:
        heads.append(args[-1])
        return real_product(*args)

    native._weight_product = product

    prompt = 4
    # the same steps outside decode_steps, on caches of their own: a cached one-token step's
    # row is not a whole forward's last bit for bit on any build (~1e-6 apart), but it is
    # this one's wherever the decode step takes no limbs
    caches, plain_caches = model.make_caches(), model.make_caches()
    model.hidden(mx.array([SEQUENCE[:prompt]]), caches)
    model.hidden(mx.array([SEQUENCE[:prompt]]), plain_caches)
    differ, head_differs = [], []
    for i in range(prompt, len(SEQUENCE)):
        with model.decode_steps():
            hidden = model.hidden(mx.array([[SEQUENCE[i]]]), caches)
            got = np.array(model.unembed(hidden)[0, -1])
        head_differs.append(not np.array_equal(got, np.array(model.unembed(hidden)[0, -1])))
        plain = np.array(model.hidden(mx.array([[SEQUENCE[i]]]), plain_caches)[0, -1])
        whole = model.hidden(mx.array([SEQUENCE[: i + 1]]), model.make_caches())[0, -1]
        want = llama_forward(w64, source.config, SEQUENCE[: i + 1])
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
        step, forward = np.array(hidden[0, -1]), np.array(whole)
        np.testing.assert_allclose(step, forward, rtol=1e-5, atol=1e-5)
        differ.append(not np.array_equal(step, plain))
    assert any(differ) == (native.affine_limbs if rule is five_bits else native.limb_products)
    # the head of a decode step takes limbs too where they read its format (the K-quant and
    # IQ4_XS files' head is Q6_K), and the Q5_0 file's F16 head (`mixed`) its rows' stream
    # tiles where other rows take panels made of them (builds with limbs have half panels)
    assert any(head_differs) == native.limb_products
    steps = len(SEQUENCE) - prompt
    assert heads == [1, 0] * steps  # each step's head in decode_steps, then the same outside
    assert [d for t, d in flags if t > 1] == [0] * (steps + 2)  # the prompts and the forwards
    assert [d for t, d in flags if t == 1] == [1, 0] * steps  # each step in, then outside

    flags.clear()  # generation: every decode step inside decode_steps, the prompt outside
    tokenizer = Tokenizer(source.tokenizer_json, config=source.config)
    generator = Generator(model, tokenizer, prefix_cache(model, name="generate"))
    stats = Stats()
    options = GenerateOptions(num_predict=5, sampler=SamplerOptions(temperature=0))
    heads.clear()
    list(generator.steps(SEQUENCE, options, Job(lambda _: None, None), stats))
    assert [d for t, d in flags if t > 1] == [0] * sum(t > 1 for t, _ in flags)
    assert [d for t, d in flags if t == 1] == [1] * stats.generated
    assert heads == [1] * stats.generated  # a greedy step's head on the host, each a decode step


# A Llama wide enough that a decode step's products are handed out over the pool (small ones
# run on the caller alone: runner/native/products.c, `small_product`)
WIDE_LLAMA = {
    "hidden_size": 512, "intermediate_size": 1536, "head_dim": 64, "num_attention_heads": 8,
    "num_key_value_heads": 4, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}  # fmt: skip

THREADS_SCRIPT = """
import hashlib, sys
import mlx.core as mx, numpy as np
from runner.models import build_model
from runner.sources.gguf.model import load_gguf
model = build_model(load_gguf(sys.argv[1]))
assert model._native is not None, "no native step"
seq = [int(t) for t in sys.argv[2].split(",")]
caches = model.make_caches()
parts = [np.array(model.hidden(mx.array([seq[:7]]), caches))]
for t in seq[7:]:
    with model.decode_steps():
        hidden = model.hidden(mx.array([[t]]), caches)
        parts.append(np.array(model.unembed(hidden)))
parts.append(np.array(model.unembed(model.hidden(mx.array([seq]), model.make_caches()))))
print(hashlib.sha256(b"".join(p.tobytes() for p in parts)).hexdigest())
"""


@pytest.mark.parametrize("rule", [k_mixed, k2_mixed, five_bits], ids=["k_quants", "q2_k", "q5_0"])
def test_forwards_are_the_same_bits_on_any_number_of_threads(tmp_path: Path, rule: Any) -> None:
    """The native step's products hand their columns out in chunks that the pool's threads
    take in turn (runner/native/products.c), attention its items: which thread computes a
    column, and how many chunks there are (CHUNKS_PER_THREAD a thread), must not change a
    bit. A prompt's forward, decode steps with their logits, and a whole forward's logits of
    a Q4_K_M-like, a Q2_K-like and a Q5_0 file, in processes whose pools have 1, 2 and 3
    threads."""
    import os
    import subprocess
    import sys

    from tests.tiny import edit_text_config, tiny_config

    config = edit_text_config(tiny_config("LlamaForCausalLM"), WIDE_LLAMA)
    checkpoint = write_tiny_model("LlamaForCausalLM", tmp_path / "hf", config=config)
    path = write_gguf(checkpoint, tmp_path / "model.gguf", rule)
    digests = {}
    for threads in (1, 2, 3):
        result = subprocess.run(
            [sys.executable, "-c", THREADS_SCRIPT, str(path), ",".join(map(str, SEQUENCE))],
            env={**os.environ, "RUNNER_BLAS_THREADS": str(threads)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        digests[threads] = result.stdout.split()[-1]
    assert len(set(digests.values())) == 1, digests


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


@pytest.mark.parametrize(
    "arch", ["Gemma3ForCausalLM", "Ministral3ForCausalLM", "GptOssForCausalLM"]
)
def test_ollamas_own_files_load_as_the_converters_do(
    tmp_path: Path, arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What Ollama's converter published (tests/gguf_models.py `ollama`: gemma3 and mistral3
    with their vision tower inside and their own key spellings, gpt-oss as `gptoss` with its
    own tensor names, its Q/K/V fused and keys left out) computes what the llama.cpp
    converter's file does, and quantized what its stored values do; an embedded vision tower
    is left unloaded, and a log line says so."""
    checkpoint = tiny_checkpoint(arch, tmp_path / "hf")
    theirs = write_gguf(checkpoint, tmp_path / "ollama.gguf", ollama=True)
    ours = write_gguf(checkpoint, tmp_path / "llama.cpp.gguf")
    with caplog.at_level(logging.WARNING, logger="runner.sources.gguf.architectures"):
        source = load_gguf(theirs)
    vision = arch != "GptOssForCausalLM"
    assert ("vision tensors (v.*, mm.*) are left unloaded" in caplog.text) == vision
    assert not any(k.startswith(("v.", "mm.")) for k in source.weights)
    assert source.config["architectures"] == [arch]
    assert np.abs(logits(build_model(source)) - logits(build_model(load_gguf(ours)))).max() <= 1e-6
    quantized = write_gguf(checkpoint, tmp_path / "q.gguf", mixed, ollama=True)
    stored = load_local_dir(checkpoint_of(quantized, checkpoint, tmp_path / "x"))
    got = logits(build_model(load_gguf(quantized)))
    assert np.abs(got - logits(build_model(stored))).max() <= 1e-4


Edit = tuple[str, dict[str, Any], list[tuple[str, np.ndarray]]]


def _drop(key: str):
    def edit(arch: str, metadata: dict[str, Any], tensors: list) -> Edit:
        return arch, {k: v for k, v in metadata.items() if k != key}, tensors

    return edit


def _set(key: str, value: Any):
    def edit(arch: str, metadata: dict[str, Any], tensors: list) -> Edit:
        return arch, metadata | {key: value}, tensors

    return edit


def _add_tensor(name: str):
    def edit(arch: str, metadata: dict[str, Any], tensors: list) -> Edit:
        return arch, metadata, [*tensors, (name, np.zeros((4, 64), np.float32))]

    return edit


def _fuse_qkv(arch: str, metadata: dict[str, Any], tensors: list) -> Edit:
    """llama.cpp's --fuse-qkv: each layer's Q, K and V rows (weights, and biases where all
    three have them) in one attn_qkv."""
    return arch, metadata, fuse_qkv(tensors)


def _fuse_gate_up(arch: str, metadata: dict[str, Any], tensors: list) -> Edit:
    """llama.cpp's --fuse-gate-up-exps: each layer's expert gate and up rows in one tensor."""
    parts = dict(tensors)
    fused = []
    for name, values in tensors:
        if name.endswith("ffn_gate_exps.weight"):
            up = parts[name.replace("gate_exps", "up_exps")]
            fused.append(
                (name.replace("gate_exps", "gate_up_exps"), np.concatenate([values, up], 1))
            )
        elif not name.endswith("ffn_up_exps.weight"):
            fused.append((name, values))
    return arch, metadata, fused


REFUSED = [
    ("Qwen3MoeForCausalLM", _drop("expert_count"), r"^GGUF: qwen3moe\.expert_count is missing$"),
    (
        "Gemma2ForCausalLM",
        _drop("embedding_length"),
        r"^GGUF: gemma2\.embedding_length is missing$",
    ),
    (
        "GptOssForCausalLM",
        _drop("attention.sliding_window"),
        r"gpt-oss\.attention\.sliding_window is missing",
    ),
    (
        "Ministral3ForCausalLM",
        _drop("rope.scaling.factor"),
        r"mistral3\.rope\.scaling\.factor is missing",
    ),
    ("Phi3ForCausalLM", _set("rope.dimension_count", 20), r"phi3\.rope\.dimension_count 20"),
    (
        "Gemma3ForCausalLM",
        _set("attention.sliding_window_pattern", [True, False]),
        r"gemma3\.attention\.sliding_window_pattern must be 6 flags",
    ),
    (
        "Qwen3ForCausalLM",
        _add_tensor("blk.0.attn_gate.weight"),
        r"^GGUF: tensor blk\.0\.attn_gate\.weight is not one the runner maps$",
    ),
    (
        "Gemma2ForCausalLM",
        _add_tensor("per_layer_token_embd.weight"),
        r"tensor per_layer_token_embd\.weight is not one",
    ),
    (
        "Qwen3MoeForCausalLM",
        _fuse_gate_up,
        r"tensor blk\.0\.ffn_gate_up_exps\.weight is fused expert gate/up projections",
    ),
]


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen2ForCausalLM", "GptOssForCausalLM"]
)
def test_a_fused_qkv_loads_as_the_three_projections(tmp_path: Path, arch: str) -> None:
    """llama.cpp's --fuse-qkv (Q/K permuted before fusing for llama; Qwen2's and GPT-OSS's
    biases fused too), quantized: the same model as the file with Q, K and V apart."""
    checkpoint = tiny_checkpoint(arch, tmp_path / "hf")
    fused = write_gguf(checkpoint, tmp_path / "fused.gguf", edit=_fuse_qkv)
    apart = write_gguf(checkpoint, tmp_path / "apart.gguf")
    assert any(".attn_qkv." in n for n in gguf_names(fused))
    got, want = logits(build_model(load_gguf(fused))), logits(build_model(load_gguf(apart)))
    assert np.array_equal(got, want)
    quantized = write_gguf(checkpoint, tmp_path / "q.gguf", mixed, edit=_fuse_qkv)
    got = logits(build_model(load_gguf(quantized)))
    stored = load_local_dir(checkpoint_of(quantized, checkpoint, tmp_path / "x"))
    assert np.abs(got - logits(build_model(stored))).max() <= 1e-4


@pytest.mark.parametrize(("arch", "edit", "message"), REFUSED, ids=[m for _, _, m in REFUSED])
def test_files_the_runner_cannot_map_are_refused_naming_what(
    tmp_path: Path, arch: str, edit, message: str
) -> None:
    """A required key missing or impossible, a tensor no mapping knows, a fused projection the
    checkpoint has apart: ModelLoadError naming it."""
    checkpoint = tiny_checkpoint(arch, tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", edit=edit)
    with pytest.raises(ModelLoadError, match=message):
        load_gguf(path)


def test_unsupported_architectures_and_broken_files_are_refused_naming_them(tmp_path: Path) -> None:
    import gguf as gguf_package

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


@pytest.mark.parametrize(
    "ggml_type",
    ["Q6_K", "Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ2_S",
     "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"],
)  # fmt: skip
def test_ggml_block_layers_compute_llama_cpp_values_and_fall_back_exactly(ggml_type: str) -> None:
    """A GGMLLinear / GGMLEmbedding dequantizes its blocks with MLX (the grid i-quants with
    numpy) to llama.cpp's values bit for bit (runner/sources/gguf/quants.py's, checked against
    gguf-py's), for a quantizer's blocks (the grid types': random ones of finite scales) and
    for random ones (every code, extreme and subnormal float16 scales); where no native step
    reads them, `release_blocks` makes Q4_K (Q5_K) MLX's affine 4-bit (5-bit), IQ2_XXS,
    IQ3_XXS, IQ3_S and IQ1_S its 8-bit codes, and the others float32 layers of the very same
    values, and `adopt_blocks` without `keep` does the same before the load."""
    import mlx.core as mx
    import mlx.nn as nn

    from runner.models import quantized
    from runner.sources.gguf import quants
    from tests.gguf_files import assert_bits_equal, make_blocks
    from tests.gguf_models import QUANTIZERS, T

    kind = getattr(quants, ggml_type)
    quantize = QUANTIZERS[getattr(T, ggml_type)]
    bits = {"Q4_K": 4, "Q5_K": 5, "IQ2_XXS": 8, "IQ3_XXS": 8, "IQ3_S": 8, "IQ1_S": 8}.get(
        ggml_type, 0
    )
    rng = np.random.default_rng(3)
    rows, width = 24, 512
    blocks = quantize(rng.normal(size=(rows, width)).astype(np.float32))
    want = quants.dequantize(blocks.reshape(-1), kind, (rows, width))
    random = make_blocks(rng, kind, rows * width // quants.TYPES[kind].block_size)
    assert_bits_equal(
        np.array(quantized.DEQUANTIZE[ggml_type](mx.array(random.reshape(rows, -1)))),
        quants.dequantize(random.reshape(-1), kind, (rows, width)),
    )
    x = mx.array(rng.normal(size=(3, width)).astype(np.float32))
    ids = mx.array([5, 0, 23])

    module = nn.Module()
    module.proj = quantized.GGMLLinear(width, rows, False, ggml_type)
    module.embed = quantized.GGMLEmbedding(rows, width, ggml_type)
    module.proj.blocks = module.embed.blocks = mx.array(blocks)
    np.testing.assert_array_equal(np.array(module.proj.dequantized()), want)
    np.testing.assert_array_equal(np.array(module.embed(ids)), want[np.array(ids)])
    before = np.array(module.proj(x))
    assert quantized.release_blocks(module)
    if bits:
        assert type(module.proj) is nn.QuantizedLinear and module.proj.group_size == 32
        assert module.proj.bits == bits
        assert isinstance(module.embed, nn.QuantizedEmbedding) and module.embed.bits == bits
    else:
        assert type(module.proj) is nn.Linear and type(module.embed) is nn.Embedding
    np.testing.assert_array_equal(np.array(module.embed(ids)), want[np.array(ids)])
    got = np.array(module.proj(x))
    assert np.abs(got - before).max() <= 1e-5 * np.abs(before).max()
    assert not quantized.release_blocks(module)  # nothing left to release

    fresh = nn.Module()
    fresh.proj = nn.Linear(width, rows, bias=False)
    weights = {"proj.blocks": mx.array(blocks)}
    config = {"proj": {"ggml_type": ggml_type}}
    rest = quantized.adopt_blocks(fresh, weights, config, ["proj"], keep=False)
    if bits:
        assert rest is not None and rest["proj"] == {**quantized.Q4_K_AFFINE, "bits": bits}
        values = mx.dequantize(
            weights["proj.weight"], weights["proj.scales"], weights["proj.biases"], 32, bits
        )
    else:
        assert rest is None and set(weights) == {"proj.weight"}
        values = weights["proj.weight"]
    np.testing.assert_array_equal(np.array(values), want)


def test_repacks_keep_half_scales_and_compute_the_same(tmp_path: Path, monkeypatch) -> None:
    """Repacks whose scales and biases float16 holds exactly (Q4_0, Q4_1, Q5_1, Q8_0 from a
    float16 d) keep them in float16, fewer bytes for a decode step to read, and the model
    computes bit for bit what it computes from the float32 ones, on the native step and on
    MLX's path (whose dequantize works in the scales' dtype: the embedding rows widen them)."""
    from runner.backend import Backend

    checkpoint = tiny_checkpoint("LlamaForCausalLM", tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", mixed)
    source = load_gguf(path)
    halves = {k for k, v in source.weights.items() if k.endswith(".scales")}
    assert halves and all(source.weights[k].dtype == mx.float16 for k in halves)
    assert source.weights["model.embed_tokens.scales"].dtype == mx.float16
    plain = dataclasses.replace(Backend.cpu(), native_step_max_tokens=None)
    narrow = [logits(build_model(load_gguf(path), b)) for b in (Backend.cpu(), plain)]
    monkeypatch.setattr(quants, "narrowed", lambda repacked: repacked)
    wide_source = load_gguf(path)
    assert wide_source.weights["model.embed_tokens.scales"].dtype == mx.float32
    wide = [logits(build_model(load_gguf(path), b)) for b in (Backend.cpu(), plain)]
    for got, want in zip(narrow, wide, strict=True):
        np.testing.assert_array_equal(got, want)
