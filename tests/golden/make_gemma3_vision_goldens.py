"""Regenerate the tiny Gemma3ForConditionalGeneration model and its goldens with transformers.

    python tests/golden/make_gemma3_vision_goldens.py --configs   # config + weights manifest
    python tests/golden/make_gemma3_vision_goldens.py             # goldens only

Writes tests/data/configs/Gemma3ForConditionalGeneration{.json,.weights.json} (transformers'
own Gemma3Config and the names its model saves) and tests/data/golden/gemma3_vision.npz:
- `pixels_<name>`: transformers' image processor (`AutoImageProcessor`, which is the PIL
  backend here, `Gemma3ImageProcessorPil`) on each generated image of `IMAGES`;
- per prompt of `prompts`, its token ids and the logits (at every position for the one-image
  prompt, else at the last) of transformers' Gemma3ForConditionalGeneration (CPU PyTorch,
  float32, eager attention) with `token_type_ids` marking the image soft tokens, as
  Gemma3Processor makes them;
- `generated`: transformers' greedy `generate` after the one-image prompt.
tests/test_gemma3_vision.py reads the file, and imports the helpers below for its live
`-m reference` tier. Needs torch, transformers and Pillow.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the runner (its tokenizer) and tests/
from tests.golden.make_goldens import CONFIG_ARGS, SHAPE, TOKENS, weight_manifest  # noqa: E402
from tests.tiny import (  # noqa: E402
    CONFIGS,
    GOLDEN,
    manifest_path,
    tiny_config,
    tokenizer_json,
    write_tiny_model,
)

ARCH = "Gemma3ForConditionalGeneration"
GOLDEN_FILE = GOLDEN / "gemma3_vision.npz"
MAX_NEW_TOKENS = 6
EOS_ID = TOKENS["eos_token_id"]

# The tiny text model is tests/golden's Gemma3 (4 layers, window 8, per-kind RoPE, ...); the
# tower has 64 patches pooled 2 x 2 into 16 soft tokens, more than the window of 8, so the
# sliding layers' mask (window AND (causal OR same image)) differs from both of its parts.
# The image ids sit above the tokenizer's 340 entries, inside the model's 384.
VISION_ARGS: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 64,
    "patch_size": 8,
    "vision_use_head": False,
}
MULTIMODAL_ARGS: dict[str, Any] = {
    "mm_tokens_per_image": 16,
    "image_token_index": 380,
    "boi_token_index": 381,
    "eoi_token_index": 382,
}

# (name, width, height, mode, format): sizes and aspect ratios around the tower's 64 x 64.
IMAGES = (
    ("wide", 97, 41, "RGB", "PNG"),
    ("tall", 30, 75, "RGB", "PNG"),
    ("square", 64, 64, "RGB", "PNG"),
    ("alpha", 120, 90, "RGBA", "PNG"),
    ("large", 301, 223, "RGB", "JPEG"),
)


def transformers_config() -> dict[str, Any]:
    """config.json as transformers 5 writes it for the tiny model."""
    import transformers

    _, text_args = CONFIG_ARGS["Gemma3ForCausalLM"]
    config = transformers.Gemma3Config(
        text_config={**SHAPE, **TOKENS, **text_args},
        vision_config={"model_type": "siglip_vision_model", **VISION_ARGS},
        **MULTIMODAL_ARGS,
        architectures=[ARCH],
    )
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def image_bytes(name: str, width: int, height: int, mode: str, fmt: str) -> bytes:
    """A deterministic picture: smooth colour gradients (so resizing has structure to keep)
    plus seeded noise, and for RGBA an alpha ramp."""
    from PIL import Image

    rng = np.random.default_rng(sum(map(ord, name)))
    y, x = np.mgrid[0:height, 0:width]
    planes = [
        255 * x / max(width - 1, 1),
        255 * y / max(height - 1, 1),
        127.5 + 127.5 * np.sin((x + 2 * y) / 7.0),
    ]
    if mode == "RGBA":
        planes.append(255 * (x + y) / max(width + height - 2, 1))
    pixels = np.stack(planes, axis=-1) + rng.normal(0, 20, (height, width, len(planes)))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def all_image_bytes() -> dict[str, bytes]:
    return {spec[0]: image_bytes(*spec) for spec in IMAGES}


def expansion(config: dict[str, Any]) -> tuple[list[int], int]:
    """Gemma3Processor's image sequence in the tiny tokenizer's ids, and where the soft
    tokens start (the runner's tokenizer for "\\n\\n", as the model binds it)."""
    from runner.text.tokenizer import Tokenizer

    newline = Tokenizer(tokenizer_json()).encode("\n\n")
    soft = [config["image_token_index"]] * config["mm_tokens_per_image"]
    ids = [*newline, config["boi_token_index"], *soft, config["eoi_token_index"], *newline]
    return ids, len(newline) + 1


def prompts(config: dict[str, Any]) -> dict[str, tuple[list[int], list[str]]]:
    """Token ids and the images they show, in order: one image, two images, text only."""
    rng = np.random.default_rng(4321)
    image, _ = expansion(config)

    def text(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, 340, n)]

    return {
        "one": ([*text(5), *image, *text(6)], ["wide"]),
        "two": ([*text(3), *image, *text(4), *image, *text(5)], ["tall", "alpha"]),
        "text": (text(30), []),
    }


def reference_pixels(images: dict[str, bytes], size: int) -> dict[str, np.ndarray]:
    """transformers' Gemma3 image processor, as AutoImageProcessor gives it for a
    preprocessor_config.json like Google's (pan-and-scan off)."""
    import transformers
    from PIL import Image

    processor_config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": size, "width": size},
        "resample": 2,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pan_and_scan": None,
    }
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "preprocessor_config.json").write_text(json.dumps(processor_config))
        processor = transformers.AutoImageProcessor.from_pretrained(tmp)
    out = {}
    for name, data in images.items():
        image = Image.open(io.BytesIO(data))
        pixels = processor(images=[image], return_tensors="np")["pixel_values"]
        out[name] = np.asarray(pixels[0], dtype=np.float32)
    return out


def reference_model(model_dir: Path) -> Any:
    import torch
    import transformers

    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"transformers did not load {model_dir} cleanly: {bad}")
    return model.eval()


def _inputs(model: Any, ids: list[int], pixels: list[np.ndarray]) -> dict[str, Any]:
    import torch

    input_ids = torch.tensor([ids], dtype=torch.int64)
    inputs: dict[str, Any] = {"input_ids": input_ids}
    if pixels:
        inputs["pixel_values"] = torch.tensor(np.stack(pixels))
        inputs["token_type_ids"] = (input_ids == model.config.image_token_id).long()
    return inputs


def reference_logits(model: Any, ids: list[int], pixels: list[np.ndarray]) -> np.ndarray:
    """Logits at every position, [len(ids), vocab]."""
    import torch

    with torch.no_grad():
        out = model(**_inputs(model, ids, pixels), use_cache=False)
    return out.logits[0].float().numpy()


def reference_generation(model: Any, ids: list[int], pixels: list[np.ndarray]) -> list[int]:
    """Greedy new tokens (up to EOS, excluded, or MAX_NEW_TOKENS)."""
    import torch

    inputs = _inputs(model, ids, pixels)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            attention_mask=torch.ones_like(inputs["input_ids"]),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=EOS_ID,
            pad_token_id=0,
        )
    new = [int(t) for t in out[0, len(ids) :]]
    return new[: new.index(EOS_ID)] if EOS_ID in new else new


def compute_goldens(model_dir: Path) -> dict[str, np.ndarray]:
    config = tiny_config(ARCH)
    size = config["vision_config"]["image_size"]
    pixels = reference_pixels(all_image_bytes(), size)
    model = reference_model(model_dir)
    arrays = {f"pixels_{name}": p for name, p in pixels.items()}
    for name, (ids, shown) in prompts(config).items():
        arrays[f"tokens_{name}"] = np.array(ids, np.int32)
        logits = reference_logits(model, ids, [pixels[s] for s in shown])
        # every position of the one-image prompt (the image's own rows included), else the last
        arrays[f"logits_{name}"] = logits if name == "one" else logits[-1:]
    ids, shown = prompts(config)["one"]
    arrays["generated"] = np.array(
        reference_generation(model, ids, [pixels[s] for s in shown]), np.int32
    )
    return arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", action="store_true", help="rewrite config and manifest")
    args = parser.parse_args()
    if args.configs:
        text = json.dumps(transformers_config(), indent=2, sort_keys=True)
        (CONFIGS / f"{ARCH}.json").write_text(text + "\n")
        manifest = json.dumps(weight_manifest(ARCH), indent=1, sort_keys=True)
        manifest_path(ARCH).write_text(manifest + "\n")
        print("wrote", CONFIGS / f"{ARCH}.json", manifest_path(ARCH))
    with tempfile.TemporaryDirectory() as tmp:
        arrays = compute_goldens(write_tiny_model(ARCH, Path(tmp)))
    np.savez_compressed(GOLDEN_FILE, **arrays)
    print("wrote", GOLDEN_FILE, "generated", arrays["generated"].tolist())


if __name__ == "__main__":
    main()
