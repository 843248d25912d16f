"""The checkpoint layouts of the MoE and Mistral families: each loads into the same model as the
tiny Hugging Face checkpoint it is rearranged from (tests/tiny.py), so the goldens checked
on that one (tests/test_golden.py) hold for these too."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from runner.models import Model, build_model
from runner.sources.loader import load_local_dir, load_model_source
from runner.sources.source import ModelLoadError, ModelSource
from tests.ollama_store import write_ollama_model
from tests.tiny import tiny_config, write_tiny_model

IDS = mx.array([[5, 77, 3, 250, 19, 42, 8, 301, 11, 64, 199, 7]], dtype=mx.int32)


def logits(model: Model) -> np.ndarray:
    return np.array(model.unembed(model.hidden(IDS, model.make_caches())).astype(mx.float32))


def rearranged(path: Path, rename: Any) -> ModelSource:
    """The checkpoint in `path` with its weights passed through `rename(weights) -> weights`."""
    s = load_local_dir(path)
    s.weights = rename(dict(s.weights))
    return s


def per_expert(weights: dict[str, mx.array]) -> dict[str, dict[int, mx.array]]:
    """{`<p>.mlp.experts.<proj>`: {expert: weight}} of a checkpoint stored per expert."""
    out: dict[str, dict[int, mx.array]] = {}
    for name in list(weights):
        m = re.match(r"^(.+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            out.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = weights.pop(name)
    return out


def stacked(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Experts pre-stacked as Ollama's importer stores them: `<p>.mlp.experts.<proj>.weight`."""
    for name, experts in per_expert(weights).items():
        weights[f"{name}.weight"] = mx.stack([experts[e] for e in sorted(experts)])
    return weights


def fused(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Experts fused as transformers holds them: `experts.gate_up_proj` [E, 2I, H] (gate rows
    first) and `experts.down_proj` [E, H, I]."""
    groups = per_expert(weights)
    for name in [n for n in groups if n.endswith(".gate_proj")]:
        base = name.removesuffix(".gate_proj")
        gate, up = groups[name], groups[f"{base}.up_proj"]
        weights[f"{base}.gate_up_proj"] = mx.stack(
            [mx.concatenate([gate[e], up[e]]) for e in sorted(gate)]
        )
        down = groups[f"{base}.down_proj"]
        weights[f"{base}.down_proj"] = mx.stack([down[e] for e in sorted(down)])
    return weights


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM"])
@pytest.mark.parametrize("layout", [stacked, fused])
def test_stacked_and_fused_experts_load_as_per_expert(tmp_path: Path, arch: str, layout) -> None:
    path = write_tiny_model(arch, tmp_path)
    want = logits(build_model(load_local_dir(path)))
    got = logits(build_model(rearranged(path, layout)))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_moe_model_from_an_ollama_store(tmp_path: Path, monkeypatch, arch: str) -> None:
    """Imported as Ollama does (a tensor blob per tensor), the model computes what the
    directory computes; quantized to int8, its per-expert 2-D weights load as quantized
    switch layers and it stays close to the dense model."""
    path = write_tiny_model(arch, tmp_path / "hf")
    models = tmp_path / "models"
    write_ollama_model(models, "tiny-moe", path)
    write_ollama_model(models, "tiny-moe-int8", path, quantize={"type": "int8"})
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    want = logits(build_model(load_local_dir(path)))
    assert np.array_equal(logits(build_model(load_model_source("tiny-moe"))), want)
    quantized = build_model(load_model_source("tiny-moe-int8"))
    mlp = quantized.module.model.layers[1].mlp
    if arch == "Qwen3MoeForCausalLM":
        assert isinstance(mlp.switch_mlp.up_proj, QuantizedSwitchLinear)
    else:  # GPT-OSS's experts are 3-D tensors, which the importer leaves dense
        assert isinstance(mlp.router, nn.QuantizedLinear)
    assert np.corrcoef(logits(quantized).ravel(), want.ravel())[0, 1] > 0.99


def test_missing_or_misshaped_experts_are_named(tmp_path: Path) -> None:
    def drop(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
        return weights

    s = rearranged(write_tiny_model("Qwen3MoeForCausalLM", tmp_path), drop)
    with pytest.raises(ModelLoadError, match=r"switch_mlp\.up_proj\.weight needs experts 0\.\.3"):
        build_model(s)

    def misshape(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        name = "model.layers.1.mlp.experts.2.up_proj.weight"
        weights[name] = weights[name][:-1]
        return weights

    s = rearranged(write_tiny_model("Qwen3MoeForCausalLM", tmp_path), misshape)
    with pytest.raises(ModelLoadError, match=r"experts of .*switch_mlp\.up_proj\.weight differ"):
        build_model(s)


def conditional_generation(
    path: Path, tie: bool | None, arch: str = "Qwen3_5MoeForConditionalGeneration"
) -> ModelSource:
    """The tiny Qwen3.5(-MoE) text checkpoint in `path` as the image-text model's: config
    nested under text_config, weights under model.language_model., the tiny tower of `arch`
    (its vision_config, image token ids and model.visual. weights) and an MTP head that is
    not loaded."""
    from tests.tiny import random_weights

    s = load_local_dir(path)
    text = dict(s.config)
    vision = tiny_config(arch)
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": "qwen3_5_moe" if "Moe" in arch else "qwen3_5",
        "text_config": text,
        **{k: v for k, v in vision.items() if k.endswith(("token_id", "vision_config"))},
    }
    if tie is not None:
        config["tie_word_embeddings"] = tie
        text["tie_word_embeddings"] = not tie  # the top level decides, as in transformers
    weights = {}
    for name, value in s.weights.items():
        if name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        weights[name] = value
    tower = random_weights(vision)
    weights.update({k: mx.array(v) for k, v in tower.items() if k.startswith("model.visual.")})
    weights["mtp.fc.weight"] = mx.zeros((64, 128))
    s.config, s.weights = config, weights
    return s


@pytest.mark.parametrize(
    ("text_arch", "arch"),
    [
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    ],
)
def test_qwen3_5_image_text_checkpoint_serves_its_text_model(
    tmp_path: Path, text_arch: str, arch: str
) -> None:
    """Text through the image model (runner/models/qwen3_5_vision/: it needs its whole
    tower) is the text model's, bit for bit."""
    path = write_tiny_model(text_arch, tmp_path)
    text = build_model(load_local_dir(path))
    model = build_model(conditional_generation(path, False, arch))
    assert model.architecture == arch
    assert model.context_length == tiny_config(text_arch)["max_position_embeddings"]
    assert model.vocab_size == 384
    assert [type(c) for c in model.make_caches()] == [type(c) for c in text.make_caches()]
    assert np.array_equal(logits(model), logits(text))


def test_qwen3_5_moe_image_text_checkpoint_ties_by_its_top_level(tmp_path: Path) -> None:
    path = write_tiny_model("Qwen3_5MoeForCausalLM", tmp_path, tie_word_embeddings=True)
    text = build_model(load_local_dir(path))
    s = conditional_generation(path, tie=True)
    s.weights.pop("lm_head.weight", None)
    assert np.array_equal(logits(build_model(s)), logits(text))
    s = conditional_generation(path, tie=None)  # transformers' default: untied
    s.weights.pop("lm_head.weight", None)
    with pytest.raises(ModelLoadError, match=r"missing lm_head\.weight"):
        build_model(s)


def test_qwen3_5_moe_image_text_config_must_nest_an_object(tmp_path: Path) -> None:
    s = conditional_generation(write_tiny_model("Qwen3_5MoeForCausalLM", tmp_path), tie=False)
    s.config["text_config"] = json.dumps(s.config["text_config"])
    with pytest.raises(ModelLoadError, match="text_config must be an object"):
        build_model(s)


def gpt_oss_split(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """GPT-OSS's experts as mlx-lm (and a stacked import) hold them: output-major
    `experts.<proj>.weight` [E, out, in] and `experts.<proj>.bias`, gate and up apart."""
    for name in [n for n in weights if n.endswith(".experts.gate_up_proj")]:
        p = name.removesuffix("gate_up_proj")
        gate_up = weights.pop(name).swapaxes(-1, -2)
        bias = weights.pop(p + "gate_up_proj_bias")
        weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"] = (
            gate_up[:, ::2],
            gate_up[:, 1::2],
        )
        weights[p + "gate_proj.bias"], weights[p + "up_proj.bias"] = bias[:, ::2], bias[:, 1::2]
        weights[p + "down_proj.weight"] = weights.pop(p + "down_proj").swapaxes(-1, -2)
        weights[p + "down_proj.bias"] = weights.pop(p + "down_proj_bias")
    return weights


def test_gpt_oss_experts_split_output_major_load_as_transformers_layout(tmp_path: Path) -> None:
    path = write_tiny_model("GptOssForCausalLM", tmp_path)
    want = logits(build_model(load_local_dir(path)))
    assert np.array_equal(logits(build_model(rearranged(path, gpt_oss_split))), want)


# --- Mistral3ForConditionalGeneration: the text model of Mistral Small 3 / Ministral 3 ------


def mistral3_image_text(path: Path, tie: bool | None) -> ModelSource:
    """The tiny text checkpoint in `path` (Mistral or Ministral3) as Mistral3's image-text
    checkpoint: config under text_config, weights under model.language_model., a vision tower
    and projector that are not loaded."""
    s = load_local_dir(path)
    config: dict[str, Any] = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "text_config": dict(s.config),
        "vision_config": {"model_type": "pixtral", "hidden_size": 32},
    }
    if tie is not None:
        config["tie_word_embeddings"] = tie
    weights = {}
    for name, value in s.weights.items():
        if name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        weights[name] = value
    weights["model.vision_tower.patch_conv.weight"] = mx.zeros((32, 3, 16, 16))
    weights["model.multi_modal_projector.linear_1.weight"] = mx.zeros((64, 32))
    s.config, s.weights = config, weights
    return s


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Ministral3ForCausalLM"])
def test_mistral3_image_text_checkpoint_serves_its_text_model(tmp_path: Path, arch: str) -> None:
    path = write_tiny_model(arch, tmp_path)
    text = build_model(load_local_dir(path))
    model = build_model(mistral3_image_text(path, tie=False))
    assert model.architecture == "Mistral3ForConditionalGeneration"
    assert model.context_length == tiny_config(arch)["max_position_embeddings"]
    assert [type(c) for c in model.make_caches()] == [type(c) for c in text.make_caches()]
    assert np.array_equal(logits(model), logits(text))


def test_mistral3_image_text_checkpoint_is_tied_unless_it_says_not(tmp_path: Path) -> None:
    """transformers' Mistral3Config ties by default; the text config's flag does not count."""
    path = write_tiny_model("MistralForCausalLM", tmp_path, tie_word_embeddings=True)
    text = build_model(load_local_dir(path))
    s = mistral3_image_text(path, tie=None)
    s.config["text_config"]["tie_word_embeddings"] = False
    assert "lm_head" not in build_model(s).module
    assert np.array_equal(logits(build_model(s)), logits(text))


def test_mistral3_image_text_refuses_other_text_models(tmp_path: Path) -> None:
    s = mistral3_image_text(write_tiny_model("MistralForCausalLM", tmp_path), tie=False)
    s.config["text_config"]["model_type"] = "llama"
    with pytest.raises(ModelLoadError, match=r"text_config\.model_type 'llama' is not supported"):
        build_model(s)


# --- reference tier: the image-text checkpoints against transformers itself --------------------

VISION = {
    "Mistral3ForConditionalGeneration": {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": 64,
        "patch_size": 16,
    },
    "Qwen3_5ForConditionalGeneration": {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 16,
    },
    "Qwen3_5MoeForConditionalGeneration": {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 16,
    },
}
# Image token ids inside the tiny vocabulary, for the families that check them at load.
IMAGE_TOKEN_IDS: dict[str, dict[str, int]] = {
    arch: {k: v for k, v in tiny_config(arch).items() if k.endswith("token_id")}
    for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
}
IMAGE_TEXT = [
    ("Mistral3ForConditionalGeneration", "Mistral3Config", "Ministral3ForCausalLM", False),
    ("Mistral3ForConditionalGeneration", "Mistral3Config", "MistralForCausalLM", None),
    ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig", "Qwen3_5MoeForCausalLM", False),
    ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", "Qwen3_5ForCausalLM", False),
]


@pytest.mark.reference
@pytest.mark.usefixtures("reference_libraries")
@pytest.mark.parametrize(("arch", "config_class", "text_arch", "tie"), IMAGE_TEXT)
def test_image_text_checkpoint_matches_transformers(
    tmp_path: Path, arch: str, config_class: str, text_arch: str, tie: bool | None
) -> None:
    """A checkpoint transformers' image-text class saves (random weights, vision tower
    included) loads as its text model, with transformers' logits for text."""
    import torch
    import transformers

    from tests.tiny import TOKENIZER_CONFIG, tokenizer_json

    text = {k: v for k, v in tiny_config(text_arch).items() if k != "architectures"}
    extra = {} if tie is None else {"tie_word_embeddings": tie}
    extra |= IMAGE_TOKEN_IDS.get(arch, {})
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=VISION[arch], architectures=[arch], **extra
    )
    torch.manual_seed(0)
    reference = getattr(transformers, arch)(config).float().eval()
    with torch.no_grad():  # weights large enough that attention and routing are not uniform
        for _, p in reference.named_parameters():
            p.copy_(torch.randn_like(p) * 0.08 if p.ndim > 1 else p + 0.1 * torch.randn_like(p))
    reference.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    model = build_model(load_local_dir(tmp_path))
    with torch.no_grad():
        ids = torch.tensor(np.array(IDS), dtype=torch.int64)
        expected = reference(input_ids=ids, use_cache=False).logits[0].numpy()
    got = np.array(model.unembed(model.hidden(IDS, model.make_caches()))[0])
    assert np.abs(got - expected).max() <= 1e-4
