"""Every quantization format the Go runner imports, from an Ollama store, end to end.

For each format (affine int4 / int8, mxfp4, mxfp8, nvfp4, and nvfp4 with global scales),
on an untied model (Llama: its head quantized) and a tied one (Qwen3: its embedding, and so
its head, quantized): the model computes exactly what the same packed tensors compute when
dequantized by MLX (`mx.dequantize`, times the global scale) and multiplied densely; it stays
within the format's rounding of the dense model; and candidate logits equal the full
unembedding's at those ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runner.models import Model, build_model
from runner.models.quantized import ScaledQuantizedEmbedding, ScaledQuantizedLinear
from runner.sources.ollama_store import load_store_model
from runner.sources.source import ModelLoadError
from tests.ollama_store import (
    add_tensor_layer,
    dequantized,
    quantized_blob_arrays,
    write_ollama_model,
)
from tests.tiny import load_tiny_model, write_tiny_model

IDS = mx.array([[5, 17, 42, 99, 23, 8, 61, 7, 19, 33]], dtype=mx.int32)
CANDIDATES = mx.array([3, 7, 11, 42, 300, 383], dtype=mx.int32)
# (format, the smallest correlation with the dense model's logits): 4-bit formats round
# the tiny random weights coarsely, 8-bit ones finely
FORMATS = [("int4", 0.97), ("int8", 0.999), ("mxfp4", 0.95), ("mxfp8", 0.995), ("nvfp4", 0.97)]
HEADS = {"LlamaForCausalLM": "lm_head", "Qwen3ForCausalLM": "model.embed_tokens"}


def last_logits(model: Model) -> tuple[mx.array, np.ndarray]:
    hidden = model.hidden(IDS, model.make_caches())[0, -1:]
    return hidden, np.array(model.unembed(hidden).astype(mx.float32))


def check(model: Model, dense: Model, exact: Model, min_correlation: float) -> None:
    hidden, full = last_logits(model)
    assert np.abs(full - last_logits(exact)[1]).max() <= 1e-4
    assert np.corrcoef(full.ravel(), last_logits(dense)[1].ravel())[0, 1] > min_correlation
    picked = np.array(model.unembed_candidates(hidden, CANDIDATES))  # type: ignore[attr-defined]
    assert np.abs(picked - full[:, np.array(CANDIDATES)]).max() <= 1e-5


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("dense")
    return {arch: load_tiny_model(arch, root / arch) for arch in HEADS}


@pytest.mark.parametrize("arch", list(HEADS))
@pytest.mark.parametrize(("quant_type", "min_correlation"), FORMATS)
def test_store_format_computes_its_dequantized_weights(
    tmp_path: Path, dense_models: dict[str, Model], arch: str, quant_type: str, min_correlation
) -> None:
    head = HEADS[arch]
    hf = write_tiny_model(arch, tmp_path / "hf")
    quantize = {"type": quant_type, "types": {f"{head}.weight": quant_type}}
    write_ollama_model(tmp_path / "store", "tiny", hf, quantize=quantize)
    source = load_store_model("tiny", tmp_path / "store")
    model = build_model(source)
    out = model.module.model.embed_tokens if head.startswith("model.") else model.module.lm_head
    assert isinstance(out, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    q_proj = model.module.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear)
    assert (q_proj.mode, q_proj.bits) == (source.quantization["mode"], int(quant_type[-1]))
    check(model, dense_models[arch], build_model(dequantized(source)), min_correlation)


def _nvfp4_with_global_scale(
    arr: mx.array, name: str, per_row: bool, spelling: str
) -> dict[str, mx.array]:
    """nvfp4 blob arrays of `arr` / scale with the scale as a global one."""
    amax = mx.abs(arr).max(axis=1) if per_row else mx.abs(arr).max()
    scale = (amax / 3.0).astype(mx.float32)  # the weight / scale lies within fp4's range
    arrays = quantized_blob_arrays(name, arr / (scale[:, None] if per_row else scale), "nvfp4")
    key = f"{name}.global_scale" if spelling == "global_scale" else f"{name}_scale_2"
    arrays[key] = scale.reshape(-1) if per_row else scale.reshape(1)
    return arrays


@pytest.mark.parametrize("arch", list(HEADS))
@pytest.mark.parametrize(("per_row", "spelling"), [(False, "global_scale"), (True, "scale_2")])
def test_nvfp4_global_scales_multiply_outputs_and_rows(
    tmp_path: Path, dense_models: dict[str, Model], arch: str, per_row: bool, spelling: str
) -> None:
    """A global scale, one for the tensor or one per row, under either name, on a linear
    layer and on the head (for Qwen3 the tied embedding: its rows and its product)."""
    head = HEADS[arch]
    hf = write_tiny_model(arch, tmp_path / "hf")
    quantize = {"type": "nvfp4", "types": {f"{head}.weight": "nvfp4"}}
    write_ollama_model(tmp_path / "store", "tiny", hf, quantize=quantize)
    dense = mx.load(str(hf / "model.safetensors"))
    for tensor in (f"{head}.weight", "model.layers.1.self_attn.q_proj.weight"):
        arrays = _nvfp4_with_global_scale(dense[tensor], tensor, per_row, spelling)  # type: ignore[call-overload]
        meta = {"quant_type": "nvfp4", "group_size": "16"}
        add_tensor_layer(tmp_path / "store", "tiny", tensor, arrays, meta)
    source = load_store_model("tiny", tmp_path / "store")
    model = build_model(source)
    q_proj = model.module.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, ScaledQuantizedLinear)
    out = model.module.model.embed_tokens if head.startswith("model.") else model.module.lm_head
    assert isinstance(out, (ScaledQuantizedLinear, ScaledQuantizedEmbedding))
    assert "global_scale" in out
    check(model, dense_models[arch], build_model(dequantized(source)), 0.97)


def test_mixed_formats_per_tensor(tmp_path: Path, dense_models: dict[str, Model]) -> None:
    """One model, a format per tensor stated in each blob's per-tensor metadata."""
    types: dict[str, Any] = {
        "lm_head.weight": "mxfp8",
        "model.layers.0.self_attn.q_proj.weight": "nvfp4",
        "model.layers.0.mlp.down_proj.weight": "int8",
        "model.layers.1.self_attn.k_proj.weight": "mxfp4",
        "model.layers.1.mlp.up_proj.weight": None,
    }
    hf = write_tiny_model("LlamaForCausalLM", tmp_path / "hf")
    quantize = {"type": "int4", "metadata": "tensor", "types": types}
    write_ollama_model(tmp_path / "store", "tiny", hf, quantize=quantize)
    source = load_store_model("tiny", tmp_path / "store")
    model = build_model(source)
    layers = model.module.model.layers
    modes = [
        (layer.mode, layer.bits)
        for layer in (
            model.module.lm_head,
            layers[0].self_attn.q_proj,
            layers[0].mlp.down_proj,
            layers[1].self_attn.k_proj,
            layers[1].self_attn.q_proj,
        )
    ]
    assert modes == [("mxfp8", 8), ("nvfp4", 4), ("affine", 8), ("mxfp4", 4), ("affine", 4)]
    assert not isinstance(layers[1].mlp.up_proj, nn.QuantizedLinear)
    check(model, dense_models["LlamaForCausalLM"], build_model(dequantized(source)), 0.95)


@pytest.mark.parametrize(
    ("name", "scale", "message"),
    [
        ("model.layers.0.input_layernorm.weight_scale_2", [0.5], "needs a quantized linear"),
        ("model.layers.0.mlp.up_proj.weight.global_scale", [1, 2, 3], "3 global scales for 128"),
    ],
)
def test_impossible_global_scales_are_refused(
    tmp_path: Path, name: str, scale: list[float], message: str
) -> None:
    hf = write_tiny_model("LlamaForCausalLM", tmp_path / "hf")
    write_ollama_model(tmp_path / "store", "tiny", hf, quantize={"type": "nvfp4"})
    add_tensor_layer(tmp_path / "store", "tiny", name, {name: mx.array(scale, mx.float32)})
    with pytest.raises(ModelLoadError, match=message):
        build_model(load_store_model("tiny", tmp_path / "store"))
