"""Ollama store resolution (runner/sources/ollama_store.py) and local-directory loading
(runner/sources/loader.py)."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tokenizer_models

from runner.sources import loader
from runner.sources.loader import load_local_dir, load_model_source
from runner.sources.ollama_store import (
    blob_path,
    infer_affine_from_shapes,
    load_manifest,
    load_store_model,
    models_dir,
    parse_name,
)
from runner.sources.source import ModelLoadError
from tests.ollama_store import add_tensor_layer, quantized_blob_arrays, write_ollama_model
from tools.spawned import SpawnedRunner

Q_PROJ = "model.layers.0.self_attn.q_proj"
DOWN_PROJ = "model.layers.0.mlp.down_proj"
EMBED = "model.embed_tokens"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 32,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def fake_weights() -> dict[str, mx.array]:
    """A few arrays shaped like one tiny decoder layer, including a true layer bias."""
    key = mx.random.key(0)
    shapes = {
        f"{EMBED}.weight": (32, 64),
        f"{Q_PROJ}.weight": (64, 64),
        f"{Q_PROJ}.bias": (64,),
        f"{DOWN_PROJ}.weight": (64, 128),
        "model.layers.0.input_layernorm.weight": (64,),
    }
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        out[name] = mx.random.normal(shape, key=mx.random.split(key, len(shapes))[i])
    return out


def write_hf_dir(path: Path, weights: dict[str, mx.array] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    vocab = {f"t{i}": i for i in range(30)} | {"[UNK]": 30, "hello": 31}
    tok = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    mx.save_safetensors(str(path / "model.safetensors"), weights or fake_weights())
    return path


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    return write_hf_dir(tmp_path / "hf")


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ollama-models"
    monkeypatch.setenv("OLLAMA_MODELS", str(path))
    return path


# ---- names, models dir, manifests and blobs ----


HEX = "0123456789abcdef" * 4  # 64 hex digits


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("smollm2", ("registry.ollama.ai", "library", "smollm2", "latest")),
        ("smollm2:135m", ("registry.ollama.ai", "library", "smollm2", "135m")),
        ("me/mine", ("registry.ollama.ai", "me", "mine", "latest")),
        ("me/mine:q4", ("registry.ollama.ai", "me", "mine", "q4")),
        ("example.com/me/mine:v1.2", ("example.com", "me", "mine", "v1.2")),
        ("localhost:5000/me/mine:v1", ("localhost:5000", "me", "mine", "v1")),
        # a ":" before the last "/" belongs to the host: no tag, so "latest"
        ("h:5000/a/b", ("h:5000", "a", "b", "latest")),
        # Ollama drops a "scheme://" in front of the host
        ("https://example.com/me/mine:v1", ("example.com", "me", "mine", "v1")),
        ("_why/_the/_lucky:_stiff", ("_why", "_the", "_lucky", "_stiff")),
        ("Qwen3:0.6B-Q4_K_M", ("registry.ollama.ai", "library", "Qwen3", "0.6B-Q4_K_M")),
        ("h/n/" + "m" * 80 + ":" + "t" * 80, ("h", "n", "m" * 80, "t" * 80)),
        ("h" * 350 + "/" + "n" * 80 + "/m", ("h" * 350, "n" * 80, "m", "latest")),
    ],
)
def test_parse_name(name: str, parts: tuple[str, str, str, str]) -> None:
    parsed = parse_name(name)
    assert (parsed.host, parsed.namespace, parsed.model, parsed.tag) == parts
    host, ns, model, tag = parts
    assert parsed.manifest_path(Path("/m")) == Path("/m/manifests", host, ns, model, tag)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "mine:",  # a separator promises a part
        ":latest",
        "me/",
        "/mine",
        "me//mine",
        "//mine",
        "a/b/c/d",  # the host would be "a/b"
        "../mine",
        "a/../../b",
        "..",
        ".hidden",
        "me/..:x",
        "mine:..",
        "/etc/passwd",
        "/abs/ns/model",
        "mi\0ne",
        "mine\n",
        "mine ",
        "modèle",
        "-mine",
        "me/-mine",
        "mine:-tag",
        "ns.with.dot/mine",  # dots are not allowed in a namespace
        "me/mi:ne/x",  # ":" only in a host
        f"mine@sha256:{HEX}",  # Ollama accepts no digest suffix
        f"mine:v1@sha256-{HEX}",
        "m" * 81,
        "mine:" + "t" * 81,
        "n" * 81 + "/mine",
        "h" * 351 + "/n/mine",
    ],
)
def test_parse_name_rejects(name: str) -> None:
    with pytest.raises(ModelLoadError, match=r"^invalid model name .* must be 1 to "):
        parse_name(name)


@pytest.mark.parametrize(
    "value", ["/srv/models", "  /srv/models\n", '"/srv/models"', "'/srv/models' "]
)
def test_models_dir_from_env(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_MODELS", value)
    assert models_dir() == Path("/srv/models")


@pytest.mark.parametrize("value", [None, "", "  ", '""'])
def test_models_dir_default(value, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    else:
        monkeypatch.setenv("OLLAMA_MODELS", value)
    assert models_dir() == tmp_path / ".ollama" / "models"


def test_blob_path() -> None:
    assert blob_path(Path("/m"), f"sha256:{HEX}") == Path(f"/m/blobs/sha256-{HEX}")
    # Ollama's BlobsPath also takes its own file spelling and upper-case hex
    assert blob_path(Path("/m"), f"sha256-{HEX}") == Path(f"/m/blobs/sha256-{HEX}")
    upper = HEX.upper()
    assert blob_path(Path("/m"), f"sha256:{upper}") == Path(f"/m/blobs/sha256-{upper}")


def test_manifest_layers_and_configs(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "me/tiny:v1", hf_dir)
    manifest = load_manifest("me/tiny:v1")
    assert manifest.path == models / "manifests/registry.ollama.ai/me/tiny/v1"
    assert {layer["name"] for layer in manifest.tensor_layers()} == set(fake_weights())
    for layer in manifest.layers:
        blob = manifest.layer_path(layer)
        assert (
            blob.name == layer["digest"].replace(":", "-") and blob.stat().st_size == layer["size"]
        )
    assert json.loads(manifest.read_config("config.json")) == CONFIG
    config_blob = manifest.layer_path(manifest.data["config"])
    assert json.loads(config_blob.read_text())["model_format"] == "safetensors"


def test_missing_model_names_the_manifest(models: Path) -> None:
    want = models / "manifests/registry.ollama.ai/library/absent/latest"
    with pytest.raises(ModelLoadError, match="not found") as err:
        load_model_source("absent")
    assert str(want) in str(err.value) and "\n" not in str(err.value)


def test_missing_config_layer(models: Path, hf_dir: Path) -> None:
    (hf_dir / "config.json").unlink()
    write_ollama_model(models, "tiny", hf_dir)
    with pytest.raises(ModelLoadError, match=r'^config "config\.json" not found in manifest$'):
        load_store_model("tiny")


def test_optional_configs_may_be_absent(models: Path, hf_dir: Path) -> None:
    (hf_dir / "generation_config.json").unlink()
    (hf_dir / "tokenizer_config.json").unlink()
    write_ollama_model(models, "tiny", hf_dir)
    source = load_store_model("tiny")
    assert source.generation_config is None and source.tokenizer_config is None


@pytest.mark.parametrize("damage", ["delete", "truncate", "garbage"])
def test_unreadable_blob(models: Path, hf_dir: Path, damage: str) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    manifest = load_manifest("tiny")
    layer = next(x for x in manifest.tensor_layers() if x["name"] == f"{Q_PROJ}.weight")
    blob = manifest.layer_path(layer)
    if damage == "delete":
        blob.unlink()
    elif damage == "truncate":
        blob.write_bytes(blob.read_bytes()[:-64])
    else:
        blob.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=f"cannot read blob .*{Q_PROJ}.weight"):
        load_store_model("tiny")


# ---- bare names resolve as in Ollama (with a store written by tests/ollama_store.py) ----


@pytest.mark.parametrize(
    ("written", "asked"),
    [
        ("registry.ollama.ai/library/tiny:latest", "tiny"),
        ("tiny", "registry.ollama.ai/library/tiny:latest"),
        ("registry.ollama.ai/me/tiny:latest", "me/tiny"),
        ("tiny:v2", "library/tiny:v2"),
        ("example.com/me/tiny:v1", "example.com/me/tiny:v1"),
        ("example.com/me/tiny:v1", "https://example.com/me/tiny:v1"),
        ("localhost:5000/me/tiny:latest", "localhost:5000/me/tiny"),
        # Ollama compares names ignoring case; the store's spelling is the one read
        ("Me/Tiny:V1", "me/tiny:v1"),
        ("me/tiny:v1", "ME/TINY:V1"),
        ("tiny", "Registry.Ollama.AI/Library/TINY:Latest"),
    ],
)
def test_names_resolve_as_in_ollama(models: Path, hf_dir: Path, written: str, asked: str):
    write_ollama_model(models, written, hf_dir)
    manifest = load_manifest(asked)
    assert manifest.path == parse_name(written).manifest_path(models)
    assert load_model_source(asked).config == CONFIG


def test_the_exact_spelling_wins(models: Path, hf_dir: Path, tmp_path: Path) -> None:
    """With two spellings stored (possible on a case-sensitive file system only), the name as
    given picks its own; Ollama would take whichever its map iteration meets last."""
    write_ollama_model(models, "Tiny", hf_dir)
    if (models / "manifests/registry.ollama.ai/library/tiny").exists():
        pytest.skip("case-insensitive file system")
    other = write_hf_dir(tmp_path / "other")
    (other / "config.json").write_text(json.dumps(CONFIG | {"vocab_size": 33}))
    write_ollama_model(models, "tiny", other)
    assert load_store_model("tiny").config["vocab_size"] == 33
    assert load_store_model("Tiny").config["vocab_size"] == 32
    assert load_store_model("TINY").config["vocab_size"] == 32  # "Tiny" sorts first


def test_other_tags_and_namespaces_do_not_match(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "me/tiny:v1", hf_dir)
    for other in ("me/tiny", "tiny:v1", "you/tiny:v1", "me/tinier:v1", "other.host/me/tiny:v1"):
        with pytest.raises(ModelLoadError, match="not found"):
            load_manifest(other)


# ---- hostile stores: nothing outside $OLLAMA_MODELS is read (runner/sources/ollama_store.py) ----


def edit_manifest(models: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = parse_name(name).manifest_path(models)
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def set_layer(models: Path, model: str, layer_name: str, /, **fields: Any) -> None:
    """Overwrite fields of the layer called `layer_name` in `model`'s manifest."""

    def edit(manifest: dict[str, Any]) -> None:
        layer = next(x for x in manifest["layers"] if x.get("name") == layer_name)
        layer.update(fields)

    edit_manifest(models, model, edit)


@pytest.fixture
def outside(tmp_path: Path, hf_dir: Path) -> Path:
    """Files beside the store that a hostile manifest points at. They are valid (a config and
    the whole model's weights), so a load that read them would succeed."""
    path = tmp_path / "outside"
    path.mkdir()
    shutil.copy(hf_dir / "config.json", path / "config.json")
    shutil.copy(hf_dir / "model.safetensors", path / "weights.safetensors")
    return path


def hostile_digests(outside: Path, file: str) -> list[Any]:
    return [
        str(outside / file),  # an absolute path: `blobs / "/x"` is "/x"
        f"sha256:../../../outside/{file}",  # through blobs/sha256-.. (made to exist below)
        f"sha256:{HEX}/../../../outside/{file}",
        f"sha512:{HEX}{HEX}",
        f"md5:{HEX[:32]}",
        f"sha256:{HEX[:-1]}",
        f"sha256:{HEX}0",
        f"sha256:{HEX}\n",
        f" sha256:{HEX}",
        "sha256:" + "g" * 64,
        f"sha256::{HEX}",
        "",
        None,  # Go decodes null as absent
    ]


@pytest.mark.parametrize("index", range(13))
@pytest.mark.parametrize("layer", ["config.json", f"{Q_PROJ}.weight"])
def test_hostile_digests_are_refused(
    models: Path, hf_dir: Path, outside: Path, layer: str, index: int
) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    (models / "blobs" / "sha256-..").mkdir()  # so that a traversal would resolve
    file = "config.json" if layer == "config.json" else "weights.safetensors"
    digest = hostile_digests(outside, file)[index]
    set_layer(models, "tiny", layer, digest=digest)
    manifest = parse_name("tiny").manifest_path(models)
    want = f"^manifest {re.escape(str(manifest))}, layer '{re.escape(layer)}': invalid digest "
    with pytest.raises(ModelLoadError, match=want) as err:
        load_model_source("tiny")
    assert "\n" not in str(err.value)


def test_a_missing_digest_is_refused(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    edit_manifest(models, "tiny", lambda m: m["layers"][0].pop("digest"))
    with pytest.raises(ModelLoadError, match="invalid digest None"):
        load_store_model("tiny")


def test_ollamas_other_digest_spellings_load(models: Path, hf_dir: Path) -> None:
    """`sha256-<hex>` is accepted by Ollama's BlobsPath too; it names the same blob."""
    write_ollama_model(models, "tiny", hf_dir)

    def respell(manifest: dict[str, Any]) -> None:
        for layer in manifest["layers"]:
            layer["digest"] = layer["digest"].replace(":", "-")

    edit_manifest(models, "tiny", respell)
    assert set(load_store_model("tiny").weights) == set(fake_weights())


def move_out(path: Path, outside: Path) -> Path:
    """Move `path` to `outside` and leave a symlink to it in its place."""
    target = outside / (path.name + ".moved")
    shutil.move(path, target)
    path.symlink_to(target)
    return target


@pytest.mark.parametrize("what", ["config blob", "tensor blob", "manifest", "manifests dir"])
def test_symlinks_out_of_the_store_are_refused(
    models: Path, hf_dir: Path, outside: Path, what: str
) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    manifest = load_manifest("tiny")
    if what == "config blob":
        link = manifest.layer_path(manifest.config_layer("config.json") or {})
    elif what == "tensor blob":
        link = manifest.layer_path(next(iter(manifest.tensor_layers())))
    elif what == "manifest":
        link = manifest.path
    else:
        link = models / "manifests"
    move_out(link, outside)
    with pytest.raises(ModelLoadError, match=r"leads outside the model store .*outside"):
        load_model_source("tiny")


def test_symlinks_within_the_store_are_followed(models: Path, hf_dir: Path, tmp_path: Path) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    manifest = load_manifest("tiny")
    (models / "elsewhere").mkdir()
    for layer in manifest.layers:  # every blob a link to a file elsewhere in the store
        move_out(manifest.layer_path(layer), models / "elsewhere")
    link = tmp_path / "link-to-store"  # and $OLLAMA_MODELS itself a link
    link.symlink_to(models)
    assert set(load_store_model("tiny", link).weights) == set(fake_weights())


def test_a_symlink_loop_is_refused(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    manifest = load_manifest("tiny")
    blob = manifest.layer_path(manifest.config_layer("config.json") or {})
    blob.unlink()
    blob.symlink_to(blob.name)
    with pytest.raises(ModelLoadError, match=re.escape(blob.name)):
        load_store_model("tiny")


@pytest.mark.parametrize(
    "name", ["../tiny", "a/../../tiny", "/no/such/tiny", "tiny/../../../x", "ti\0ny", "tiny\0"]
)
def test_names_that_would_escape_never_reach_the_disk(
    models: Path, hf_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    opened: list[str] = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: opened.append(str(p)) or real_read(p))
    with pytest.raises(ModelLoadError):
        load_model_source(name)
    assert opened == []


@pytest.mark.parametrize(
    "layer_name", ["../config.json", "/config.json", "x/config.json", "./config.json", None]
)
def test_layer_names_are_never_paths(models: Path, hf_dir: Path, layer_name: Any) -> None:
    """A config is the JSON layer named exactly so; other names are not resolved as paths."""
    write_ollama_model(models, "tiny", hf_dir)
    set_layer(models, "tiny", "config.json", name=layer_name)
    with pytest.raises(ModelLoadError, match=r'^config "config\.json" not found in manifest$'):
        load_store_model("tiny")


@pytest.mark.parametrize(
    ("layers", "problem"),
    [
        ({}, "layers is not a list"),
        ("x", "layers is not a list"),
        ([1], "layer 0 is not a JSON object"),
        ([None], "layer 0 is not a JSON object"),
        ([{"mediaType": 1}], "layer 0 mediaType is not a string"),
        ([{"digest": {"a": 1}}], "layer 0 digest is not a string"),
        ([{"digest": 64}], "layer 0 digest is not a string"),
        ([{"name": ["config.json"]}], "layer 0 name is not a string"),
    ],
)
def test_malformed_manifests_are_refused(
    models: Path, hf_dir: Path, layers: Any, problem: str
) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    edit_manifest(models, "tiny", lambda m: m.update(layers=layers))
    with pytest.raises(ModelLoadError, match=f"^manifest .*: {problem}$"):
        load_store_model("tiny")


@pytest.mark.slow
def test_a_hostile_manifest_is_one_error_line(models: Path, hf_dir: Path, outside: Path):
    write_ollama_model(models, "tiny", hf_dir)
    set_layer(models, "tiny", "config.json", digest=str(outside / "config.json"))
    with SpawnedRunner("--model", "tiny", env={"OLLAMA_MODELS": str(models)}) as process:
        assert process.wait(timeout=120) == 1
        output = process.output()
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "invalid digest" in errors[0], output


# ---- round trips HF dir -> Ollama store -> ModelSource ----


def test_dense_round_trip(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "tiny:dense", hf_dir)
    source = load_model_source("tiny:dense")
    want = fake_weights()
    assert source.name == "tiny:dense"
    assert set(source.weights) == set(want)
    for name, arr in want.items():
        assert mx.array_equal(source.weights[name], arr), name
    assert source.config == CONFIG
    assert source.tokenizer_json == (hf_dir / "tokenizer.json").read_text()
    assert source.tokenizer_config == {"add_bos_token": False}
    assert source.generation_config == {"eos_token_id": 2}
    assert source.quantization is None


def check_quantized(source, name: str, original: mx.array, group: int, bits: int) -> None:
    """`name` is stored as mlx-lm weight/scales/biases that dequantize exactly like mx.quantize."""
    packed, scales, biases = mx.quantize(original, group, bits)
    assert source.weights[f"{name}.weight"].dtype == mx.uint32
    for suffix, arr in [("weight", packed), ("scales", scales), ("biases", biases)]:
        assert mx.array_equal(source.weights[f"{name}.{suffix}"], arr), suffix
    got = mx.dequantize(
        source.weights[f"{name}.weight"],
        source.weights[f"{name}.scales"],
        source.weights[f"{name}.biases"],
        group_size=group,
        bits=bits,
    )
    assert mx.array_equal(got, mx.dequantize(packed, scales, biases, group, bits))
    assert mx.allclose(got, original, atol=2 * mx.max(scales).item())
    assert source.quantization[name] == {"group_size": group, "bits": bits, "mode": "affine"}


@pytest.mark.parametrize(
    ("quant_type", "group", "bits"), [("int4", 64, 4), ("INT8", 64, 8), ("q4", 32, 4)]
)
def test_quantized_round_trip(models: Path, hf_dir: Path, quant_type: str, group: int, bits: int):
    write_ollama_model(models, "tiny:q", hf_dir, quantize={"type": quant_type, "group_size": group})
    source = load_store_model("tiny:q")
    want = fake_weights()
    for name in (Q_PROJ, DOWN_PROJ):
        check_quantized(source, name, want[f"{name}.weight"], group, bits)
    assert source.quantization["group_size"] == group and source.quantization["bits"] == bits
    assert source.quantization["mode"] == "affine"
    # The q_proj layer bias has no `.scale` companion: it stays a true bias.
    assert mx.array_equal(source.weights[f"{Q_PROJ}.bias"], want[f"{Q_PROJ}.bias"])
    # Embeddings and norms stay dense, and a builder is told so.
    assert mx.array_equal(source.weights[f"{EMBED}.weight"], want[f"{EMBED}.weight"])
    assert source.quantization[EMBED] is False
    assert not any(k.endswith((".scale", ".bias.bias", "_scale")) for k in source.weights)


@pytest.mark.parametrize(
    ("quant_type", "group", "bits"), [("int4", 32, 4), ("int8", 64, 8), ("int8", 128, 8)]
)
def test_metadata_free_blobs_use_shape_inference(
    models: Path, hf_dir: Path, quant_type: str, group: int, bits: int
) -> None:
    quantize = {"type": quant_type, "group_size": group, "metadata": "none"}
    write_ollama_model(models, "tiny", hf_dir, quantize=quantize)
    source = load_store_model("tiny")
    want = fake_weights()
    check_quantized(source, DOWN_PROJ, want[f"{DOWN_PROJ}.weight"], group, bits)
    if group <= 64:  # q_proj is only 64 wide
        check_quantized(source, Q_PROJ, want[f"{Q_PROJ}.weight"], group, bits)


def test_ambiguous_shapes_without_any_hint_fail(models: Path, hf_dir: Path) -> None:
    # int4/64 and int8/32 have the same packed and scale widths.
    write_ollama_model(models, "tiny", hf_dir, quantize={"type": "int4", "metadata": "none"})
    with pytest.raises(ModelLoadError, match=f"cannot determine the quantization of {DOWN_PROJ}"):
        load_store_model("tiny")


def test_quant_type_that_contradicts_the_shapes_fails(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "tiny", hf_dir, quantize={"type": "int4", "group_size": 32})
    name = f"{Q_PROJ}.weight"
    arrays = quantized_blob_arrays(name, fake_weights()[name], "int4", 32)
    # A later blob restates q_proj as int8/32, which its int4 widths cannot be.
    add_tensor_layer(models, "tiny", name, arrays, {"quant_type": "int8", "group_size": "32"})
    with pytest.raises(ModelLoadError, match=f"cannot determine the quantization of {name}"):
        load_store_model("tiny")


def test_config_quantization_resolves_ambiguity(models: Path, tmp_path: Path) -> None:
    hf = write_hf_dir(tmp_path / "hfq")
    config = CONFIG | {"quantization": {"group_size": 64, "bits": 4, "mode": "affine"}}
    (hf / "config.json").write_text(json.dumps(config))
    write_ollama_model(models, "tiny", hf, quantize={"type": "int4", "metadata": "none"})
    source = load_store_model("tiny")
    check_quantized(source, Q_PROJ, fake_weights()[f"{Q_PROJ}.weight"], 64, 4)


def test_mixed_per_tensor_metadata(models: Path, hf_dir: Path) -> None:
    quantize = {"type": "int4", "metadata": "tensor", "types": {f"{DOWN_PROJ}.weight": "int8"}}
    write_ollama_model(models, "tiny", hf_dir, quantize=quantize)
    source = load_store_model("tiny")
    want = fake_weights()
    check_quantized(source, Q_PROJ, want[f"{Q_PROJ}.weight"], 64, 4)
    check_quantized(source, DOWN_PROJ, want[f"{DOWN_PROJ}.weight"], 64, 8)


@pytest.mark.parametrize(
    ("quant_type", "group", "bits", "mode"),
    [("mxfp4", 32, 4, "mxfp4"), ("MXFP8", 32, 8, "mxfp8"), ("nvfp4", 16, 4, "nvfp4")],
)
def test_microscaled_formats_map_to_mlx_modes(
    models: Path, hf_dir: Path, quant_type: str, group: int, bits: int, mode: str
) -> None:
    write_ollama_model(models, "tiny", hf_dir, quantize={"type": quant_type})
    source = load_store_model("tiny")
    original = fake_weights()[f"{Q_PROJ}.weight"]
    packed, scales = mx.quantize(original, group, bits, mode=mode)
    assert mx.array_equal(source.weights[f"{Q_PROJ}.weight"], packed)
    assert mx.array_equal(source.weights[f"{Q_PROJ}.scales"], scales)
    assert f"{Q_PROJ}.biases" not in source.weights
    assert source.quantization[Q_PROJ] == {"group_size": group, "bits": bits, "mode": mode}
    assert source.quantization["mode"] == mode


@pytest.mark.parametrize(
    "arrays",
    [
        {"a.weight": mx.array(1.0), "a.weight.scale": mx.array(1.0)},
        {"a.weight": mx.zeros((4, 8), dtype=mx.uint32), "a.weight.scale": mx.array(1.0)},
        {"a.weight": mx.array(1, dtype=mx.uint32), "a.scales": mx.ones((1,))},
    ],
)
def test_scalar_quantized_tensors_are_refused(models: Path, hf_dir: Path, arrays) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    add_tensor_layer(models, "tiny", "a.weight", arrays)
    with pytest.raises(ModelLoadError, match=r"^quantized tensor a\.weight or its scales is a"):
        load_store_model("tiny")


@pytest.mark.parametrize(
    ("block", "key"),
    [
        ({"mode": 5, "bits": 4}, "quantization.mode"),
        ({"x": {"mode": ["a"]}}, "quantization.x.mode"),
    ],
)
def test_config_quantization_modes_must_be_names(models: Path, tmp_path: Path, block, key: str):
    hf = write_hf_dir(tmp_path / "hfq")
    (hf / "config.json").write_text(json.dumps(CONFIG | {"quantization": block}))
    write_ollama_model(models, "tiny", hf)
    with pytest.raises(ModelLoadError, match=f"^config.json: {re.escape(key)} .* is not a string$"):
        load_store_model("tiny")


@pytest.mark.parametrize(
    "spellings", [(".global_scale",), ("_scale_2",), ("_scale_2", ".global_scale")]
)
def test_global_scale_is_the_layers(models: Path, hf_dir: Path, spellings) -> None:
    """nvfp4's global scale, under Go's name or its fallback (the first wins when both are
    there), becomes `<P>.global_scale` (tests/test_quantized_formats.py runs it)."""
    write_ollama_model(models, "tiny", hf_dir)
    name = "model.layers.0.mlp.up_proj.weight"
    arrays = quantized_blob_arrays(name, mx.ones((64, 64)), "nvfp4")
    for i, spelling in enumerate(spellings):
        arrays[name + spelling] = mx.array([0.5 + i])
    add_tensor_layer(models, "tiny", name, arrays, {"quant_type": "nvfp4", "group_size": "16"})
    source = load_store_model("tiny")
    scale = source.weights["model.layers.0.mlp.up_proj.global_scale"]
    assert scale.item() == (1.5 if ".global_scale" in spellings and len(spellings) > 1 else 0.5)
    assert not [k for k in source.weights if k.endswith("_scale_2") or ".weight." in k]


def test_mlx_lm_plural_names_in_blobs(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    base = "model.layers.0.mlp.up_proj"
    original = mx.random.normal((64, 64), key=mx.random.key(7))
    packed, scales, biases = mx.quantize(original, 32, 4)
    arrays = {f"{base}.weight": packed, f"{base}.scales": scales, f"{base}.biases": biases}
    add_tensor_layer(models, "tiny", f"{base}.weight", arrays)
    source = load_store_model("tiny")
    check_quantized(source, base, original, 32, 4)


def test_duplicate_digests_load_once(models: Path, hf_dir: Path) -> None:
    write_ollama_model(models, "tiny", hf_dir)
    path = parse_name("tiny").manifest_path(models)
    manifest = json.loads(path.read_text())
    manifest["layers"] += [x for x in manifest["layers"] if x["mediaType"].endswith("tensor")]
    path.write_text(json.dumps(manifest))
    assert set(load_store_model("tiny").weights) == set(fake_weights())


@pytest.mark.parametrize(
    ("packed", "scale", "hint", "want"),
    [
        (8, 2, "", ("INT4", 32)),  # 64 inputs, 4-bit, group 32
        (16, 1, "", ("INT8", 64)),  # 64 inputs, 8-bit, group 64
        (8, 1, "INT4", ("INT4", 64)),  # ambiguous: int4/64 or int8/32
        (8, 1, "INT8", ("INT8", 32)),
        (8, 1, "", None),
        (32, 2, "", ("INT8", 64)),
        (16, 1, "", ("INT8", 64)),
        (64, 2, "", ("INT8", 128)),
        (3, 7, "", None),
    ],
)
def test_infer_affine_from_shapes(packed: int, scale: int, hint: str, want) -> None:
    assert infer_affine_from_shapes(packed, scale, hint) == want


# ---- local directories (runner/sources/loader.py) ----


def test_local_dir(hf_dir: Path) -> None:
    source = load_model_source(str(hf_dir))
    assert source.config == CONFIG and source.quantization is None
    assert source.tokenizer_config == {"add_bos_token": False}
    want = fake_weights()
    assert all(mx.array_equal(source.weights[k], v) for k, v in want.items())
    assert set(source.weights) == set(want)


def test_local_dir_sharded(tmp_path: Path) -> None:
    hf = write_hf_dir(tmp_path / "sharded")
    want = fake_weights()
    (hf / "model.safetensors").unlink()
    names = sorted(want)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for file, keys in shards.items():
        mx.save_safetensors(str(hf / file), {k: want[k] for k in keys})
        weight_map |= dict.fromkeys(keys, file)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    source = load_local_dir(hf)
    assert set(source.weights) == set(want)
    # A shard that the index names but that is missing is an error, not a partial model.
    (hf / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        load_local_dir(hf)


@pytest.mark.parametrize(
    "shard",
    [
        "../outside.safetensors",
        "/abs/model.safetensors",
        "sub/model.safetensors",
        "..",
        ".",
        "",
        "model.safetensors\0x",
        5,
        None,
    ],
)
def test_local_index_names_only_files_in_the_directory(hf_dir: Path, shard: Any) -> None:
    (hf_dir.parent / "outside.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    index = {"weight_map": {f"{EMBED}.weight": "model.safetensors", f"{Q_PROJ}.weight": shard}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="not a file in the model directory"):
        load_local_dir(hf_dir)


@pytest.mark.parametrize("index", [{}, {"weight_map": ["model.safetensors"]}, []])
def test_local_index_without_a_weight_map(hf_dir: Path, index: Any) -> None:
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="has no weight_map object"):
        load_local_dir(hf_dir)


def test_local_dir_mlx_quantized(tmp_path: Path) -> None:
    weights = fake_weights()
    packed, scales, biases = mx.quantize(weights.pop(f"{Q_PROJ}.weight"), 64, 4)
    weights |= {f"{Q_PROJ}.weight": packed, f"{Q_PROJ}.scales": scales, f"{Q_PROJ}.biases": biases}
    hf = write_hf_dir(tmp_path / "mlx", weights)
    quantization = {"group_size": 64, "bits": 4, DOWN_PROJ: False}
    config = CONFIG | {"quantization": quantization, "quantization_config": quantization}
    (hf / "config.json").write_text(json.dumps(config))
    source = load_local_dir(hf)
    assert source.quantization == {"group_size": 64, "bits": 4, "mode": "affine", DOWN_PROJ: False}
    assert mx.array_equal(source.weights[f"{Q_PROJ}.scales"], scales)


def test_local_dir_foreign_quantization_is_refused(hf_dir: Path) -> None:
    config = CONFIG | {"quantization_config": {"quant_method": "gptq", "bits": 4}}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gptq"):
        load_local_dir(hf_dir)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_local_dir_missing_files(hf_dir: Path, missing: str) -> None:
    (hf_dir / missing).unlink()
    with pytest.raises(ModelLoadError):
        load_local_dir(hf_dir)


@pytest.mark.parametrize(
    "spelling", ["/no/such/dir", "./nowhere", "~/nowhere-at-all", "~no-such-user-here/x", "~\0"]
)
def test_missing_directory_is_not_a_store_name(spelling: str, models: Path) -> None:
    with pytest.raises(ModelLoadError, match="is not a model directory"):
        load_model_source(spelling)


def test_local_dir_corrupt_safetensors(hf_dir: Path) -> None:
    data = (hf_dir / "model.safetensors").read_bytes()
    (hf_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_local_dir(hf_dir)


def safetensors_bytes(header: Any, data: bytes = b"", header_length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    length = len(text) if header_length is None else header_length
    return struct.pack("<Q", length) + text + data


F32_PAIR = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"", "Unable to read 8 bytes"),
        (safetensors_bytes({EMBED + ".weight": F32_PAIR}, b"\0" * 4), "exceeding the size"),
        (
            safetensors_bytes({EMBED + ".weight": F32_PAIR | {"shape": [1000]}}, b"\0" * 8),
            "Expecting 4000 bytes",
        ),
        (safetensors_bytes({"a": F32_PAIR | {"dtype": "Q9"}}, b"\0" * 8), "unsupported dtype"),
        (safetensors_bytes({"a": F32_PAIR}, b"\0" * 8, 2**60), "Invalid json header length"),
        (safetensors_bytes([1, 2]), "Invalid json metadata"),
    ],
)
def test_malformed_safetensors_are_refused(hf_dir: Path, data: bytes, problem: str) -> None:
    (hf_dir / "model.safetensors").write_bytes(data)
    with pytest.raises(ModelLoadError, match=f"^cannot read .*model.safetensors: .*{problem}"):
        load_local_dir(hf_dir)


def test_default_alias_loads_the_prepared_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`default` is the prepared directory's GGUF, loaded as any GGUF file, named default."""
    from runner.sources import default_model
    from tests.gguf_models import write_gguf
    from tests.tiny import write_tiny_model

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    write_gguf(
        write_tiny_model("LlamaForCausalLM", tmp_path / "hf"), prepared / default_model.GGUF_NAME
    )
    monkeypatch.setattr(default_model, "resolve_default_model", lambda: prepared)
    source = load_model_source(loader.DEFAULT_ALIAS)
    assert source.name == "default" and source.config["architectures"] == ["LlamaForCausalLM"]
