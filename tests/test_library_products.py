"""Products computed from MLX's graph by the CPU backend's library
(runner/backend/library_products.py): a mixture of experts' GGUF keeps its stacked experts in
their blocks (runner/models/quantized.py's GGMLSwitchLinear), and a family without a native
step its matrices (GGMLLinear, GGMLEmbedding): resident at the file's bytes, computing what
MLX's products compute over llama.cpp's dequantized values. Where the library does not
compute them, they become MLX's formats of the same values, as they were (Q4_K and the 8-bit
grid types affine, the others float32). MLX's own affine experts (mlx-lm's conversions)
compute by the library too (AffineSwitchLinear), not by MLX's CPU gather_qmm."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from runner.backend import Backend, library_products
from runner.models import build_model, quantized
from runner.sources.gguf import quants
from runner.sources.gguf.model import load_gguf
from runner.sources.loader import load_local_dir
from tests.gguf_models import (
    QUANTIZERS,
    T,
    checkpoint_of,
    expert_types,
    mixed,
    moe_checkpoint,
    quantized_moe,
    tiny_checkpoint,
    write_gguf,
)

TYPES = ["Q6_K", "Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ2_XXS", "IQ2_XS",
         "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]  # fmt: skip
# gate_up_proj, down_proj: a call's input [..., m, k] and its expert indices
CALLS = {
    "decode": ((1, 1, 1, 1), (1, 1, 3)),  # SwitchGLU's gate / up of one token
    "prefill": ((1, 9, 1, 1), (1, 9, 3)),
    "down": ((2, 4, 3, 1), (2, 4, 3)),  # its down projection: a row per chosen expert
    "sorted": ((40, 1), (40,)),  # its sorted path (64 or more choices): flat, in order
}


def _products() -> library_products.LibraryProducts:
    products = library_products.for_backend(Backend.for_device())
    if products is None:
        pytest.skip("no native library preloaded (runner/native/preload.py)")
    return products


def _expert_blocks(ggml_type: str, experts: int, rows: int, width: int) -> np.ndarray:
    """Experts' blocks [experts, rows, bytes a row] of a quantizer of random normals."""
    rng = np.random.default_rng(11)
    values = rng.normal(size=(experts, rows, width)).astype(np.float32)
    return QUANTIZERS[getattr(T, ggml_type)](values)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("native", [True, False], ids=["native", "mlx"])
def test_ggml_layers_over_blocks_compute_the_float64_products_of_their_values(
    ggml_type: str, native: bool
) -> None:
    """GGMLSwitchLinear's products (the library's, or MLX's path over the chosen experts)
    equal a float64 gather of llama.cpp's values for the shapes mlx-lm's SwitchGLU calls with
    (a decode step's token, a prefill's, the down projection's rows, the sorted flat path),
    its bias added; experts no token chose are never read (theirs are NaN scales here).
    GGMLLinear's and a tied GGMLEmbedding's products likewise, for one row and for several."""
    kind = getattr(quants, ggml_type)
    experts, rows = 6, 40
    width = 256 if ggml_type == "IQ4_NL" else 512
    blocks = _expert_blocks(ggml_type, experts, rows, width)
    blocks[4] = 0xFF  # expert 4: every scale NaN, never chosen
    values = quants.dequantize(blocks.reshape(-1), kind, (experts, rows, width)).astype(np.float64)
    layer = quantized.GGMLSwitchLinear(width, rows, experts, True, ggml_type)
    layer.blocks = mx.array(blocks)
    rng = np.random.default_rng(5)
    bias = rng.normal(size=(experts, rows)).astype(np.float32)
    layer.bias = mx.array(bias)
    layer.products = _products() if native else None
    for name, (x_lead, index_shape) in CALLS.items():
        x = rng.normal(size=(*x_lead, width)).astype(np.float32)
        indices = rng.choice([0, 1, 2, 3, 5], size=index_shape).astype(np.uint32)
        if name == "sorted":
            indices.sort()
        got = np.array(layer(mx.array(x), mx.array(indices), sorted_indices=name == "sorted"))
        batch = np.broadcast_shapes(x.shape[:-2], indices.shape)
        xs = np.broadcast_to(x, (*batch, *x.shape[-2:])).astype(np.float64)
        w = values[np.broadcast_to(indices, batch)]  # [batch..., rows, width]
        want = (
            np.einsum("...mk,...nk->...mn", xs, w)
            + bias[np.broadcast_to(indices, batch)][..., None, :]
        )
        scale = np.einsum("...mk,...nk->...mn", np.abs(xs), np.abs(w)).max()
        assert got.shape == want.shape, name
        assert np.abs(got - want).max() <= 1e-5 * scale, name

    linear = quantized.GGMLLinear(width, rows, True, ggml_type)
    embedding = quantized.GGMLEmbedding(rows, width, ggml_type)
    linear.blocks = embedding.blocks = mx.array(blocks[2])
    linear.bias = mx.array(bias[2])
    linear.products = embedding.products = layer.products
    for lead in ((1, 1), (2, 5)):
        x = rng.normal(size=(*lead, width)).astype(np.float32)
        want = x.astype(np.float64) @ values[2].T
        scale = (np.abs(x) @ np.abs(values[2]).T).max()
        got = np.array(embedding.as_linear(mx.array(x)))
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * scale
        got = np.array(linear(mx.array(x))) - bias[2]
        assert np.abs(got - want).max() <= 1e-5 * scale


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "IQ3_S"])
def test_experts_not_kept_become_mlx_formats_of_the_same_values(ggml_type: str) -> None:
    """Without products (another backend, a sharded model), stacked experts' blocks become
    MLX's affine quantization where their type has one (Q4_K: 4 bits in groups of 32; IQ3_S:
    8 bits), else float32: the very same values."""
    kind = getattr(quants, ggml_type)
    experts, rows, width = 3, 16, 512
    blocks = _expert_blocks(ggml_type, experts, rows, width)
    want = quants.dequantize(blocks.reshape(-1), kind, (experts, rows, width))
    module = nn.Module()
    module.mlp = nn.Module()
    module.mlp.switch_mlp = nn.Module()
    module.mlp.switch_mlp.gate_proj = SwitchLinear(width, rows, experts, bias=False)
    weights = {"mlp.experts.gate_proj.blocks": mx.array(blocks)}
    config = {"mlp.experts.gate_proj": {"ggml_type": ggml_type}}
    paths = ["mlp.experts.gate_proj"]
    quantized.adopt_blocks(module, weights, config, paths, keep=True, products=None)
    assert type(module.mlp.switch_mlp.gate_proj) is SwitchLinear  # not kept
    if ggml_type == "Q6_K":
        assert set(weights) == {"mlp.experts.gate_proj.weight"}
        got = weights["mlp.experts.gate_proj.weight"]
    else:
        bits = 4 if ggml_type == "Q4_K" else 8
        got = mx.dequantize(
            weights["mlp.experts.gate_proj.weight"],
            weights["mlp.experts.gate_proj.scales"],
            weights["mlp.experts.gate_proj.biases"],
            32,
            bits,
        )
    np.testing.assert_array_equal(np.array(got), want)


SEQUENCE = [(7 * i + 3) % 300 for i in range(37)]  # 37 tokens: 74 choices, the sorted path
# Experts' types of each file: (gate and up, down)
FILES = {
    "q4_k_m": (T.Q4_K, T.Q6_K),
    "q3_k_m": (T.Q3_K, T.Q4_K),
    "iq4_xs": (T.IQ4_XS, T.IQ4_XS),
    "grid": (T.IQ3_S, T.IQ2_XXS),
}


def _logits(model: Any, tokens: list[int] = SEQUENCE) -> np.ndarray:
    ids = mx.array([tokens], dtype=mx.int32)
    return np.array(model.unembed(model.hidden(ids, model.make_caches()))[0])


def _decoded(model: Any, tokens: list[int] = SEQUENCE, prompt: int = 30) -> np.ndarray:
    """The logits of `tokens[prompt:]` by decode steps (one token a forward) after a prompt."""
    caches = model.make_caches()
    mx.eval(model.hidden(mx.array([tokens[:prompt]], dtype=mx.int32), caches))
    rows = []
    for token in tokens[prompt:]:
        hidden = model.hidden(mx.array([[token]], dtype=mx.int32), caches)
        rows.append(np.array(model.unembed(hidden)[0, -1]))
    return np.stack(rows)


def _switch_layers(model: Any) -> dict[str, nn.Module]:
    return {
        p: m for p, m in model.module.named_modules() if ".switch_mlp." in p and p.endswith("_proj")
    }


@pytest.mark.parametrize("file", list(FILES))
def test_a_moe_gguf_keeps_its_experts_in_blocks_and_computes_their_values(
    tmp_path: Path, file: str
) -> None:
    """A Qwen3-MoE GGUF's stacked experts (a Q4_K_M file's Q4_K gate and up and Q6_K down, a
    Q3_K_M's, an IQ4_XS's, grid i-quants') and its K-quant matrices (Q4_K_M's Q6_K head,
    embedding and attn_v, Q4_K attention) stay in their blocks on the CPU: every switch layer
    a GGMLSwitchLinear holding the file's very bytes, every matrix a GGMLLinear /
    GGMLEmbedding, the model's weights no more bytes than the file's tensors. The native step
    reads every layer's blocks, its experts' included; the forwards it declines compute them
    by the library from MLX's graph. The logits (a prefill, decode steps after a prompt, as
    plain forwards and as decode steps) are those of the checkpoint of the file's values
    through the directory loader within 1e-4, as are those of MLX's path through the library,
    of MLX's path over the blocks and of the backend without the library's paths (MLX's
    formats)."""
    _products()  # (skips without the library)
    gate_up, down = FILES[file]
    checkpoint = moe_checkpoint(tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", expert_types(gate_up, down))
    reference = build_model(load_local_dir(checkpoint_of(path, checkpoint, tmp_path / "x")))
    want = _logits(reference)
    assert np.abs(want).max() > 0.5  # (the experts' weights move the logits)

    model = build_model(load_gguf(path))
    layers = _switch_layers(model)
    assert len(layers) == 6
    stored_all = _file_tensors(path)
    stored = {n: a for n, a in stored_all.items() if "_exps." in n}
    for name, layer in layers.items():
        assert isinstance(layer, quantized.GGMLSwitchLinear) and layer.products is not None
        layer_index, proj = name.split(".")[2], name.rsplit(".", 1)[1].removesuffix("_proj")
        blocks = stored[f"blk.{layer_index}.ffn_{proj}_exps.weight"]
        assert layer.ggml_type == (down if proj == "down" else gate_up).name
        np.testing.assert_array_equal(np.array(layer.blocks).reshape(-1), blocks.reshape(-1))
    matrices = {
        p: m
        for p, m in model.module.named_modules()
        if isinstance(m, quantized.GGMLLinear | quantized.GGMLEmbedding)
    }
    # q, k, v, o a layer, the embedding and the head: every matrix of whole 256s
    assert len(matrices) == 4 * 2 + 2
    computed = [*matrices.values(), *layers.values()]
    assert all(isinstance(m.products, library_products.LibraryProducts) for m in computed)
    params = dict(tree_flatten(model.module.parameters()))
    assert sum(a.nbytes for a in params.values()) <= sum(a.nbytes for a in stored_all.values())
    native = model.native
    # q, k, v, o and three switch layers a layer from their blocks (the router is float32)
    assert native is not None and native.quantized == 2 * 7
    assert np.abs(_logits(model) - want).max() <= 1e-4
    assert np.abs(_decoded(model) - want[30:]).max() <= 1e-4
    with model.decode_steps():  # by limbs where the library has them
        assert np.abs(_decoded(model) - want[30:]).max() <= 1e-4
    with model.mlx_only():  # MLX's graph, the library's products
        assert np.abs(_logits(model) - want).max() <= 1e-4
        assert np.abs(_decoded(model) - want[30:]).max() <= 1e-4
        for layer in computed:  # MLX's path over the same blocks
            layer.products = None
        assert np.abs(_logits(model) - want).max() <= 1e-4

    mlx_only = dataclasses.replace(Backend.for_device(), native_step_max_tokens=None)
    converted = build_model(load_gguf(path), mlx_only)
    kinds = {type(m).__mro__[1] if type(m).__name__ == "Float32SwitchLinear" else type(m)
             for m in _switch_layers(converted).values()}  # fmt: skip
    affine = {t.name for t in (gate_up, down)} & set(quantized.AFFINE_REPACKS)
    assert (QuantizedSwitchLinear in kinds) == bool(affine)
    assert not any(issubclass(k, quantized.GGMLSwitchLinear) for k in kinds)
    assert np.abs(_logits(converted) - want).max() <= 1e-4


def _file_tensors(path: Path) -> dict[str, np.ndarray]:
    import gguf

    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize(
    ("bits", "group", "scales"),
    [
        (4, 64, "float32"), (4, 32, "bfloat16"), (5, 64, "float16"), (8, 128, "float32"),
        (2, 64, "float16"), (3, 32, "bfloat16"), (6, 128, "float32"),  # mlx-community's 3/6-bit
        (4, 32, "mxfp4"),  # MLX's mxfp4 mode: e2m1 codes, e8m0 scales, no biases (gpt-oss)
    ],
)  # fmt: skip
def test_affine_experts_compute_the_float64_products_of_their_values(
    bits: int, group: int, scales: str
) -> None:
    """An AffineSwitchLinear (mlx-lm's QuantizedSwitchLinear, MLX's affine experts, computed by
    the library) equals a float64 gather of mx.dequantize's values (float32 scales and
    biases, what gather_qmm multiplies with) for SwitchGLU's shapes, its bias added, as does
    MLX's own gather_qmm without products; an AffineLinear and a tied quantized embedding's
    head computed by the library likewise, for one row and for several. The same for MLX's
    mxfp4 mode, whose values are exact in float32."""
    experts, rows, width = 5, 48, 256
    rng = np.random.default_rng(7)
    w = rng.normal(size=(experts, rows, width)).astype(np.float32)
    mode = "mxfp4" if scales == "mxfp4" else "affine"
    layer = QuantizedSwitchLinear(
        width, rows, experts, bias=True, group_size=group, bits=bits, mode=mode
    )
    bias = rng.normal(size=(experts, rows)).astype(np.float32)
    layer.bias = mx.array(bias)
    if mode == "mxfp4":
        q, s = mx.quantize(mx.array(w), group, bits, mode=mode)
        layer.weight, layer.scales = q, s
        assert "biases" not in layer and s.dtype == mx.uint8
        values = np.array(
            mx.dequantize(q, s, group_size=group, bits=bits, mode=mode, dtype=mx.float32)
        )
        values = values.astype(np.float64)
    else:
        q, s, b = mx.quantize(mx.array(w), group, bits)
        dtype = getattr(mx, scales)
        layer.weight, layer.scales, layer.biases = q, s.astype(dtype), b.astype(dtype)
        values = np.array(
            mx.dequantize(q, s.astype(dtype).astype(mx.float32),
                          b.astype(dtype).astype(mx.float32), group, bits)
        ).astype(np.float64)  # fmt: skip
    products = _products()
    assert products.reads_affine(layer)
    assert quantized.compute_affine(layer, products) == 1
    assert isinstance(layer, quantized.AffineSwitchLinear)
    for name, (x_lead, index_shape) in CALLS.items():
        x = rng.normal(size=(*x_lead, width)).astype(np.float32)
        indices = rng.integers(0, experts, size=index_shape).astype(np.uint32)
        if name == "sorted":
            indices.sort()
        batch = np.broadcast_shapes(x.shape[:-2], indices.shape)
        chosen = np.broadcast_to(indices, batch)
        xs = np.broadcast_to(x, (*batch, *x.shape[-2:])).astype(np.float64)
        want = np.einsum("...mk,...nk->...mn", xs, values[chosen]) + bias[chosen][..., None, :]
        scale = np.einsum("...mk,...nk->...mn", np.abs(xs), np.abs(values[chosen])).max()
        for computed in (products, None):
            layer.products = computed
            got = np.array(layer(mx.array(x), mx.array(indices), sorted_indices=name == "sorted"))
            assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * scale, name

    linear = nn.QuantizedLinear(width, rows, bias=True, group_size=group, bits=bits, mode=mode)
    embedding = quantized.ScaledQuantizedEmbedding(
        rows, width, group_size=group, bits=bits, mode=mode
    )
    for one in (linear, embedding):
        one.weight, one.scales = layer.weight[2], layer.scales[2]
        if mode == "affine":
            one.biases = layer.biases[2]
    linear.bias = mx.array(bias[2])
    assert quantized.compute_affine(linear, products) == 1
    assert quantized.compute_affine(embedding, products) == 1
    assert type(linear) is quantized.AffineLinear and embedding.products is products
    for lead in ((1, 1), (2, 5)):
        x = rng.normal(size=(*lead, width)).astype(np.float32)
        want = x.astype(np.float64) @ values[2].T
        scale = (np.abs(x) @ np.abs(values[2]).T).max()
        got = np.array(linear(mx.array(x))) - bias[2]
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * scale
        got = np.array(embedding.as_linear(mx.array(x)))
        assert np.abs(got - want).max() <= 1e-5 * scale


def test_an_mlx_quantized_moe_computes_its_experts_by_the_library(tmp_path: Path) -> None:
    """A Qwen3-MoE quantized as mlx-lm quantizes it (affine, 4 bits, groups of 64: every
    linear layer, the experts and the embedding; the router 8 bits) is read by the native
    step, and the forwards the step declines compute its experts (AffineSwitchLinear) and its
    matrices (AffineLinear) by the library from MLX's graph: the logits of a prefill and of
    decode steps, both ways, within 1e-4 of MLX's own gather_qmm and quantized_matmul on the
    same weights (the backend without the library's paths)."""
    _products()
    out = quantized_moe(moe_checkpoint(tmp_path / "hf"), tmp_path / "q4", 4, 64)
    mlx_only = dataclasses.replace(Backend.for_device(), native_step_max_tokens=None)
    reference = build_model(load_local_dir(out), mlx_only)
    assert all(type(m) is QuantizedSwitchLinear for m in _switch_layers(reference).values())
    want = _logits(reference)
    model = build_model(load_local_dir(out))
    layers = _switch_layers(model)
    assert len(layers) == 6
    assert all(type(m) is quantized.AffineSwitchLinear and m.products for m in layers.values())
    linears = [m for _, m in model.module.named_modules() if isinstance(m, nn.QuantizedLinear)]
    # q, k, v, o and the router a layer, and the head: none left to MLX's quantized_matmul
    assert len(linears) == 5 * 2 + 1
    assert all(type(m) is quantized.AffineLinear and m.products for m in linears)
    native = model.native  # q, k, v, o, the router and three switch layers a layer
    assert native is not None and native.quantized == 2 * 8
    assert np.abs(_logits(model) - want).max() <= 1e-4
    assert np.abs(_decoded(model) - want[30:]).max() <= 1e-4
    with model.mlx_only():
        assert np.abs(_logits(model) - want).max() <= 1e-4
        assert np.abs(_decoded(model) - want[30:]).max() <= 1e-4


def test_a_gpt_oss_gguf_computes_its_mxfp4_experts_by_the_library(tmp_path: Path) -> None:
    """gpt-oss's GGUF (Ollama's gpt-oss:20b) stores its experts in MXFP4, which loads as MLX's
    mxfp4 mode: on the CPU the library computes them (AffineSwitchLinear over the same codes
    and scales), not MLX's CPU gather_qmm (~5 GFLOP/s at one row). The logits of a prefill
    and of decode steps after a prompt are those of the backend without the library's paths
    (gather_qmm on the same values) within 1e-4: MLX's path (the native step, which reads the
    same experts itself, set aside: tests/test_native_step.py has it)."""
    _products()
    checkpoint = tiny_checkpoint("GptOssForCausalLM", tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / "model.gguf", mixed)

    def experts(model: Any) -> list[nn.Module]:
        return [m for _, m in model.module.named_modules() if isinstance(m, QuantizedSwitchLinear)]

    mlx_only = dataclasses.replace(Backend.for_device(), native_step_max_tokens=None)
    reference = build_model(load_gguf(path), mlx_only)
    plain = experts(reference)
    assert plain and all(type(m) is QuantizedSwitchLinear and m.mode == "mxfp4" for m in plain)
    model = build_model(load_gguf(path))
    layers = experts(model)
    assert len(layers) == len(plain)
    assert all(type(m) is quantized.AffineSwitchLinear and m.products for m in layers)
    config = json.loads((checkpoint / "config.json").read_text())
    tokens = [t % int(config.get("text_config", config)["vocab_size"]) for t in SEQUENCE]
    want = _logits(reference, tokens)
    assert model.native is not None
    with model.mlx_only():
        assert np.abs(_logits(model, tokens) - want).max() <= 1e-4
        assert np.abs(_decoded(model, tokens) - want[30:]).max() <= 1e-4


def test_empty_inputs_give_empty_products() -> None:
    """No rows in, no rows out, as MLX's own products: a GGML linear and switch layer, and an
    affine linear and switch layer computed by the library."""
    products = _products()
    blocks = _expert_blocks("Q4_K", 3, 16, 256)
    switch = quantized.GGMLSwitchLinear(256, 16, 3, False, "Q4_K")
    linear = quantized.GGMLLinear(256, 16, False, "Q4_K")
    switch.blocks, linear.blocks = mx.array(blocks), mx.array(blocks[0])
    affine = nn.QuantizedLinear(256, 16, bias=False, group_size=64, bits=4)
    experts = QuantizedSwitchLinear(256, 16, 3, bias=False, group_size=64, bits=4)
    for layer in (switch, linear):
        layer.products = products
    assert quantized.compute_affine(affine, products) == 1
    assert quantized.compute_affine(experts, products) == 1
    x, none = mx.zeros((1, 0, 256)), mx.zeros((1, 0, 2), dtype=mx.uint32)
    assert linear(x).shape == affine(x).shape == (1, 0, 16)
    x = mx.zeros((1, 0, 1, 1, 256))
    assert switch(x, none).shape == experts(x, none).shape == (1, 0, 2, 1, 16)
