"""Resolve an Ollama model name in the local Ollama model store into a `ModelSource`.

Mirrors Ollama's `x/imagegen/manifest` and `x/mlxrunner/model` (docs/PROTOCOL.md §1.2):
names map to `manifests/<host>/<namespace>/<name>/<tag>`, configs are JSON layers found by
exact name, and tensor layers are safetensors blobs whose quantized linears are stored as
`<t>` (packed), `<t>.scale`, `<t>.bias`. Those are renamed to mlx-lm's `P.weight`,
`P.scales`, `P.biases`, and the quantization parameters become an mlx-lm quantization dict.

Invariant: nothing outside `$OLLAMA_MODELS` is ever read, whatever a name or a manifest says.
- A name becomes path components only after each part passed Ollama's rules (`parse_name`),
  which leave no room for `/`, `.`/`..`, empty parts or NUL bytes.
- A digest names a blob only if it is `sha256:` (or `sha256-`) and 64 hex digits, as in
  Ollama (`blob_path`).
- Every file is opened at its resolved path, and only once that path was checked to lie inside
  the resolved store (`inside_store`), so no symlink in the store leads elsewhere.
- A layer's `name` is only compared with fixed file names and shown in messages; it never
  becomes part of a path.
Every refusal is a `ModelLoadError`, printed as one `Error:` line at start-up.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from runner.sources.source import ModelLoadError, ModelSource, config_json, show

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
TENSOR_MEDIA_TYPE = "application/vnd.ollama.image.tensor"
JSON_MEDIA_TYPE = "application/vnd.ollama.image.json"
# What `ollama pull` stores: one GGUF file as the model layer, beside text layers.
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
TEXT_MEDIA_TYPES = {
    "application/vnd.ollama.image.template": "template",
    "application/vnd.ollama.image.system": "system",
    "application/vnd.ollama.image.license": "license",
}
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
# Larger text layers than this are not an Ollama model's template, system prompt or params.
MAX_TEXT_LAYER_BYTES = 16 << 20

# Ollama's name parts (types/model/name.go, `isValidPart`): the first byte a letter, digit or
# "_", then also "-", and by kind "." and ":"; a length limit per kind.
NAME_PARTS: dict[str, tuple[int, re.Pattern[str], str]] = {
    "host": (350, re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*"), "letters, digits, _ - . :"),
    "namespace": (80, re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*"), "letters, digits, _ -"),
    "model": (80, re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), "letters, digits, _ - ."),
    "tag": (80, re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), "letters, digits, _ - ."),
}
# The only digests Ollama turns into blob paths (manifest/paths.go, `BlobsPath`).
DIGEST = re.compile(r"sha256[:-][0-9a-fA-F]{64}")

# Canonical quant type -> (default group size, bits, MLX mode); aliases as in x/quant.
QUANT_TYPES: dict[str, tuple[int, int, str]] = {
    "INT4": (64, 4, "affine"),
    "INT8": (64, 8, "affine"),
    "MXFP4": (32, 4, "mxfp4"),
    "MXFP8": (32, 8, "mxfp8"),
    "NVFP4": (16, 4, "nvfp4"),
    "INT6": (64, 6, "affine"),  # newer Ollama importers also write these two
    "INT3": (64, 3, "affine"),
}
QUANT_ALIASES = {"FP4": "INT4", "Q4": "INT4", "FP8": "INT8", "Q8": "INT8"}
QUANT_ALIASES |= {"FP6": "INT6", "Q6": "INT6", "FP3": "INT3", "Q3": "INT3"}
COMMON_GROUP_SIZES = (16, 32, 64, 128)


def models_dir() -> Path:
    """`$OLLAMA_MODELS` (trimmed of whitespace and quotes, like Ollama's envconfig), else
    `~/.ollama/models`."""
    value = os.environ.get("OLLAMA_MODELS", "").strip().strip("\"'")
    return Path(value) if value else Path.home() / ".ollama" / "models"


@dataclass(frozen=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str

    def parts(self) -> tuple[str, str, str, str]:
        return self.host, self.namespace, self.model, self.tag

    def manifest_path(self, models: Path) -> Path:
        """Where Ollama writes this name's manifest: the parts as spelled."""
        return models.joinpath("manifests", *self.parts())


def valid_part(kind: str, part: str) -> bool:
    """Whether `part` is a valid `kind` part of an Ollama name (so also a plain file name)."""
    limit, pattern, _ = NAME_PARTS[kind]
    return len(part) <= limit and pattern.fullmatch(part) is not None


def parse_name(name: str) -> ModelName:
    """Ollama's `ParseName`: `[[scheme://]host/][namespace/]model[:tag]`, defaults filled in.

    The tag is what follows the last `:` if no `/` comes after it (so `host:port/ns/model` has
    none). A separator promises a part: `ns/` or `model:` with nothing there is invalid, not a
    default. Ollama accepts no `@digest` suffix (`@` is in no part's alphabet), nor does this.
    """
    rest, tag = name, DEFAULT_TAG
    if name.rfind(":") > name.rfind("/"):
        rest, _, tag = name.rpartition(":")
    *prefix, model = rest.split("/")
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if prefix:
        namespace = prefix.pop()
    if prefix:
        scheme, sep, host = "/".join(prefix).partition("://")  # the scheme is not part of paths
        host = host if sep else scheme
    parsed = ModelName(host, namespace, model, tag)
    for kind, part in zip(NAME_PARTS, parsed.parts(), strict=True):
        if not valid_part(kind, part):
            limit, _, alphabet = NAME_PARTS[kind]
            raise ModelLoadError(
                f"invalid model name {show(name)}: {kind} {show(part)} must be 1 to {limit} "
                f"of {alphabet}, starting with a letter, digit or _"
            )
    return parsed


def find_manifest(models: Path, name: ModelName) -> Path:
    """The path of `name`'s manifest as the store spells it.

    Ollama compares names ignoring case: before it reads a manifest, each part of the name
    takes the spelling of a stored name that equals it ignoring case (`getExistingName`). Here
    each directory level does the same: the part as spelled if it exists, else the first
    (sorted) valid entry equal to it ignoring case, else the part as spelled (then "not found").
    """
    path = models / "manifests"
    for kind, part in zip(NAME_PARTS, name.parts(), strict=True):
        path = path / _stored_spelling(path, kind, part)
    return path


def _stored_spelling(directory: Path, kind: str, part: str) -> str:
    """`part`, or the entry of `directory` that spells it in another case (see above)."""
    if os.path.lexists(directory / part):
        return part
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return part
    folded = part.lower()  # parts are ASCII, so this is Go's strings.EqualFold
    return next((e for e in entries if e.lower() == folded and valid_part(kind, e)), part)


def blob_path(models: Path, digest: Any, where: str = "") -> Path:
    """`sha256:<hex>` -> `<models>/blobs/sha256-<hex>`; any other digest is refused, as in
    Ollama's `BlobsPath`, so no digest can name a file outside `blobs/`."""
    if not isinstance(digest, str) or DIGEST.fullmatch(digest) is None:
        raise ModelLoadError(
            f"{where}invalid digest {show(digest)} (expected sha256: and 64 hex digits)"
        )
    return models / "blobs" / digest.replace(":", "-")


def inside_store(models: Path, path: Path) -> Path:
    """`path` with every symlink resolved, refused unless it lies inside `models` (resolved
    too): names and digests cannot leave the store, and neither may a link in it. Reading the
    resolved path means the file checked is the file read."""
    try:
        root, real = models.resolve(), path.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise ModelLoadError(f"cannot resolve {path}: {e}") from None
    if not real.is_relative_to(root):
        raise ModelLoadError(f"{path} leads outside the model store {root} (to {real})")
    return real


def load_safetensors(path: Path, what: str | None = None) -> tuple[dict[str, mx.array], dict]:
    """All arrays and the `__metadata__` of one safetensors file; mlx checks the header and
    the data offsets against the file size, so truncated files fail here, not later."""
    try:
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read {what or path}: {e}") from None
    assert isinstance(arrays, dict) and isinstance(metadata, dict)
    return arrays, metadata


def _layers(data: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The manifest's layers, refused unless each is an object whose `mediaType`, `digest`
    and `name` are strings, null or absent (Go decodes them into string fields)."""
    layers = data.get("layers")
    if layers is None:
        return []
    if not isinstance(layers, list):
        raise ModelLoadError(f"manifest {path}: layers is not a list")
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise ModelLoadError(f"manifest {path}: layer {i} is not a JSON object")
        for key in ("mediaType", "digest", "name"):
            if layer.get(key) is not None and not isinstance(layer[key], str):
                raise ModelLoadError(f"manifest {path}: layer {i} {key} is not a string")
    return layers


class Manifest:
    """A loaded manifest plus the helpers the runner needs (Go's `ModelManifest`)."""

    def __init__(self, models: Path, path: Path, data: dict[str, Any]):
        self.models, self.path, self.data = models, path, data
        self.layers = _layers(data, path)

    def layer_path(self, layer: dict[str, Any]) -> Path:
        """The blob a layer's digest names, symlinks resolved and checked to stay in the
        store."""
        where = f"manifest {self.path}, layer {show(layer.get('name', '?'))}: "
        return inside_store(self.models, blob_path(self.models, layer.get("digest"), where))

    def tensor_layers(self) -> list[dict[str, Any]]:
        return [layer for layer in self.layers if layer.get("mediaType") == TENSOR_MEDIA_TYPE]

    def config_layer(self, name: str) -> dict[str, Any] | None:
        for layer in self.layers:
            if layer.get("mediaType") == JSON_MEDIA_TYPE and layer.get("name") == name:
                return layer
        return None

    def read_config(self, name: str) -> bytes:
        layer = self.config_layer(name)
        if layer is None:
            raise ModelLoadError(f'config "{name}" not found in manifest')
        path = self.layer_path(layer)
        try:
            return path.read_bytes()
        except OSError as e:
            raise ModelLoadError(f"cannot read blob {path} ({name}): {e}") from None

    def read_config_json(self, name: str, *, optional: bool = False) -> Any:
        if optional and self.config_layer(name) is None:
            return None
        try:
            return config_json(self.read_config(name))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f'config "{name}" is not valid JSON: {e}') from None


def load_manifest(name: str, models: Path | None = None) -> Manifest:
    models = models if models is not None else models_dir()
    path = find_manifest(models, parse_name(name))
    try:
        data = json.loads(inside_store(models, path).read_bytes())
    except FileNotFoundError:
        raise ModelLoadError(f"model {name!r} not found (no manifest at {path})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read manifest {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"manifest {path} is not a JSON object")
    return Manifest(models, path, data)


# ---- quantization parameters (x/mlxrunner/model/quant.go, root.go) ----


@dataclass(frozen=True)
class QuantInfo:
    """What a blob or config says about one tensor; zeros mean "not stated"."""

    quant_type: str
    group_size: int = 0
    bits: int = 0
    mode: str = ""


def quant_params(quant_type: str) -> tuple[int, int, str]:
    """(default group size, bits, mode); unknown non-empty types fall back to 32/8/affine
    as Ollama does."""
    key = quant_type.upper()
    return QUANT_TYPES.get(QUANT_ALIASES.get(key, key), (32, 8, "affine"))


def infer_affine_from_shapes(
    packed_cols: int, scale_cols: int, hint: str = ""
) -> tuple[str, int] | None:
    """(quant type, group size) of an affine tensor from its packed and scale widths."""
    if packed_cols <= 0 or scale_cols <= 0:
        return None
    g4, g8 = packed_cols * 8 // scale_cols, packed_cols * 4 // scale_cols
    if g4 == 32:
        return "INT4", 32
    if g8 == 64:
        return "INT8", 64
    if g4 == 64 and g8 == 32:  # both plausible: the hint's digit decides
        if "8" in hint:
            return "INT8", 32
        if "4" in hint:
            return "INT4", 64
    if g4 in COMMON_GROUP_SIZES and g8 not in COMMON_GROUP_SIZES:
        return "INT4", g4
    if g8 in COMMON_GROUP_SIZES and g4 not in COMMON_GROUP_SIZES:
        return "INT8", g8
    return None


def _blob_quant_infos(arrays: dict[str, mx.array], meta: dict[str, str]) -> dict[str, QuantInfo]:
    """Per-tensor info for every `<t>` with a `<t>.scale` companion in one blob."""
    infos = {}
    for name, weight in arrays.items():
        scale = arrays.get(name + ".scale")
        if scale is None or name.endswith((".scale", ".bias", ".scales", ".biases")):
            continue
        if weight.ndim == 0 or scale.ndim == 0:  # refused by `_quantization`
            continue
        qtype = meta.get(name + ".quant_type") or meta.get("quant_type", "")
        group = _int(meta.get(name + ".group_size") or meta.get("group_size"))
        inferred = infer_affine_from_shapes(weight.shape[-1], scale.shape[-1], qtype.upper())
        if inferred:
            qtype, group = qtype or inferred[0], group or inferred[1]
        if qtype:
            infos[name] = QuantInfo(qtype.upper(), group or quant_params(qtype)[0])
    return infos


def _config_quant(config: dict[str, Any]) -> tuple[QuantInfo | None, dict[str, QuantInfo]]:
    """config.json's mlx-lm style `quantization` block: defaults, and per-path overrides
    keyed by `<path>.weight`. Ollama treats the overrides as authoritative."""
    block = config.get("quantization") or config.get("quantization_config")
    if not isinstance(block, dict):
        return None, {}
    defaults = None
    if block.get("mode") or block.get("bits"):
        mode = _mode(block.get("mode"), "quantization.mode")
        qtype = mode.upper() if mode != "affine" else f"INT{block.get('bits', 4)}"
        defaults = QuantInfo(qtype, _int(block.get("group_size")), _int(block.get("bits")), mode)
    overrides = {}
    for key, value in block.items():
        if isinstance(value, dict):
            mode = _mode(value.get("mode"), f"quantization.{key}.mode")
            overrides[key + ".weight"] = QuantInfo(
                mode.upper(), _int(value.get("group_size")), _int(value.get("bits")), mode
            )
    return defaults, overrides


def _mode(value: Any, key: str) -> str:
    """A quantization mode named in config.json; absent means affine."""
    if not value:
        return "affine"
    if not isinstance(value, str):
        raise ModelLoadError(f"config.json: {key} {show(value)} is not a string")
    return value


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _resolve(
    info: QuantInfo | None, default: QuantInfo | None, weight: mx.array, scales: mx.array
) -> dict[str, Any]:
    """Per-tensor info wins over the model default; affine tensors without per-tensor info
    take group/bits from their shapes (Go's `ResolveLinearQuantParams`)."""
    chosen = info or default or QuantInfo("")
    group, bits, mode = quant_params(chosen.quant_type) if chosen.quant_type else (0, 0, "affine")
    group, bits, mode = chosen.group_size or group, chosen.bits or bits, chosen.mode or mode
    if mode == "affine" and (info is None or not group or not bits):
        inferred = infer_affine_from_shapes(weight.shape[-1], scales.shape[-1], f"{bits}")
        if inferred:
            group, bits = inferred[1], quant_params(inferred[0])[1]
    if not group or not bits:
        return {}
    # Every mode packs `bits`-bit values into uint32 and has one scale per group, so the
    # widths must agree; this catches a wrong type (e.g. an unknown one defaulting to 8 bits).
    if weight.shape[-1] * 32 != scales.shape[-1] * group * bits:
        return {}
    return {"group_size": group, "bits": bits, "mode": mode}


def _mlx_names(raw: dict[str, mx.array]) -> dict[str, mx.array]:
    """Rename blob tensors to mlx-lm's spelling.

    `<t>.scale` -> `<P>.scales`, and `<t>.bias` -> `<P>.biases` only when `<t>.scale`
    exists (otherwise it is a true layer bias); `<t>` is `<P>.weight`. A `.scale` without a
    tensor `<t>` is a parameter of its own (Gemma 4's `router.scale`) and keeps its name,
    as only tensors with a `<t>.scale` companion count as quantized. mlx-lm's own
    `<P>.scales`/`<P>.biases`, which some imports keep, pass through, but the Ollama
    spelling wins a clash (as in Go's `normaliseAuxNames`). An nvfp4 global scale,
    `<P>.weight.global_scale` (else `<P>.weight_scale_2`), becomes `<P>.global_scale`
    (runner/models/quantized.py).
    """
    out: dict[str, mx.array] = {}
    for name, arr in raw.items():
        layer = _global_scale_layer(name)
        if layer is not None:
            if layer + ".global_scale" not in out or name.endswith(".global_scale"):
                out[layer + ".global_scale"] = arr  # Go: `.global_scale`, else `_scale_2`
            continue
        stem = name[: -len(".scale")] if name.endswith(".scale") else None
        if stem is not None and stem not in raw:  # no tensor <t>: a parameter named scale
            stem = None
        if stem is None and name.endswith(".bias") and name[: -len(".bias")] + ".scale" in raw:
            stem = name[: -len(".bias")]
        if stem is None:
            out.setdefault(name, arr)
            continue
        base = stem[: -len(".weight")] if stem.endswith(".weight") else stem
        out[base + (".scales" if name.endswith(".scale") else ".biases")] = arr
    return out


def _global_scale_layer(name: str) -> str | None:
    """The layer path `P` of nvfp4's global scale `P.weight.global_scale` or its fallback
    name `P.weight_scale_2`; None for any other tensor."""
    for suffix in (".weight.global_scale", ".weight_scale_2"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _quantization(
    weights: dict[str, mx.array],
    infos: dict[str, QuantInfo],
    default: QuantInfo | None,
) -> dict[str, Any] | None:
    """The mlx-lm quantization dict for every module that has `<P>.scales`."""
    per_layer: dict[str, Any] = {}
    for name in sorted(weights):
        if not name.endswith(".scales"):
            continue
        base = name[: -len(".scales")]
        weight_name = base + ".weight" if base + ".weight" in weights else base
        weight = weights.get(weight_name)
        if weight is None:
            raise ModelLoadError(f"quantization scales {name} have no weight tensor")
        if weight.ndim == 0 or weights[name].ndim == 0:
            raise ModelLoadError(f"quantized tensor {weight_name} or its scales is a scalar")
        params = _resolve(infos.get(weight_name), default, weight, weights[name])
        if not params:
            raise ModelLoadError(
                f"cannot determine the quantization of {weight_name} "
                f"(packed width {weight.shape[-1]}, {weights[name].shape[-1]} scales a row)"
            )
        per_layer[base] = params
    if not per_layer:
        return None
    if default is not None and default.quant_type:
        group, bits, mode = quant_params(default.quant_type)
        model_default = {
            "group_size": default.group_size or group,
            "bits": default.bits or bits,
            "mode": default.mode or mode,
        }
    else:
        model_default = dict(next(iter(per_layer.values())))
    # Dense matrices are marked False so a builder never quantizes them by the defaults.
    for name, arr in weights.items():
        base = name[: -len(".weight")]
        if name.endswith(".weight") and arr.ndim >= 2 and base not in per_layer:
            per_layer[base] = False
    return {**model_default, **per_layer}


def load_store_model(name: str, models: Path | None = None) -> ModelSource:
    """Read the manifest, configs and tensor blobs of an Ollama model; or, for a model
    `ollama pull` stored, its GGUF model layer (runner/sources/gguf/model.py) and the text
    layers beside it (template, system, license, params)."""
    manifest = load_manifest(name, models)
    ggufs = [layer for layer in manifest.layers if layer.get("mediaType") == MODEL_MEDIA_TYPE]
    if ggufs:
        return _load_gguf_model(name, manifest, ggufs)
    config = manifest.read_config_json("config.json")
    if not isinstance(config, dict):
        raise ModelLoadError('config "config.json" is not a JSON object')
    try:
        tokenizer_json = manifest.read_config("tokenizer.json").decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f'config "tokenizer.json" is not UTF-8: {e}') from None

    raw: dict[str, mx.array] = {}
    infos: dict[str, QuantInfo] = {}
    default: QuantInfo | None = None
    seen: set[str] = set()
    for layer in manifest.tensor_layers():
        digest = layer.get("digest", "")
        if digest in seen:
            continue
        seen.add(digest)
        path = manifest.layer_path(layer)
        arrays, meta = load_safetensors(path, f"blob {path} ({layer.get('name', '?')})")
        raw.update(arrays)
        infos.update(_blob_quant_infos(arrays, meta))
        if default is None and meta.get("quant_type"):
            qtype = meta["quant_type"].upper()
            default = QuantInfo(qtype, _int(meta.get("group_size")) or quant_params(qtype)[0])

    config_default, overrides = _config_quant(config)
    default = config_default or default
    infos.update(overrides)
    weights = _mlx_names(raw)
    return ModelSource(
        name=name,
        config=config,
        tokenizer_json=tokenizer_json,
        tokenizer_config=manifest.read_config_json("tokenizer_config.json", optional=True),
        generation_config=manifest.read_config_json("generation_config.json", optional=True),
        preprocessor_config=manifest.read_config_json("preprocessor_config.json", optional=True),
        chat_template=(
            manifest.read_config("chat_template.jinja").decode("utf-8", "replace")
            if manifest.config_layer("chat_template.jinja") is not None
            else None
        ),
        weights=weights,
        quantization=_quantization(weights, infos, default),
    )


def _load_gguf_model(name: str, manifest: Manifest, ggufs: list[dict[str, Any]]) -> ModelSource:
    from runner.sources.gguf.model import load_gguf

    if len(ggufs) > 1:
        raise ModelLoadError(f"manifest {manifest.path}: {len(ggufs)} model layers (one expected)")
    if manifest.tensor_layers():
        raise ModelLoadError(f"manifest {manifest.path}: both a GGUF model layer and tensor layers")
    source = load_gguf(manifest.layer_path(ggufs[0]), name)
    for layer in manifest.layers:
        kind = TEXT_MEDIA_TYPES.get(layer.get("mediaType", ""))
        if kind is None and layer.get("mediaType") != PARAMS_MEDIA_TYPE:
            continue
        data = _text_layer(manifest, layer)
        if kind is not None:
            source.ollama[kind] = data
            continue
        try:
            params = json.loads(data)
        except json.JSONDecodeError as e:
            raise ModelLoadError(
                f"manifest {manifest.path}: params layer is not JSON: {e}"
            ) from None
        if not isinstance(params, dict):
            raise ModelLoadError(f"manifest {manifest.path}: params layer is not a JSON object")
        source.ollama["params"] = params
    return source


def _text_layer(manifest: Manifest, layer: dict[str, Any]) -> str:
    path = manifest.layer_path(layer)
    try:
        if path.stat().st_size > MAX_TEXT_LAYER_BYTES:
            raise ModelLoadError(f"blob {path} ({layer.get('mediaType')}) is too large")
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ModelLoadError(f"cannot read blob {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"blob {path} ({layer.get('mediaType')}) is not UTF-8: {e}") from None
