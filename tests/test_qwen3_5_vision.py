"""Qwen3.5's image side vs transformers, on tiny random models of both text families.

Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration share one image side
(runner/models/qwen3_5_vision/); the tests marked `every_arch` run on both (`ARCHES`), the
others on the dense model, whose text model does not change what they test. The MoE model's
text model is tests/golden's Qwen3.5-MoE (gated-delta and full-attention layers, 4 experts,
top-2, a shared expert), its tower the dense model's. Default tier, against
tests/data/golden/qwen3_5_vision.npz and qwen3_5_moe_vision.npz (written by
tests/golden/make_qwen3_5_vision_goldens.py, the same prompts for both: their token ids are
checked against each golden's, so the two tiny configs' image token ids must agree):
- `preprocess` equals transformers' Qwen2-VL image processor (patches and grid) on images of
  several sizes and aspect ratios (grown to min_pixels, shrunk to max_pixels, with
  transparency, a JPEG), with the model's preprocessor_config.json;
- an image's expansion is Qwen3VLProcessor's, one causal item; the position layout is
  `get_rope_index`'s;
- logits equal transformers' (float32, <= 1e-4) for prompts with one and with two images of
  different sizes and for text only, one-shot and in chunks that cut inside the images;
- greedy generation after an image equals transformers' token for token (decode positions
  continue at index + delta);
- through the runner (prefill chunks of 5, inside every image): scores and a completion
  equal the in-process forward, the same image again restores past its expansion with the
  cold logits, other bytes diverge at the expansion, rows that share an image are batched
  over it; and over HTTP;
- the model read from an Ollama store gives the same logits.
`-m reference` recomputes the goldens live with transformers, on more image shapes, and
compares the layout with transformers' `get_rope_index`. The dense model's text rows
through the runner's caches are the shared cache tests' (tests/test_prefix_cache_models.py,
tests/test_generate_cache.py, parametrized over tests/tiny.py's IMAGE_TEXT_ARCHITECTURES).
"""

from __future__ import annotations

import base64
import functools
import io
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from runner.media.prepare import Item
from runner.models import ImageModel, build_model
from runner.models.qwen3_5_moe import Qwen3_5MoeMultimodal
from runner.models.qwen3_5_vision import (
    MropeLayout,
    Qwen3_5ImageModel,
    Qwen3_5Multimodal,
    mrope_layout,
)
from runner.sources.loader import load_local_dir
from runner.sources.source import ModelLoadError
from tests.golden.make_gemma3_vision_goldens import image_bytes
from tests.golden.make_qwen3_5_vision_goldens import (
    ARCH,
    EOS_ID,
    FAMILIES,
    MOE_ARCH,
    PREPROCESSOR,
    all_image_bytes,
    prompts,
    write_model,
)
from tests.tiny import tiny_config

TOLERANCE = 1e-4
IMAGE, START, END = 380, 381, 382


# The text families over the one image side, and each one's adapter class.
ARCHES = {ARCH: Qwen3_5Multimodal, MOE_ARCH: Qwen3_5MoeMultimodal}
every_arch = pytest.mark.parametrize("arch", list(ARCHES))


class TinyFamily:
    """One architecture's tiny image model, each part made on first use and kept for the
    module: its directory, the loaded model, its goldens, and the runner serving it."""

    def __init__(self, arch: str, root: Path, engine: Any):
        self.arch, self.root, self.engine = arch, root, engine

    @functools.cached_property
    def model_dir(self) -> Path:
        return write_model(self.root, self.arch)

    @functools.cached_property
    def model(self) -> Qwen3_5ImageModel:
        loaded = build_model(load_local_dir(self.model_dir))
        assert isinstance(loaded, ARCHES[self.arch]) and isinstance(loaded, ImageModel)
        return loaded

    @functools.cached_property
    def golden(self) -> dict[str, np.ndarray]:
        with np.load(FAMILIES[self.arch].golden) as data:
            return dict(data)

    @functools.cached_property
    def served(self) -> Any:
        """The model served with prefill chunks of 5 tokens: chunks end inside images."""
        from runner.backend import Backend
        from runner.service import Runner

        backend = Backend.cpu().replace(prefill_chunk_tokens=5)
        return Runner.load(self.engine, str(self.model_dir), backend=backend)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory, engine) -> dict[str, TinyFamily]:
    return {arch: TinyFamily(arch, tmp_path_factory.mktemp(arch), engine) for arch in ARCHES}


@pytest.fixture
def tiny(families: dict[str, TinyFamily], arch: str) -> TinyFamily:
    """The family of the test's `arch` (a test marked `every_arch`)."""
    return families[arch]


# The dense model, for the tests of what does not depend on the text model.


@pytest.fixture(scope="module")
def model_dir(families: dict[str, TinyFamily]) -> Path:
    return families[ARCH].model_dir


@pytest.fixture(scope="module")
def model(families: dict[str, TinyFamily]) -> Qwen3_5ImageModel:
    return families[ARCH].model


@pytest.fixture(scope="module")
def golden(families: dict[str, TinyFamily]) -> dict[str, np.ndarray]:
    return families[ARCH].golden


def grids(golden: dict) -> dict[str, tuple[int, int, int]]:
    names = [k.removeprefix("grid_") for k in golden if k.startswith("grid_")]
    return {n: tuple(int(g) for g in golden[f"grid_{n}"]) for n in names}  # type: ignore[misc]


def golden_prompt(golden: dict, name: str) -> tuple[list[int], list[bytes]]:
    ids, shown = prompts(tiny_config(ARCH), grids(golden))[name]
    assert ids == golden[f"tokens_{name}"].tolist()
    images = all_image_bytes()
    return ids, [images[s] for s in shown]


def items_of(model: Qwen3_5ImageModel, ids: list[int], images: list[bytes]) -> list[Item]:
    """The runs of image pads in `ids`, one item per image (in order)."""
    items, i = [], 0
    while i < len(ids):
        if ids[i] != IMAGE:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == IMAGE:
            j += 1
        pixels, grid = model.preprocess(images[len(items)])
        items.append(Item(i, j, pixels, True, 0, len(items), grid))
        i = j
    assert len(items) == len(images)
    return items


def forward(
    model: Qwen3_5ImageModel,
    ids: list[int],
    images: list[bytes],
    plan: list[tuple[int, int]] | None = None,
    caches: list[Any] | None = None,
) -> tuple[np.ndarray, list[Any], MropeLayout | None]:
    """Logits at every position through `plan`'s chunks (default one shot), each chunk given
    the rows of the images it overlaps and the prompt's layout."""
    items = items_of(model, ids, images)
    layout = model.position_layout(ids, items)
    features = [model.encode_item(item) for item in items]
    caches = model.make_caches() if caches is None else caches
    out = []
    for start, end in plan or [(0, len(ids))]:
        media = []
        for item, rows in zip(items, features, strict=True):
            first, last = max(item.start, start), min(item.end, end)
            if first < last:
                media.append((first - start, rows[first - item.start : last - item.start]))
        tokens = mx.array(ids[start:end], dtype=mx.int32)[None]
        if layout is None:
            hidden = model.hidden(tokens, caches)
        else:
            hidden = model.hidden(tokens, caches, media or None, layout=layout)
        out.append(model.unembed(hidden)[0])
    return np.array(mx.concatenate(out).astype(mx.float32)), caches, layout


def greedy(model: Qwen3_5ImageModel, logits: np.ndarray, caches: list[Any], layout, n: int):
    """n greedy tokens after a prefilled prompt whose last logits are `logits`."""
    out = [int(np.argmax(logits))]
    while len(out) < n:
        token = mx.array([[out[-1]]], dtype=mx.int32)
        hidden = model.hidden(token, caches, None, layout=layout)
        out.append(int(mx.argmax(model.unembed(hidden)[0, -1])))
    return out


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, n)) for s in range(0, n, size)]


# --- preprocessing and the expansion ------------------------------------------------------


def test_preprocess_equals_transformers(model: Qwen3_5Multimodal, golden: dict) -> None:
    seen = set()
    for name, data in all_image_bytes().items():
        pixels, grid = model.preprocess(data)
        assert grid == grids(golden)[name], name
        assert pixels.dtype == np.float32 and pixels.shape == golden[f"pixels_{name}"].shape
        assert np.abs(pixels - golden[f"pixels_{name}"]).max() <= 1e-6, name
        seen.add(grid[1:])
    assert len(seen) >= 5  # grown, shrunk, wide, tall: several grids


def test_preprocess_refuses_bad_bytes(model: Qwen3_5Multimodal) -> None:
    with pytest.raises(ValueError, match=r"^invalid image data: "):
        model.preprocess(b"GIF89a broken")
    thin = image_bytes("thin", 1, 300, "RGB", "PNG")
    with pytest.raises(ValueError, match=r"^invalid image data: aspect ratio 300"):
        model.preprocess(thin)


def test_expansion_is_the_processors_and_one_causal_item(model: Qwen3_5Multimodal) -> None:
    expansion = model.prepare_image(all_image_bytes()["wide"])
    assert expansion.tokens == [START, *[IMAGE] * 12, END]  # grid 4 x 12 -> 2 x 6 tokens
    (item,) = expansion.items
    assert (item.start, item.end, item.causal, item.opaque) == (1, 13, True, (1, 4, 12))
    assert item.pixels.shape == (48, 3 * 2 * 8 * 8)


def test_layout_is_get_rope_index() -> None:
    """Text advances all three channels; an image of 2 x 3 merged tokens takes (s, s + row,
    s + column); the text after it continues at s + max(2, 3); past the prompt, index +
    delta."""
    layout = mrope_layout(10, [(2, 8, (1, 4, 6))], merge=2)
    assert layout.table.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]
    assert layout.delta == 7 - 10
    assert layout.positions(8, 4).tolist() == [[5, 6, 7, 8]] * 3
    two = mrope_layout(9, [(1, 3, (1, 2, 4)), (4, 8, (1, 4, 4))], merge=2)
    assert two.table[:, :4].tolist() == [[0, 1, 1, 3], [0, 1, 1, 3], [0, 1, 2, 3]]
    assert two.table[:, 8].tolist() == [6, 6, 6] and two.delta == -2


# --- logits and generation against transformers ---------------------------------------------


@every_arch
@pytest.mark.parametrize("name", ["one", "two", "text"])
def test_logits_equal_transformers_one_shot(tiny: TinyFamily, name: str) -> None:
    model, golden = tiny.model, tiny.golden
    ids, images = golden_prompt(golden, name)
    got, _, layout = forward(model, ids, images)
    assert (layout is None) == (name == "text")
    expected = golden[f"logits_{name}"]
    diff = np.abs(got[-len(expected) :] - expected).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g}"


@every_arch
@pytest.mark.parametrize("name", ["one", "two"])
@pytest.mark.parametrize("size", [1, 5, 7])
def test_logits_equal_transformers_in_chunks_that_cut_images(
    tiny: TinyFamily, name: str, size: int
) -> None:
    model, golden = tiny.model, tiny.golden
    ids, images = golden_prompt(golden, name)
    plan = chunks(len(ids), size)
    items = items_of(model, ids, images)
    assert any(i.start < end < i.end for i in items for _, end in plan)  # a cut inside
    got, _, _ = forward(model, ids, images, plan)
    expected = golden[f"logits_{name}"]
    diff = np.abs(got[-len(expected) :] - expected).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g} with chunks of {size}"


@every_arch
def test_positions_and_pixels_both_matter(tiny: TinyFamily) -> None:
    """Without the layout (positions = indices) or with other pixels of the same geometry, the
    logits after the image move: the tests above would catch either being dropped."""
    model, golden = tiny.model, tiny.golden
    ids, images = golden_prompt(golden, "one")
    (item,) = items_of(model, ids, images)
    features = model.encode_item(item)
    expected = golden["logits_one"]
    plain = model.hidden(mx.array([ids]), model.make_caches(), [(item.start, features)])
    plain_logits = np.array(model.unembed(plain)[0])
    assert np.abs(plain_logits[: item.start] - expected[: item.start]).max() <= TOLERANCE
    assert np.abs(plain_logits[-1] - expected[-1]).max() > 1e-3
    pixels, grid = model.preprocess(all_image_bytes()["large"])
    assert grid[1] * grid[2] == item.opaque[1] * item.opaque[2]  # 12 tokens too
    other = Item(item.start, item.end, pixels, True, 0, 0, grid)
    layout = model.position_layout(ids, [other])
    hidden = model.hidden(
        mx.array([ids]), model.make_caches(), [(item.start, model.encode_item(other))], layout
    )
    assert np.abs(np.array(model.unembed(hidden)[0, -1]) - expected[-1]).max() > 1e-3


@every_arch
def test_greedy_generation_equals_transformers(tiny: TinyFamily) -> None:
    model, golden = tiny.model, tiny.golden
    ids, images = golden_prompt(golden, "one")
    logits, caches, layout = forward(model, ids, images, chunks(len(ids), 7))
    expected = golden["generated"].tolist()
    assert len(expected) >= 3
    assert greedy(model, logits[-1], caches, layout, len(expected)) == expected
    # a decode step without the layout (at its index, not index + delta) is another step
    _, with_layout, _ = forward(model, ids, images)
    _, without, _ = forward(model, ids, images)
    token = mx.array([[expected[0]]], dtype=mx.int32)
    right = model.unembed(model.hidden(token, with_layout, None, layout=layout))
    wrong = model.unembed(model.hidden(token, without))
    assert np.abs(np.array(right) - np.array(wrong)).max() > 1e-3


def test_tower_attention_in_query_blocks_is_the_same(
    model: Qwen3_5Multimodal, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runner.models.qwen3_5_vision import vision

    pixels, grid = model.preprocess(all_image_bytes()["square"])  # 64 patches
    whole = np.array(model.encode_image(mx.array(pixels), grid))
    monkeypatch.setattr(vision, "QUERY_BLOCK", 10)  # 7 blocks
    blocked = np.array(model.encode_image(mx.array(pixels), grid))
    assert np.abs(blocked - whole).max() <= 1e-6


def test_media_that_does_not_fit_the_block_is_refused(model: Qwen3_5Multimodal) -> None:
    tokens = mx.zeros((1, 4), dtype=mx.int32)
    with pytest.raises(ValueError, match="does not fit"):
        model.hidden(tokens, model.make_caches(), [(2, mx.zeros((3, 64)))])
    with pytest.raises(ValueError, match="are not one image's"):
        model.encode_image(mx.zeros((10, 384)), (1, 4, 4))


# --- loading ------------------------------------------------------------------------------


@every_arch
def test_loads_from_an_ollama_store(tiny: TinyFamily, tmp_path: Path) -> None:
    """The store's layers (weights, config, preprocessor_config.json) give the same model."""
    from runner.sources.ollama_store import load_store_model
    from tests.ollama_store import write_ollama_model

    model_dir, golden = tiny.model_dir, tiny.golden

    write_ollama_model(tmp_path, "tiny-qwen3_5-vision", model_dir)
    stored = build_model(load_store_model("tiny-qwen3_5-vision", tmp_path))
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    assert isinstance(stored, Qwen3_5ImageModel) and stored.architecture == arch
    ids, images = golden_prompt(golden, "two")
    got, _, _ = forward(stored, ids, images)
    assert np.abs(got[-len(golden["logits_two"]) :] - golden["logits_two"]).max() <= TOLERANCE


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"vision_config": {"out_hidden_size": 32}}, "out_hidden_size 32 is not the text"),
        ({"vision_config": {"num_position_embeddings": 15}}, "15 is not a square"),
        ({"vision_config": {"hidden_act": "relu"}}, "vision_config.hidden_act must be one of"),
        ({"vision_config": {"num_heads": 3}}, "is not a multiple of 4 x num_heads"),
        ({"vision_config": {"in_channels": 1}}, "in_channels must be 3"),
        ({"vision_config": {"depth": 0}}, "vision_config.depth must be"),
        ({"image_token_id": 384}, "image_token_id is outside the vocabulary"),
        ({"vision_end_token_id": -1}, "vision_end_token_id must be"),
        ({"text_config": {"rope_parameters": {"mrope_section": [2, 1]}}}, "mrope_section"),
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
        build_model(load_local_dir(write_model(tmp_path, config=config)))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"patch_size": 16}, "patch_size 16 is not the vision tower's 8"),
        ({"merge_size": 1}, "merge_size 1 is not the vision tower's 2"),
        ({"size": {"shortest_edge": 4096, "longest_edge": 1024}}, "max_pixels 1024 is below"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
        ({"resample": 99}, "resample 99 is not a PIL filter"),
    ],
)
def test_bad_preprocessor_configs_are_refused(tmp_path: Path, edit: dict, message: str) -> None:
    path = write_model(tmp_path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR | edit))
    with pytest.raises(ModelLoadError, match=message):
        build_model(load_local_dir(path))


def test_preprocessor_config_decides_the_sizes(tmp_path: Path, model: Qwen3_5Multimodal) -> None:
    """Without preprocessor_config.json, transformers' class defaults (56 x 56 to 1280 x 28
    x 28 pixels, CLIP's mean and std); the file's limits and normalisation win."""
    path = write_model(tmp_path)
    (path / "preprocessor_config.json").unlink()
    default = build_model(load_local_dir(path))
    pixels, grid = default.preprocess(all_image_bytes()["large"])
    assert grid == (1, 28, 38)  # 301 x 223 kept near its size: 304 x 224 pixels
    assert pixels.shape == (28 * 38, 384)
    assert np.allclose(
        default.preprocessor.pixels.mean.ravel(), [0.48145466, 0.4578275, 0.40821073]
    )
    assert model.preprocess(all_image_bytes()["large"])[1] == (1, 6, 8)


# --- through the runner: chunks, the prefix cache, batched rows, HTTP ------------------------


@pytest.fixture(scope="module")
def served(families: dict[str, TinyFamily]):
    """The dense model served with prefill chunks of 5 tokens: chunks end inside images."""
    return families[ARCH].served


def media(images: dict[int, bytes]) -> list[dict]:
    return [{"data": base64.b64encode(b).decode(), "id": i} for i, b in images.items()]


def score_body(rows: list[str], images: dict[int, bytes]) -> bytes:
    body = {
        "rows": [{"prompt": p, "candidates": [" Yes", " No"]} for p in rows],
        "max_tokens": 512,
        "media": media(images),
    }
    return json.dumps(body).encode()


def expected_scores(served, engine, plan, images_of_rows) -> list[np.ndarray]:
    """Each row's candidate logits from one cold one-shot forward."""

    def work(job):
        out = []
        for row, images in zip(plan.rows, images_of_rows, strict=True):
            tokens = row.prompt.tokens if row.prompt is not None else row.tokens
            logits, _, _ = forward(served.model, tokens, images)
            out.append(logits[-1, row.candidates])
        return out

    return engine.call(work)


@every_arch
def test_scores_restore_the_same_image_and_diverge_at_other_bytes(tiny: TinyFamily, engine) -> None:
    from runner.protocol.wire import decode_score_request
    from runner.server.endpoints import ScoreEndpoint

    served = tiny.served

    images = all_image_bytes()
    endpoint = ScoreEndpoint(served)
    body = score_body(
        ["Is the sky[img-4] blue? Is it[img-2]"], {4: images["wide"], 2: images["tall"]}
    )
    plan = endpoint.prepare(decode_score_request(body))
    (row,) = plan.rows
    assert row.prompt is not None and len(row.prompt.items) == 2
    assert all(i.causal for i in row.prompt.items)
    (want,) = expected_scores(served, engine, plan, [[images["wide"], images["tall"]]])
    answer = endpoint(decode_score_request(body))
    assert answer.input_tokens == len(row.prompt.tokens)
    assert np.abs(np.array(answer.logits[0]) - want).max() <= TOLERANCE
    # the same images, another question: restored past both expansions, the cold logits
    again = score_body(
        ["Is the sky[img-4] blue? Is it[img-2] No"], {4: images["wide"], 2: images["tall"]}
    )
    plan = endpoint.prepare(decode_score_request(again))
    answer = endpoint(decode_score_request(again))
    assert answer.cached_tokens >= row.prompt.items[-1].end
    (want,) = expected_scores(served, engine, plan, [[images["wide"], images["tall"]]])
    assert np.abs(np.array(answer.logits[0]) - want).max() <= TOLERANCE
    # other bytes for the second image: the cache stops at its expansion
    other = score_body(
        ["Is the sky[img-4] blue? Is it[img-2] No"], {4: images["wide"], 2: images["square"]}
    )
    plan = endpoint.prepare(decode_score_request(other))
    answer = endpoint(decode_score_request(other))
    (other_row,) = plan.rows
    assert other_row.prompt is not None
    second = other_row.prompt.items[1]
    # (at most: the recurrent layers' states are whole-prefix snapshots, restorable only
    # where a node ends, so the restore may fall back further)
    assert answer.cached_tokens <= second.start
    (want,) = expected_scores(served, engine, plan, [[images["wide"], images["square"]]])
    assert np.abs(np.array(answer.logits[0]) - want).max() <= TOLERANCE
    answer = endpoint(decode_score_request(other))  # now those bytes are stored too
    assert answer.cached_tokens >= second.end
    assert np.abs(np.array(answer.logits[0]) - want).max() <= TOLERANCE


@every_arch
def test_rows_sharing_an_image_are_batched_over_it_and_equal_rows_alone(
    tiny: TinyFamily, engine, monkeypatch
) -> None:
    """Rows whose images lie in their shared prefix run as one batch over it: the prefix's
    layout gives every row's positions (index + the same delta past the images)."""
    from runner.cache import live
    from runner.cache.batch import forward_suffixes
    from runner.protocol.wire import decode_score_request
    from runner.server.endpoints import ScoreEndpoint

    served = tiny.served

    images = all_image_bytes()
    rows = ["Look:[img-1] Is it blue?", "Look:[img-1] Is it a dog or a cat?", "Look:[img-1]"]
    body = score_body(rows, {1: images["alpha"]})
    endpoint = ScoreEndpoint(served)
    plan = endpoint.prepare(decode_score_request(body))
    assert served.scorer.batches
    want = expected_scores(served, engine, plan, [[images["alpha"]]] * 3)
    batches = []

    def recording(model, caches, suffixes, layout=None):
        batches.append((len(suffixes), layout))
        return forward_suffixes(model, caches, suffixes, layout)

    monkeypatch.setattr(live, "forward_suffixes", recording)  # the live state's batched forward
    answer = endpoint(decode_score_request(body))
    assert batches and batches[0][0] == 2  # the two rows longer than the shared prefix
    assert batches[0][1] is not None
    for got, expected in zip(answer.logits, want, strict=True):
        assert np.abs(np.array(got) - expected).max() <= TOLERANCE


def test_rows_with_their_own_images_each_get_their_own_layout(served, engine) -> None:
    """Rows whose images differ (and so their positions after them) are computed one by
    one, each with its prompt's layout."""
    from runner.protocol.wire import decode_score_request
    from runner.server.endpoints import ScoreEndpoint

    images = all_image_bytes()
    rows = ["Look:[img-1] Is it blue?", "Look:[img-2] Is it blue?"]
    body = score_body(rows, {1: images["wide"], 2: images["tall"]})
    endpoint = ScoreEndpoint(served)
    plan = endpoint.prepare(decode_score_request(body))
    deltas = [row.prompt.layout.delta for row in plan.rows]
    assert deltas[0] != deltas[1]  # 2 x 6 and 5 x 2 merged grids
    want = expected_scores(served, engine, plan, [[images["wide"]], [images["tall"]]])
    answer = endpoint(decode_score_request(body))
    for got, expected in zip(answer.logits, want, strict=True):
        assert np.abs(np.array(got) - expected).max() <= TOLERANCE


def completion_body(prompt: str, images: dict[int, bytes], n: int) -> dict:
    return {
        "Prompt": prompt,
        "Media": media(images),
        "Options": {"num_predict": n, "temperature": 0},
        "Logprobs": True,
    }


def expected_completion(served, engine, plan, images: list[bytes], n: int) -> list[int]:
    def work(job):
        tokens = plan.prompt.tokens
        logits, caches, layout = forward(served.model, tokens, images)
        return greedy(served.model, logits[-1], caches, layout, n)

    want = engine.call(work)
    return want[: want.index(EOS_ID)] if EOS_ID in want else want


@every_arch
def test_greedy_completion_after_an_image_equals_the_forward_and_restores_it(
    tiny: TinyFamily, engine
) -> None:
    from runner.protocol.wire import decode_completion_request
    from runner.server.endpoints import CompletionEndpoint

    served = tiny.served

    images = all_image_bytes()
    body = completion_body("Describe[img-0] please", {0: images["small"]}, 6)
    endpoint = CompletionEndpoint(served)
    plan = endpoint.prepare(decode_completion_request(json.dumps(body).encode()))
    assert plan.prompt.layout is not None and plan.prompt.layout.delta != 0
    want = expected_completion(served, engine, plan, [images["small"]], 6)

    def generated(job):
        return [s.token for s in served.generator.steps(plan.prompt, plan.options, job)]

    assert engine.call(generated) == want
    assert engine.call(generated) == want  # restored from the cache this time
    # read on the engine: after the job's deferred store (its after-job hook) has settled
    # the last decode steps into the live state
    live = engine.call(lambda job: list(served.generator.cache.live.tokens))
    assert live[: len(plan.prompt.keys)] == plan.prompt.keys


@every_arch
async def test_over_http_a_completion_and_scores_give_the_in_process_numbers(
    tiny: TinyFamily, engine, make_client
) -> None:
    from runner.generate.detokenize import go_string
    from runner.protocol.wire import decode_completion_request, decode_score_request
    from runner.server.endpoints import CompletionEndpoint, ScoreEndpoint

    served = tiny.served

    images = all_image_bytes()
    client = await make_client(served)
    body = completion_body("What is in[img-3]?", {3: images["tall"]}, 5)
    plan = CompletionEndpoint(served).prepare(decode_completion_request(json.dumps(body).encode()))
    want = expected_completion(served, engine, plan, [images["tall"]], 5)
    response = await client.post("/v1/completions", data=json.dumps(body))
    assert response.status == 200, await response.text()
    lines = [json.loads(line) for line in (await response.read()).splitlines()]
    tokens = [lp["token"] for line in lines for lp in (line.get("Logprobs") or [])]
    texts = [go_string(served.tokenizer.token_bytes(t)) for t in want]
    assert tokens == texts[: len(tokens)] and not "".join(texts[len(tokens) :])
    assert lines[-1]["Done"] and lines[-1]["EvalCount"] == len(want)
    assert lines[-1]["PromptEvalCount"] == len(plan.prompt.tokens)

    rows = ["[img-3] Is it blue?", "[img-3] Is it green?"]
    body_bytes = score_body(rows, {3: images["tall"]})
    plan = ScoreEndpoint(served).prepare(decode_score_request(body_bytes))
    want_scores = expected_scores(served, engine, plan, [[images["tall"]]] * 2)
    response = await client.post("/v1/score", data=body_bytes)
    assert response.status == 200, await response.text()
    answer = await response.json()
    for got, expected in zip(answer["logits"], want_scores, strict=True):
        assert np.abs(np.array(got) - expected).max() <= TOLERANCE


# --- reference tier: live transformers ----------------------------------------------------


@pytest.mark.reference
@pytest.mark.usefixtures("reference_libraries")
class TestReference:
    @every_arch
    def test_live_goldens_match(self, tiny: TinyFamily) -> None:
        """Goldens recomputed now agree with the stored ones (and so with ours)."""
        from tests.golden.make_qwen3_5_vision_goldens import compute_goldens

        golden = tiny.golden
        live = compute_goldens(tiny.model_dir)
        assert live.keys() == golden.keys()
        for key, value in live.items():
            if key.startswith(("tokens_", "generated", "grid_")):
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
            (128, 40, "LA", "PNG"),
        ],
    )
    def test_preprocess_equals_transformers_live(
        self, model: Qwen3_5Multimodal, width: int, height: int, mode: str, fmt: str
    ) -> None:
        from tests.golden.make_qwen3_5_vision_goldens import reference_pixels

        rgba = Image.open(io.BytesIO(image_bytes("live", width, height, "RGBA", "PNG")))
        image = rgba.convert(mode) if mode != "P" else rgba.convert("RGB").quantize(64)
        out = io.BytesIO()
        image.save(out, format=fmt)
        expected, grid = reference_pixels({"live": out.getvalue()})["live"]
        pixels, got_grid = model.preprocess(out.getvalue())
        assert got_grid == grid
        assert np.abs(pixels - expected).max() <= 1e-6

    @every_arch
    def test_layout_equals_get_rope_index(self, tiny: TinyFamily) -> None:
        import torch

        from tests.golden.make_qwen3_5_vision_goldens import reference_model

        model = tiny.model
        reference = reference_model(tiny.model_dir)
        images = all_image_bytes()
        ids = [5, 6, START]
        shown = ["wide", "small", "tall"]
        for name in shown:
            _, grid = model.preprocess(images[name])
            ids += [*[IMAGE] * (grid[1] * grid[2] // 4), END, 7, START]
        ids = ids[:-1]
        items = items_of(model, ids, [images[s] for s in shown])
        layout = model.position_layout(ids, items)
        input_ids = torch.tensor([ids])
        positions, delta = reference.model.get_rope_index(
            input_ids,
            mm_token_type_ids=(input_ids == IMAGE).int(),
            image_grid_thw=torch.tensor([i.opaque for i in items]),
        )
        assert layout is not None
        assert np.array_equal(positions[:, 0].numpy(), layout.table)
        assert int(delta[0, 0]) == layout.delta
