"""Regenerate the tiny Qwen3.5 image-text models and their goldens with transformers.

    python tests/golden/make_qwen3_5_vision_goldens.py --configs   # config + weights manifest
    python tests/golden/make_qwen3_5_vision_goldens.py             # goldens only
    python tests/golden/make_qwen3_5_vision_goldens.py Qwen3_5MoeForConditionalGeneration  # one

For each architecture of `FAMILIES` (Qwen3_5ForConditionalGeneration, and its MoE sibling,
the same tower and images over tests/golden's tiny Qwen3.5-MoE text model), writes
tests/data/configs/<arch>{.json,.weights.json} (transformers' own config and the names its
model saves) and the family's golden file (tests/data/golden/qwen3_5_vision.npz for the dense
one):
- `pixels_<name>` / `grid_<name>`: transformers' image processor (`AutoImageProcessor`, the
  PIL backend here, `Qwen2VLImageProcessorPil`) on each generated image of `IMAGES`, with the
  tiny model's `PREPROCESSOR` (preprocessor_config.json);
- per prompt of `prompts`, its token ids and the logits of transformers' image-text model
  (CPU PyTorch, float32, eager attention) given
  `mm_token_type_ids` and `image_grid_thw` as Qwen3VLProcessor makes them (so transformers
  computes its own 3-channel rotary positions): every position of the one-image prompt,
  the last `TAIL` positions of the others;
- `generated`: transformers' greedy `generate` after the one-image prompt.
tests/test_qwen3_5_vision.py reads them (for both architectures), and imports the helpers
below for its live `-m reference` tier. Needs torch, transformers and Pillow.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the runner and tests/
from tests.golden.make_gemma3_vision_goldens import image_bytes  # noqa: E402
from tests.golden.make_goldens import CONFIG_ARGS, SHAPE, TOKENS, weight_manifest  # noqa: E402
from tests.tiny import (  # noqa: E402
    CONFIGS,
    GOLDEN,
    manifest_path,
    write_tiny_model,
)


@dataclass(frozen=True)
class Family:
    """An image-text architecture: its transformers config class, the tiny text model whose
    arguments (tests/golden/make_goldens.py) it nests, and its golden file."""

    config_class: str
    text_arch: str
    golden: Path


ARCH = "Qwen3_5ForConditionalGeneration"
MOE_ARCH = "Qwen3_5MoeForConditionalGeneration"
FAMILIES = {
    ARCH: Family("Qwen3_5Config", "Qwen3_5ForCausalLM", GOLDEN / "qwen3_5_vision.npz"),
    MOE_ARCH: Family(
        "Qwen3_5MoeConfig", "Qwen3_5MoeForCausalLM", GOLDEN / "qwen3_5_moe_vision.npz"
    ),
}
GOLDEN_FILE = FAMILIES[ARCH].golden
MAX_NEW_TOKENS = 6
EOS_ID = TOKENS["eos_token_id"]
TAIL = 8  # last positions stored for the prompts other than "one"

# The text model is tests/golden's Qwen3.5 or Qwen3.5-MoE (gated-delta and full-attention
# layers, partial interleaved mrope with sections [2, 1, 1] over 4 rotary pairs); the tower:
# 2 blocks, 8-pixel patches merged 2 x 2, a 4 x 4 learned position grid that every image's
# grid interpolates.
# The image ids sit above the tokenizer's 340 entries, inside the model's 384.
VISION_ARGS: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 8,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": SHAPE["hidden_size"],
    "num_position_embeddings": 16,
}
MULTIMODAL_ARGS: dict[str, Any] = {
    "image_token_id": 380,
    "vision_start_token_id": 381,
    "vision_end_token_id": 382,
    "video_token_id": 383,
}
# As Qwen's preprocessor_config.json spells it, with pixel limits for a tiny model: an image
# becomes 4 to 64 patches of 8 x 8 (1 to 16 tokens after the 2 x 2 merge).
PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": 1024, "longest_edge": 4096},
    "patch_size": 8,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

# (name, width, height, mode, format): the resize keeps, grows (min pixels) and shrinks (max
# pixels) them to grids of several aspect ratios.
IMAGES = (
    ("wide", 97, 41, "RGB", "PNG"),
    ("tall", 30, 75, "RGB", "PNG"),
    ("square", 64, 64, "RGB", "PNG"),
    ("alpha", 120, 90, "RGBA", "PNG"),
    ("large", 301, 223, "RGB", "JPEG"),
    ("small", 20, 12, "RGB", "PNG"),
)


def transformers_config(arch: str = ARCH) -> dict[str, Any]:
    """config.json as transformers 5 writes it for the tiny model of `arch`."""
    import transformers

    family = FAMILIES[arch]
    _, text_args = CONFIG_ARGS[family.text_arch]
    config = getattr(transformers, family.config_class)(
        text_config={**SHAPE, **TOKENS, **text_args},
        vision_config=VISION_ARGS,
        **MULTIMODAL_ARGS,
        architectures=[arch],
    )
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def write_model(path: Path, arch: str = ARCH, **kwargs: Any) -> Path:
    """The tiny model directory of `arch`, with its preprocessor_config.json."""
    write_tiny_model(arch, path, **kwargs)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return path


def all_image_bytes() -> dict[str, bytes]:
    return {spec[0]: image_bytes(*spec) for spec in IMAGES}


def image_tokens(grid: tuple[int, int, int], merge: int = 2) -> int:
    t, h, w = grid
    return t * h * w // (merge * merge)


def expansion(config: dict[str, Any], grid: tuple[int, int, int]) -> list[int]:
    """What Qwen3VLProcessor makes of `<|vision_start|><|image_pad|><|vision_end|>`."""
    pads = [config["image_token_id"]] * image_tokens(grid)
    return [config["vision_start_token_id"], *pads, config["vision_end_token_id"]]


def prompts(
    config: dict[str, Any], grids: dict[str, tuple[int, int, int]]
) -> dict[str, tuple[list[int], list[str]]]:
    """Token ids and the images they show, in order: one image, two images of different
    sizes (text between and after), text only."""
    rng = np.random.default_rng(4321)

    def text(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, 340, n)]

    def image(name: str) -> list[int]:
        return expansion(config, grids[name])

    return {
        "one": ([*text(5), *image("wide"), *text(6)], ["wide"]),
        "two": ([*text(3), *image("tall"), *text(4), *image("alpha"), *text(5)], ["tall", "alpha"]),
        "text": (text(30), []),
    }


def reference_processor() -> Any:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
        return transformers.AutoImageProcessor.from_pretrained(tmp)


def reference_pixels(
    images: dict[str, bytes], processor: Any = None
) -> dict[str, tuple[np.ndarray, tuple[int, int, int]]]:
    """transformers' patches [t*h*w, C*T*P*P] and grid (t, h, w) of each image."""
    from PIL import Image

    processor = processor or reference_processor()
    out = {}
    for name, data in images.items():
        result = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        grid = tuple(int(g) for g in result["image_grid_thw"][0])
        out[name] = (np.asarray(result["pixel_values"], dtype=np.float32), grid)
    return out  # type: ignore[return-value]


def reference_model(model_dir: Path) -> Any:
    import torch
    import transformers

    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, arch).from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"transformers did not load {model_dir} cleanly: {bad}")
    return model.eval()


def _inputs(
    model: Any, ids: list[int], shown: list[tuple[np.ndarray, tuple[int, int, int]]]
) -> dict[str, Any]:
    import torch

    input_ids = torch.tensor([ids], dtype=torch.int64)
    inputs: dict[str, Any] = {"input_ids": input_ids}
    if shown:
        inputs["pixel_values"] = torch.tensor(np.concatenate([p for p, _ in shown]))
        inputs["image_grid_thw"] = torch.tensor([g for _, g in shown], dtype=torch.int64)
        inputs["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
    return inputs


def reference_logits(
    model: Any, ids: list[int], shown: list[tuple[np.ndarray, tuple[int, int, int]]]
) -> np.ndarray:
    """Logits at every position, [len(ids), vocab]."""
    import torch

    with torch.no_grad():
        out = model(**_inputs(model, ids, shown), use_cache=False)
    return out.logits[0].float().numpy()


def reference_generation(
    model: Any, ids: list[int], shown: list[tuple[np.ndarray, tuple[int, int, int]]]
) -> list[int]:
    """Greedy new tokens (up to EOS, excluded, or MAX_NEW_TOKENS)."""
    import torch

    inputs = _inputs(model, ids, shown)
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
    config = json.loads((model_dir / "config.json").read_text())
    pixels = reference_pixels(all_image_bytes())
    grids = {name: grid for name, (_, grid) in pixels.items()}
    model = reference_model(model_dir)
    arrays: dict[str, np.ndarray] = {}
    for name, (p, grid) in pixels.items():
        arrays[f"pixels_{name}"] = p
        arrays[f"grid_{name}"] = np.array(grid, np.int32)
    for name, (ids, shown) in prompts(config, grids).items():
        arrays[f"tokens_{name}"] = np.array(ids, np.int32)
        logits = reference_logits(model, ids, [pixels[s] for s in shown])
        arrays[f"logits_{name}"] = logits if name == "one" else logits[-TAIL:]
    ids, shown = prompts(config, grids)["one"]
    arrays["generated"] = np.array(
        reference_generation(model, ids, [pixels[s] for s in shown]), np.int32
    )
    return arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", nargs="*", help=f"of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--configs", action="store_true", help="rewrite config and manifest")
    args = parser.parse_args()
    unknown = set(args.arch) - set(FAMILIES)
    if unknown:
        parser.error(f"not an image-text family here: {', '.join(sorted(unknown))}")
    for arch in args.arch or FAMILIES:
        if args.configs:
            text = json.dumps(transformers_config(arch), indent=2, sort_keys=True)
            (CONFIGS / f"{arch}.json").write_text(text + "\n")
            manifest = json.dumps(weight_manifest(arch), indent=1, sort_keys=True)
            manifest_path(arch).write_text(manifest + "\n")
            print("wrote", CONFIGS / f"{arch}.json", manifest_path(arch))
        with tempfile.TemporaryDirectory() as tmp:
            arrays = compute_goldens(write_model(Path(tmp), arch))
        golden = FAMILIES[arch].golden
        np.savez_compressed(golden, **arrays)
        print("wrote", golden, "generated", arrays["generated"].tolist())


if __name__ == "__main__":
    main()
