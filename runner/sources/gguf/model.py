"""A GGUF model file as a `ModelSource`: the checkpoint its metadata and tensors describe
(`architectures`), the tokenizer its `tokenizer.ggml.*` keys describe (`tokenizer`), and its
tensors converted exactly (`quants`): repacked onto MLX's quantization where that is exact,
kept as stored where they are floats or blocks the runner computes with (Q2_K to Q6_K, IQ4_XS,
IQ4_NL and the grid i-quants' layer weights, F16 and BF16 matrices as their rows' bytes, and
stacked experts' [experts, rows, bytes]: runner/models/quantized.py decides what each
becomes), dequantized to float32 otherwise;
never through MLX's own GGUF reader (which corrupts Q4_K). Every tensor of the file is
accounted for: one the architecture does not map fails the load, naming it.

The tensors are read through the file's memory map one at a time, so the peak is the model
plus one tensor's conversion. A log line says which types were repacked, which kept, which
dequantized, and the resident size against the file's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from runner.sources.gguf import architectures, quants
from runner.sources.gguf import tokenizer as gguf_tokenizer
from runner.sources.gguf.reader import GGUFFile, read_gguf
from runner.sources.source import ModelLoadError, ModelSource

# runner/models/quantized.py's names for a layer kept in GGML blocks (sources sit below models)
GGML_TYPE, BLOCKS = "ggml_type", "blocks"

log = logging.getLogger(__name__)


def load_gguf(path: str | Path, name: str | None = None) -> ModelSource:
    """The model in the GGUF file at `path` (named `name` in messages); ModelLoadError for a
    file that is not one, an architecture or tensor the runner does not map, a type it
    cannot read."""
    started = time.perf_counter()
    path = Path(path)
    name = name or path.name
    with read_gguf(path) as file:
        shapes = {n: t.shape for n, t in file.tensors.items()}
        plan = architectures.plan(file.metadata, shapes, lambda t: _floats(file, t))
        tokenizer_json, tokenizer_config, generation_config = gguf_tokenizer.tokenizer_files(
            file.metadata
        )
        weights, quantization, treated = _tensors(file, plan)
        resident = sum(int(w.nbytes) for w in weights.values())
        log.info(
            "loaded GGUF %s (%s, %d tensors) in %.2f s: %s; resident %.1f MB (file %.1f MB)",
            name,
            file.metadata.get("general.architecture"),
            len(file.tensors),
            time.perf_counter() - started,
            "; ".join(
                f"{how} {', '.join(f'{t} x{n}' for t, n in sorted(c.items()))}"
                for how, c in treated.items()
                if c
            ),
            resident / 1e6,
            file.file_size / 1e6,
        )
    config = dict(plan.config)
    for key in ("bos_token_id", "eos_token_id"):
        if key in generation_config:
            config.setdefault(key, generation_config[key])
    return ModelSource(
        name=name,
        config=config,
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
        weights=weights,
        quantization=quantization or None,
    )


def _floats(file: GGUFFile, name: str) -> np.ndarray:
    """A (small) tensor's float32 values, for what the config is made from."""
    if name not in file.tensors:
        raise ModelLoadError(f"GGUF: tensor {name} is missing")
    info = file.tensors[name]
    return quants.dequantize(file.raw(name), info.ggml_type, info.shape)


def _tensors(
    file: GGUFFile, plan: architectures.Plan
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Counter[str]]]:
    """The checkpoint's tensors as MLX arrays, the mlx-lm quantization config of the
    repacked ones, and how many tensors of each GGML type were repacked, kept or
    dequantized."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    layers: dict[str, dict[str, Any]] = {}
    blocks_of: dict[str, dict[str, str]] = {}  # layers kept in GGML blocks: their type
    treated: dict[str, Counter[str]] = {
        "repacked": Counter(),
        "kept": Counter(),
        "dequantized": Counter(),
    }
    for gguf_name, planned in plan.targets.items():
        if planned is None:
            continue
        info = file.tensors[gguf_name]
        parts = planned if isinstance(planned, tuple) else (planned,)
        if info.ggml_type in quants.KEPT_TYPES and _whole_weights(parts, info.shape):
            # kept as stored: the runner's GGML layers (runner/models/quantized.py) read them,
            # or make them what MLX's path reads where no native step does
            blocks = _raw_rows(file.raw(gguf_name), info.shape)
            treated["kept"][info.type_name] += 1
            for target in parts:
                base = target.name.removesuffix(".weight")
                rows = blocks if target.rows is None else blocks[target.rows]
                weights[f"{base}.{BLOCKS}"] = mx.array(np.ascontiguousarray(rows))
                blocks_of[base] = {GGML_TYPE: info.type_name}
            continue
        converted = quants.convert(file.raw(gguf_name), info.ggml_type, info.shape)
        if isinstance(converted, quants.Repacked) and not all(
            t.name.endswith(".weight")
            for t in (planned if isinstance(planned, tuple) else (planned,))
        ):  # only a layer's weight takes MLX's quantization (its .scales, .biases beside it)
            converted = quants.dequantize(file.raw(gguf_name), info.ggml_type, info.shape)
        # one GGUF tensor may be several checkpoint tensors (a fused Q/K/V: row ranges)
        plain = quants.kind(info.ggml_type) == "plain" and not any(t.minus_one for t in parts)
        how = "repacked" if isinstance(converted, quants.Repacked) else None
        treated[how or ("kept" if plain else "dequantized")][info.type_name] += 1
        for target in parts:
            if isinstance(converted, quants.Repacked):
                if target.minus_one:
                    raise ModelLoadError(
                        f"GGUF: {gguf_name} is quantized where a float is expected"
                    )
                narrow = quants.narrowed(_rows(converted, target.rows))
                weight, scales, biases = quants.mlx_repacked(narrow)
                base = target.name.removesuffix(".weight")
                weights[target.name], weights[f"{base}.scales"] = weight, scales
                if biases is not None:
                    weights[f"{base}.biases"] = biases
                layers[base] = {
                    "group_size": converted.group_size,
                    "bits": converted.bits,
                    "mode": converted.mode,
                }
                continue
            if target.minus_one:  # stored as 1 + w: w in float32, as the converter computed it
                values = quants.dequantize(file.raw(gguf_name), info.ggml_type, info.shape) - 1
            else:
                values = converted
            if target.rows is not None:
                values = values[target.rows]
            values = np.ascontiguousarray(values)
            weights[target.name] = (
                quants.mlx_plain(values, info.ggml_type)
                if plain
                else mx.array(values.astype(np.float32))
            )
    quantization: dict[str, Any] = {}
    if layers:
        first = next(iter(layers.values()))
        quantization = {**first, **layers}
    return weights, {**quantization, **blocks_of}, treated


def _whole_weights(parts: tuple[Any, ...], shape: tuple[int, ...]) -> bool:
    """Whether a tensor's targets are all matrices' weights as stored (not a norm's 1 + w):
    a matrix's, or stacked experts' [experts, rows, columns] taken whole."""
    if len(shape) == 3:
        return all(t.name.endswith(".weight") and t.rows is None and not t.minus_one for t in parts)
    return len(shape) == 2 and all(t.name.endswith(".weight") and not t.minus_one for t in parts)


def _raw_rows(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A block-quantized matrix's bytes as [rows, bytes a row] (blocks run along rows), or
    stacked experts' as [experts, rows, bytes a row]."""
    return np.asarray(raw).reshape(*shape[:-1], -1)


def _rows(repacked: quants.Repacked, rows: np.ndarray | None) -> quants.Repacked:
    """A repacked tensor with its rows in `rows`' order (blocks run along rows, so a row
    permutation of the weights is one of each packed array)."""
    if rows is None:
        return repacked
    return repacked._replace(
        weight=repacked.weight[rows],
        scales=repacked.scales[rows],
        biases=None if repacked.biases is None else repacked.biases[rows],
    )
