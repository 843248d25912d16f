"""Gemma3ForConditionalGeneration with images vs transformers, on a tiny random model.

Default tier, against tests/data/golden/gemma3_vision.npz (written by
tests/golden/make_gemma3_vision_goldens.py):
- `decode_image` on PNG, JPEG, GIF (first frame) and WebP, and its error on bad bytes;
- `preprocess` equals transformers' Gemma3 image processor on images of several sizes and
  aspect ratios (one with transparency, one JPEG);
- `expansion()` is Gemma3Processor's image sequence;
- logits equal transformers' (float32, <= 1e-4) for prompts with one and with two images and
  for text only, one-shot and in chunks that never cut an image's soft tokens, at every
  position of the one-image prompt (the image's own rows included);
- greedy generation after an image equals transformers' token for token;
- the same model read from an Ollama store gives the same logits; bad configs are refused.
`-m reference` recomputes everything live with transformers, on more image shapes. Its text
rows through the runner's caches are the shared cache tests' (tests/test_prefix_cache_models.py,
tests/test_generate_cache.py, parametrized over tests/tiny.py's IMAGE_TEXT_ARCHITECTURES).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from runner.media.images import decode_image
from runner.models import build_model
from runner.models.gemma3_vision import Gemma3Multimodal, vision
from runner.sources.loader import load_local_dir
from runner.sources.ollama_store import load_store_model
from runner.sources.source import ModelLoadError
from runner.text.tokenizer import Tokenizer
from tests.golden.make_gemma3_vision_goldens import (
    ARCH,
    EOS_ID,
    GOLDEN_FILE,
    all_image_bytes,
    expansion,
    image_bytes,
    prompts,
)
from tests.ollama_store import write_ollama_model
from tests.tiny import tiny_config, tokenizer_json, write_tiny_model

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(ARCH, tmp_path_factory.mktemp("gemma3-vision"))


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Gemma3Multimodal:
    loaded = build_model(load_local_dir(model_dir))
    assert isinstance(loaded, Gemma3Multimodal)
    return loaded


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN_FILE) as data:
        return dict(data)


def image_ranges(model: Gemma3Multimodal, ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each image's soft tokens in `ids`."""
    ranges, i = [], 0
    while i < len(ids):
        if ids[i] == model.image_token_id:
            ranges.append((i, i + model.image_tokens))
            i += model.image_tokens
        else:
            i += 1
    return ranges


def chunk_plan(n: int, size: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Chunks of `size`, a cut strictly inside an image moved to that image's end (the Go
    runner's extendChunk for an atomic expansion that started before the chunk)."""
    plan, start = [], 0
    while start < n:
        end = min(start + size, n)
        for a, b in ranges:
            if a < end < b:
                end = b if a <= start else a
                break
        plan.append((start, end))
        start = end
    return plan


def forward(
    model: Gemma3Multimodal,
    ids: list[int],
    images: list[bytes],
    plan: list[tuple[int, int]] | None = None,
    caches: list[Any] | None = None,
) -> tuple[np.ndarray, list[Any]]:
    """Logits at every position, through `plan`'s chunks (default: one shot), each chunk's
    images given with chunk-relative positions."""
    ranges = image_ranges(model, ids)
    assert len(ranges) == len(images)
    features = [model.encode_image(mx.array(model.preprocess(data))[None]) for data in images]
    caches = model.make_caches() if caches is None else caches
    out = []
    for start, end in plan or [(0, len(ids))]:
        media = [
            (a - start, f) for (a, _), f in zip(ranges, features, strict=True) if start <= a < end
        ]
        for a, b in ranges:
            assert not (a < start < b or a < end < b), "a chunk cuts an image"
        tokens = mx.array(ids[start:end], dtype=mx.int32)[None]
        out.append(model.unembed(model.hidden(tokens, caches, media or None))[0])
    return np.array(mx.concatenate(out).astype(mx.float32)), caches


# --- decoding and preprocessing -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_decode_image_round_trips(fmt: str) -> None:
    y, x = np.mgrid[0:12, 0:20]
    pixels = np.stack([x * 12, y * 20, (x * y) % 256], axis=-1).astype(np.uint8)
    frames = [Image.fromarray(pixels), Image.fromarray(255 - pixels)]
    out = io.BytesIO()
    if fmt == "GIF":  # two frames: the first is the image
        frames[0].save(out, format=fmt, save_all=True, append_images=frames[1:])
    else:
        frames[0].save(out, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    image = decode_image(out.getvalue())
    assert image.size == (20, 12)
    got = np.asarray(image.convert("RGB"), dtype=np.int32)
    if fmt == "JPEG":
        assert np.abs(got - pixels).mean() < 12
    elif fmt == "GIF":  # a palette of at most 256 colours; the second frame is the inverse
        expected = np.asarray(Image.open(io.BytesIO(out.getvalue())).convert("RGB"))
        assert (got == expected).all()
        assert np.abs(got - pixels).mean() < np.abs(got - (255 - pixels)).mean()
    else:
        assert (got == pixels).all()


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "truncated", "bmp"],
)
def test_decode_image_refuses_bad_bytes(data: Any) -> None:
    if data == "truncated":
        data = image_bytes("cut", 40, 30, "RGB", "PNG")[:-30]
    elif data == "bmp":  # a format Pillow reads but the Go runner does not
        out = io.BytesIO()
        Image.new("RGB", (4, 4)).save(out, format="BMP")
        data = out.getvalue()
    with pytest.raises(ValueError, match=r"^invalid image data: "):
        decode_image(data)


def test_preprocess_equals_transformers(model: Gemma3Multimodal, golden: dict) -> None:
    for name, data in all_image_bytes().items():
        got = model.preprocess(data)
        assert got.dtype == np.float32 and got.shape == (3, 64, 64)
        assert np.abs(got - golden[f"pixels_{name}"]).max() <= 1e-6, name


def test_preprocess_refuses_bad_bytes(model: Gemma3Multimodal) -> None:
    with pytest.raises(ValueError, match=r"^invalid image data: "):
        model.preprocess(b"GIF89a broken")


# --- the expansion and the logits ---------------------------------------------------------


def test_expansion_is_gemma3_processors(model: Gemma3Multimodal) -> None:
    ids, start, end = model.expansion()
    config = tiny_config(ARCH)
    expected, soft_start = expansion(config)
    assert ids == expected
    assert (start, end) == (soft_start, soft_start + 16)
    assert ids[start - 1] == model.boi_token_id == 381
    assert ids[end] == model.eoi_token_id == 382
    assert ids[start:end] == [model.image_token_id] * model.image_tokens == [380] * 16
    tokenizer = Tokenizer(tokenizer_json())
    for blank in (ids[: start - 1], ids[end + 1 :]):
        assert b"".join(tokenizer.token_bytes(t) for t in blank) == b"\n\n"


@pytest.mark.parametrize("name", ["one", "two", "text"])
def test_logits_equal_transformers_one_shot(
    model: Gemma3Multimodal, golden: dict, name: str
) -> None:
    ids, shown = prompts(tiny_config(ARCH))[name]
    assert ids == golden[f"tokens_{name}"].tolist()
    images = all_image_bytes()
    got, _ = forward(model, ids, [images[s] for s in shown])
    expected = golden[f"logits_{name}"]
    diff = np.abs(got[-len(expected) :] - expected).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g}"


@pytest.mark.parametrize("name", ["one", "two", "text"])
@pytest.mark.parametrize("size", [1, 5, 7, 13])
def test_logits_equal_transformers_in_chunks(
    model: Gemma3Multimodal, golden: dict, name: str, size: int
) -> None:
    ids, shown = prompts(tiny_config(ARCH))[name]
    images = all_image_bytes()
    plan = chunk_plan(len(ids), size, image_ranges(model, ids))
    assert len(plan) > 2
    got, _ = forward(model, ids, [images[s] for s in shown], plan)
    expected = golden[f"logits_{name}"]
    diff = np.abs(got[-len(expected) :] - expected).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g} with chunks {plan}"


def test_images_attend_both_ways(model: Gemma3Multimodal, golden: dict) -> None:
    """An image's first soft token sees the later ones: its logits move when they do."""
    ids, _ = prompts(tiny_config(ARCH))["one"]
    (a, _), images = image_ranges(model, ids)[0], all_image_bytes()
    base, _ = forward(model, ids, [images["wide"]])
    other, _ = forward(model, ids, [images["tall"]])
    assert np.abs(base[a] - golden["logits_one"][a]).max() <= TOLERANCE
    assert np.abs(base[:a] - other[:a]).max() <= 1e-6  # text before the image cannot see it
    assert np.abs(base[a] - other[a]).max() > 1e-3


def test_without_media_is_the_text_path(model: Gemma3Multimodal) -> None:
    ids, _ = prompts(tiny_config(ARCH))["text"]
    tokens = mx.array(ids, dtype=mx.int32)[None]
    plain = model.unembed(model.hidden(tokens, model.make_caches()))
    empty = model.unembed(model.hidden(tokens, model.make_caches(), []))
    assert np.array_equal(np.array(plain), np.array(empty))


def test_greedy_generation_equals_transformers(model: Gemma3Multimodal, golden: dict) -> None:
    ids, shown = prompts(tiny_config(ARCH))["one"]
    images = all_image_bytes()
    plan = chunk_plan(len(ids), 7, image_ranges(model, ids))
    logits, caches = forward(model, ids, [images[s] for s in shown], plan)
    expected = golden["generated"].tolist()
    generated = [int(np.argmax(logits[-1]))]
    while len(generated) < len(expected):
        token = mx.array([[generated[-1]]], dtype=mx.int32)
        generated.append(int(mx.argmax(model.unembed(model.hidden(token, caches))[0, -1])))
    assert generated == expected


def test_media_that_does_not_fit_the_chunk_is_refused(model: Gemma3Multimodal) -> None:
    features = mx.zeros((16, 64))
    tokens = mx.zeros((1, 10), dtype=mx.int32)
    with pytest.raises(ValueError, match="does not fit"):
        model.hidden(tokens, model.make_caches(), [(0, features)])
    with pytest.raises(ValueError, match="pixels must be"):
        model.encode_image(mx.zeros((1, 3, 32, 32)))


# --- loading ------------------------------------------------------------------------------


def test_loads_from_an_ollama_store(model_dir: Path, golden: dict, tmp_path: Path) -> None:
    write_ollama_model(tmp_path, "tiny-gemma3-vision", model_dir)
    stored = build_model(load_store_model("tiny-gemma3-vision", tmp_path))
    assert isinstance(stored, Gemma3Multimodal)
    ids, shown = prompts(tiny_config(ARCH))["one"]
    got, _ = forward(stored, ids, [all_image_bytes()[s] for s in shown])
    assert np.abs(got - golden["logits_one"]).max() <= TOLERANCE


def test_reads_googles_and_transformers_4_weight_names(model_dir: Path, golden: dict) -> None:
    """`vision_tower.vision_model.*` (Google's checkpoints) and `model.*` (transformers 4)."""
    source = load_local_dir(model_dir)

    def respell(name: str) -> str:
        if name.startswith("vision_tower."):
            return "model.vision_tower.vision_model." + name.removeprefix("vision_tower.")
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return "model." + name

    source.weights = {respell(k): v for k, v in source.weights.items()}
    respelled = build_model(source)
    ids, shown = prompts(tiny_config(ARCH))["two"]
    got, _ = forward(respelled, ids, [all_image_bytes()[s] for s in shown])
    assert np.abs(got[-1] - golden["logits_two"][0]).max() <= TOLERANCE


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"mm_tokens_per_image": 15}, "mm_tokens_per_image 15 must be a square"),
        ({"mm_tokens_per_image": 9}, "mm_tokens_per_image 9 must be a square"),
        ({"boi_token_index": 384}, "boi_token_index is outside the vocabulary"),
        ({"image_token_index": -1}, "image_token_index must be"),
        ({"vision_config": {"image_size": 60}}, "image_size 60 is not a multiple of patch_size"),
        ({"vision_config": {"hidden_act": "relu"}}, "vision_config.hidden_act must be one of"),
        ({"vision_config": {"num_attention_heads": 3}}, "is not a multiple of num_attention"),
        ({"vision_config": {"patch_size": "8"}}, "vision_config.patch_size must be"),
        ({"vision_config": {"num_channels": 1}}, "vision_config.num_channels must be 3"),
        ({"text_config": {"num_hidden_layers": 0}}, "num_hidden_layers must be"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ],
)
def test_bad_configs_are_refused(tmp_path: Path, edit: dict, message: str) -> None:
    config = json.loads(json.dumps(tiny_config(ARCH)))
    for key, value in edit.items():
        if isinstance(value, dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    with pytest.raises(ModelLoadError, match=message):
        build_model(load_local_dir(write_tiny_model(ARCH, tmp_path, config=config)))


# --- reference tier: live transformers ----------------------------------------------------


@pytest.mark.reference
@pytest.mark.usefixtures("reference_libraries")
class TestReference:
    def test_live_goldens_match(self, model: Gemma3Multimodal, model_dir: Path, golden: dict):
        """Goldens recomputed now agree with the stored ones (and so with ours)."""
        from tests.golden.make_gemma3_vision_goldens import compute_goldens

        live = compute_goldens(model_dir)
        assert live.keys() == golden.keys()
        for key, value in live.items():
            if key.startswith(("tokens_", "generated")):
                assert np.array_equal(value, golden[key]), key
            else:
                assert np.abs(value - golden[key]).max() <= 1e-5, f"transformers drifted: {key}"

    @pytest.mark.parametrize(
        ("width", "height", "mode", "fmt"),
        [
            (1, 1, "RGB", "PNG"),
            (7, 300, "L", "PNG"),
            (640, 480, "RGB", "JPEG"),
            (63, 65, "RGBA", "WEBP"),
            (33, 47, "P", "GIF"),
            (128, 128, "LA", "PNG"),
        ],
    )
    def test_preprocess_equals_transformers_live(
        self, model: Gemma3Multimodal, width: int, height: int, mode: str, fmt: str
    ) -> None:
        from tests.golden.make_gemma3_vision_goldens import reference_pixels

        rgba = Image.open(io.BytesIO(image_bytes("live", width, height, "RGBA", "PNG")))
        image = rgba.convert(mode) if mode != "P" else rgba.convert("RGB").quantize(64)
        out = io.BytesIO()
        image.save(out, format=fmt)
        data = out.getvalue()
        expected = reference_pixels({"live": data}, 64)["live"]
        assert np.abs(model.preprocess(data) - expected).max() <= 1e-6


def test_token_ids_by_their_transformers_aliases(tmp_path: Path) -> None:
    """transformers maps image_token_id to image_token_index (and boi/eoi likewise)."""
    config = tiny_config(ARCH)
    for name in ("image", "boi", "eoi"):
        config[f"{name}_token_id"] = config.pop(f"{name}_token_index") - 10
    loaded = build_model(load_local_dir(write_tiny_model(ARCH, tmp_path, config=config)))
    assert isinstance(loaded, Gemma3Multimodal)
    ids, start, end = loaded.expansion()
    assert (loaded.image_token_id, loaded.boi_token_id, loaded.eoi_token_id) == (370, 371, 372)
    assert ids[start - 1 : end + 1] == [371, *[370] * 16, 372]


def test_tower_attention_in_query_blocks_is_the_same(
    model: Gemma3Multimodal, monkeypatch: pytest.MonkeyPatch
) -> None:
    pixels = mx.array(model.preprocess(all_image_bytes()["large"]))[None]
    whole = np.array(model.encode_image(pixels))
    monkeypatch.setattr(vision, "QUERY_BLOCK", 10)  # 64 patches: 7 blocks
    blocked = np.array(model.encode_image(pixels))
    assert np.abs(blocked - whole).max() <= 1e-6


def test_an_image_token_id_outside_the_vocabulary(tmp_path: Path, golden: dict) -> None:
    """transformers embeds such an id as id 0 before the features replace it: the logits are
    those of the same weights with an id inside the vocabulary."""
    config = tiny_config(ARCH)
    config["image_token_index"] = 400
    loaded = build_model(load_local_dir(write_tiny_model(ARCH, tmp_path, config=config)))
    assert isinstance(loaded, Gemma3Multimodal)
    ids, shown = prompts(tiny_config(ARCH))["one"]
    ids = [400 if t == 380 else t for t in ids]
    got, _ = forward(loaded, ids, [all_image_bytes()[s] for s in shown])
    assert np.abs(got - golden["logits_one"]).max() <= TOLERANCE


# --- through the runner: tags, chunk planning and the prefix cache (runner/media) ------------


@pytest.fixture(scope="module")
def served(engine, model_dir: Path):
    """The tiny model served with prefill chunks of 5 tokens: every image (16 soft tokens)
    needs the planner to keep it whole."""
    from runner.backend import Backend
    from runner.service import Runner

    backend = Backend.cpu().replace(prefill_chunk_tokens=5)
    return Runner.load(engine, str(model_dir), backend=backend)


def score_body(prompt: str, images: dict[int, bytes]) -> bytes:
    import base64

    media = [{"data": base64.b64encode(b).decode(), "id": i} for i, b in images.items()]
    rows = [{"prompt": prompt, "candidates": [" Yes", " No"]}]
    return json.dumps({"rows": rows, "max_tokens": 512, "media": media}).encode()


def test_scores_through_the_runner_equal_the_one_shot_forward_and_restore_the_image(
    served, engine
) -> None:
    from runner.protocol.wire import decode_score_request
    from runner.server.endpoints import ScoreEndpoint

    images = all_image_bytes()
    endpoint = ScoreEndpoint(served)
    body = score_body(
        "Is the sky[img-4] blue? Is it[img-2]", {4: images["wide"], 2: images["tall"]}
    )
    plan = endpoint.prepare(decode_score_request(body))
    (row,) = plan.rows
    assert row.prompt is not None and len(row.prompt.items) == 2

    def expected(job):
        logits, _ = forward(served.model, row.prompt.tokens, [images["wide"], images["tall"]])
        return logits[-1, row.candidates]

    want = engine.call(expected)
    answer = endpoint(decode_score_request(body))
    assert answer.input_tokens == len(row.prompt.tokens)
    assert np.abs(np.array(answer.logits[0]) - want).max() <= TOLERANCE
    # the same images with another question: restored past both expansions, same logits
    again = score_body(
        "Is the sky[img-4] blue? Is it[img-2] No", {4: images["wide"], 2: images["tall"]}
    )
    answer = endpoint(decode_score_request(again))
    assert answer.cached_tokens >= row.prompt.items[-1].end
    plan = endpoint.prepare(decode_score_request(again))
    (other,) = plan.rows
    assert other.prompt is not None

    def cold(job):
        logits, _ = forward(served.model, other.prompt.tokens, [images["wide"], images["tall"]])
        return logits[-1, other.candidates]

    assert np.abs(np.array(answer.logits[0]) - engine.call(cold)).max() <= TOLERANCE


def test_greedy_completion_after_an_image_equals_the_forward(served, engine) -> None:
    import base64

    from runner.protocol.wire import decode_completion_request
    from runner.server.endpoints import CompletionEndpoint

    images = all_image_bytes()
    body = {
        "Prompt": "Describe[img-0]",
        "Media": [{"data": base64.b64encode(images["alpha"]).decode(), "id": 0}],
        "Options": {"num_predict": 5},
    }
    endpoint = CompletionEndpoint(served)
    plan = endpoint.prepare(decode_completion_request(json.dumps(body).encode()))
    tokens = plan.prompt.tokens

    def expected(job):
        logits, caches = forward(served.model, tokens, [images["alpha"]])
        out = [int(np.argmax(logits[-1]))]
        while len(out) < 5:
            step = mx.array([[out[-1]]], dtype=mx.int32)
            out.append(
                int(mx.argmax(served.model.unembed(served.model.hidden(step, caches))[0, -1]))
            )
        return out

    want = engine.call(expected)
    if EOS_ID in want:
        want = want[: want.index(EOS_ID)]

    def generated(job):
        return [s.token for s in served.generator.steps(plan.prompt, plan.options, job)]

    assert engine.call(generated) == want


# --- preprocessor_config.json -------------------------------------------------------------------

CUSTOM_PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor",
    "processor_class": "Gemma3Processor",
    "size": {"height": 64, "width": 64},
    "resample": 0,  # nearest, where the class default is bilinear
    "rescale_factor": 1 / 255,
    "image_mean": [0.25, 0.5, 0.75],
    "image_std": [0.5, 0.25, 2.0],
    "do_pan_and_scan": None,
}


def with_preprocessor(tmp_path: Path, preprocessor: dict) -> Path:
    path = write_tiny_model(ARCH, tmp_path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path


def test_preprocessor_config_decides_filter_mean_and_std(tmp_path: Path) -> None:
    model = build_model(load_local_dir(with_preprocessor(tmp_path, CUSTOM_PREPROCESSOR)))
    data = all_image_bytes()["wide"]
    got = model.preprocess(data)
    image = decode_image(data).convert("RGB").resize((64, 64), resample=Image.Resampling.NEAREST)
    chw = np.asarray(image).transpose(2, 0, 1).astype(np.float64) / 255
    mean = np.array([0.25, 0.5, 0.75])[:, None, None]
    std = np.array([0.5, 0.25, 2.0])[:, None, None]
    assert np.abs(got - (chw - mean) / std).max() <= 1e-6
    default = build_model(load_local_dir(write_tiny_model(ARCH, tmp_path / "plain")))
    assert np.abs(default.preprocess(data) - got).max() > 0.1  # the file changed the pixels


def test_preprocessor_config_read_from_an_ollama_store(tmp_path: Path) -> None:
    path = with_preprocessor(tmp_path / "hf", CUSTOM_PREPROCESSOR)
    write_ollama_model(tmp_path / "models", "tiny-vision-pp", path)
    from_store = build_model(load_store_model("tiny-vision-pp", tmp_path / "models"))
    from_dir = build_model(load_local_dir(path))
    data = all_image_bytes()["tall"]
    assert np.array_equal(from_store.preprocess(data), from_dir.preprocess(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"size": {"height": 32, "width": 32}}, "is not the vision tower's 64 x 64"),
        ({"do_pan_and_scan": True}, "pan-and-scan"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"resample": 99}, "resample 99 is not a PIL filter"),
    ],
)
def test_bad_preprocessor_configs_are_refused(tmp_path: Path, edit: dict, message: str) -> None:
    path = with_preprocessor(tmp_path, CUSTOM_PREPROCESSOR | edit)
    with pytest.raises(ModelLoadError, match=message):
        build_model(load_local_dir(path))


@pytest.mark.reference
@pytest.mark.usefixtures("reference_libraries")
def test_preprocessor_config_pixels_equal_transformers(tmp_path: Path) -> None:
    import transformers

    path = with_preprocessor(tmp_path, CUSTOM_PREPROCESSOR)
    model = build_model(load_local_dir(path))
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    for name, data in all_image_bytes().items():
        expected = processor(images=[decode_image(data)], return_tensors="np")["pixel_values"][0]
        assert np.abs(model.preprocess(data) - expected).max() <= 1e-6, name
