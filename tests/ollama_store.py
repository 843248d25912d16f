"""Test helper: import a Hugging Face directory into an Ollama model store the way Ollama's
safetensors importer does (`ollama create` with an MLX model; docs/PROTOCOL.md §1.2).

One tensor layer per tensor, named by the tensor name, each a safetensors blob addressed by
its sha256; every *.json but the shard index becomes a JSON layer named by its file name; the
manifest's config is a ConfigV2 blob. Optionally 2-D linear weights are quantized with
`mx.quantize` into Ollama's blob format: `<t>` packed, `<t>.scale`, `<t>.bias`.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from runner.sources.ollama_store import JSON_MEDIA_TYPE, TENSOR_MEDIA_TYPE, parse_name, quant_params
from runner.sources.source import ModelSource

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"


def _put_blob(models_dir: Path, data: bytes, media_type: str, name: str | None = None) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = models_dir / "blobs" / digest.replace(":", "-")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():  # content-addressed: equal bytes share one blob
        path.write_bytes(data)
    layer = {"mediaType": media_type, "digest": digest, "size": len(data)}
    if name is not None:
        layer["name"] = name
    return layer


def _safetensors_bytes(arrays: dict[str, mx.array], metadata: dict[str, str] | None) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "blob.safetensors"
        mx.save_safetensors(str(path), arrays, metadata=metadata or {})
        return path.read_bytes()


def _should_quantize(name: str, arr: mx.array, group_size: int, named: bool = False) -> bool:
    # Ollama's importer quantizes linear weights (experts stacked [E, out, in] too), never
    # embeddings or norms; a pre-quantized source may quantize an embedding (a tensor
    # `named` in `types`).
    return (
        name.endswith(".weight")
        and (arr.ndim == 2 or (arr.ndim == 3 and ".experts." in name))
        and ("embed" not in name or named)
        and "norm" not in name
        and arr.shape[-1] % group_size == 0
    )


def quantized_blob_arrays(
    name: str, arr: mx.array, quant_type: str, group_size: int | None = None
) -> dict[str, mx.array]:
    """`<t>`, `<t>.scale` and (affine only) `<t>.bias`, as Ollama's importer writes them."""
    default_group, bits, mode = quant_params(quant_type)
    packed, scales, *biases = mx.quantize(arr, group_size or default_group, bits, mode=mode)
    out = {name: packed, name + ".scale": scales}
    if biases:
        out[name + ".bias"] = biases[0]
    return out


def write_ollama_model(
    models_dir: Path, name: str, hf_dir: Path, *, quantize: dict[str, Any] | None = None
) -> None:
    """Import `hf_dir` into `models_dir` as model `name`.

    `quantize`, if given: `{"type": "int4" | "int8" | ..., "group_size": N (default: the
    type's), "metadata": "blob" | "tensor" | "none", "types": {tensor: type}}`. "blob" writes
    `__metadata__` quant_type/group_size, "tensor" the per-tensor `<t>.quant_type` keys of
    mixed blobs, and "none" nothing, leaving group and bits to shape inference. `types`
    overrides the type per tensor (a tensor mapped to None stays dense; an embedding named
    there is quantized too).
    """
    models_dir, hf_dir = Path(models_dir), Path(hf_dir)
    quantize = dict(quantize or {})
    per_tensor_types = quantize.get("types", {})
    metadata_style = quantize.get("metadata", "blob")

    weights: dict[str, mx.array] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        weights.update(mx.load(str(file)))

    layers = []
    for tensor_name in sorted(weights):
        arr = weights[tensor_name]
        quant_type = per_tensor_types.get(tensor_name, quantize.get("type"))
        group_size = quantize.get("group_size") or (
            quant_params(quant_type)[0] if quant_type else 0
        )
        metadata = None
        named = tensor_name in per_tensor_types
        if quant_type and _should_quantize(tensor_name, arr, group_size, named):
            arrays = quantized_blob_arrays(tensor_name, arr, quant_type, group_size)
            if metadata_style == "blob":
                metadata = {"quant_type": quant_type, "group_size": str(group_size)}
            elif metadata_style == "tensor":
                metadata = {
                    tensor_name + ".quant_type": quant_type,
                    tensor_name + ".group_size": str(group_size),
                }
        else:
            arrays = {tensor_name: arr}
        data = _safetensors_bytes(arrays, metadata)
        layers.append(_put_blob(models_dir, data, TENSOR_MEDIA_TYPE, tensor_name))

    for file in sorted(hf_dir.glob("*.json")):
        if file.name != "model.safetensors.index.json":
            layers.append(_put_blob(models_dir, file.read_bytes(), JSON_MEDIA_TYPE, file.name))

    config_v2 = {"model_format": "safetensors", "capabilities": ["completion"]}
    config_layer = _put_blob(models_dir, json.dumps(config_v2).encode(), CONFIG_MEDIA_TYPE)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config_layer,
        "layers": layers,
    }
    path = parse_name(name).manifest_path(models_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))


def add_tensor_layer(
    models_dir: Path,
    name: str,
    layer_name: str,
    arrays: dict[str, mx.array],
    metadata: dict[str, str] | None = None,
) -> None:
    """Append one hand-made tensor blob (any tensor names, any metadata) to model `name`."""
    path = parse_name(name).manifest_path(Path(models_dir))
    manifest = json.loads(path.read_text())
    data = _safetensors_bytes(arrays, metadata)
    manifest["layers"].append(_put_blob(Path(models_dir), data, TENSOR_MEDIA_TYPE, layer_name))
    path.write_text(json.dumps(manifest))


def dequantized(source: ModelSource) -> ModelSource:
    """`source` with every quantized tensor replaced by MLX's dequantization of it (times
    its global scale): the dense model the quantized one must compute exactly."""
    weights = dict(source.weights)
    for name in [n for n in weights if n.endswith(".scales")]:
        p = name.removesuffix(".scales")
        params = source.quantization[p]  # type: ignore[index]
        dense = mx.dequantize(
            weights[f"{p}.weight"],
            weights.pop(name),
            weights.pop(f"{p}.biases", None),
            params["group_size"],
            params["bits"],
            params["mode"],
            dtype=mx.float32,
        )
        scale = weights.pop(f"{p}.global_scale", None)
        if scale is not None:
            scale = scale.reshape(-1)
            dense = dense * (scale[:, None] if scale.size > 1 else scale)
        weights[f"{p}.weight"] = dense
    return ModelSource(
        name=source.name, config=source.config, tokenizer_json=source.tokenizer_json,
        weights=weights,
    )  # fmt: skip


def write_ollama_gguf_model(
    models_dir: Path, name: str, gguf_path: Path, text_layers: dict[str, bytes] | None = None
) -> None:
    """Store the GGUF file as model `name` the way `ollama pull` stores one: the file as the
    `application/vnd.ollama.image.model` layer, `text_layers` (media type -> bytes: template,
    params, system, license) beside it, a ConfigV2 blob saying `model_format` gguf."""
    from runner.sources.ollama_store import MODEL_MEDIA_TYPE

    layers = [_put_blob(models_dir, gguf_path.read_bytes(), MODEL_MEDIA_TYPE)]
    for media_type, data in (text_layers or {}).items():
        layers.append(_put_blob(models_dir, data, media_type))
    config_v2 = {"model_format": "gguf", "model_family": "llama", "capabilities": ["completion"]}
    config_layer = _put_blob(models_dir, json.dumps(config_v2).encode(), CONFIG_MEDIA_TYPE)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config_layer,
        "layers": layers,
    }
    path = parse_name(name).manifest_path(models_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
