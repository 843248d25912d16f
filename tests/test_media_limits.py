"""Images under hostile input (docs/PROTOCOL.md §7, "Limits"): what a request can make the
runner do before it is refused, and Go's acceptance where Pillow's is wider.

- What cannot fit is refused before any pixel is decoded: an image's tokens come from its
  header (`plan_image`), equal to what decoding gives for both families over many sizes
  (`smart_resize`'s rounding, growth and shrinking, its aspect limit; every format); a row
  over `max_tokens` and a completion over the context decode nothing; a request over its
  budget of decoded pixels or kept item bytes is refused naming it; a million tags are
  counted, not listed, and their equal text parts tokenized once.
- Decoding runs on the image pool (`IMAGE_WORKERS` threads, whatever the callers), one
  image at a time per request, the request's cancellation checked before each: a client
  that leaves stops it within one image, over HTTP too; a large image hands its memory back.
- Transparency is composited without `Image.alpha_composite` (it holds the GIL), to the
  same pixels for all 65,536 (value, alpha) pairs and every transparent mode.
- A JPEG or PNG whose data is too short for the image it declares is refused from its
  header, as Go's decoders refuse it (libjpeg fills the missing blocks with grey), as are
  JPEG codings Go does not decode; valid files of every kind are not (the bounds are
  tight: maximally compressed files sit at them).
- Tags take ASCII digits only; error texts hold no object address, name the unsupported
  format and the pixel limit actually applied.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import threading
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from bench.fuzz.media import alpha_png, declared_jpeg, pixel_bomb_png
from runner.media import images as images_module
from runner.media import pool
from runner.media import prepare as prepare_module
from runner.media.images import MAX_IMAGE_PIXELS, check_jpeg, decode_image, read_header
from runner.media.pixels import to_rgb
from runner.media.prepare import RequestImages, plan_prompt, split_prompt
from runner.protocol.errors import BadRequest, Cancelled
from runner.protocol.wire import decode_completion_request, decode_score_request
from runner.score.validate import prepare_rows
from runner.server.endpoints import CompletionEndpoint, ScoreEndpoint
from runner.service import Runner
from tests.image_model import BROKEN, TinyImageModel

QWEN = "Qwen3_5ForConditionalGeneration"
GEMMA = "Gemma3ForConditionalGeneration"
QUESTION = " Is it bright? Answer:"


def image_bytes(
    width: int, height: int, fmt: str = "PNG", mode: str = "RGB", seed: int = 0, **kwargs: Any
) -> bytes:
    """A `width` x `height` image of smooth content in `mode`, written as `fmt`."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 7 + seed) % 256, (y * 5) % 256, ((x + y) * 3) % 256], -1)
    image = Image.fromarray(rgb.astype(np.uint8))
    if mode == "I;16":
        image = Image.fromarray(((x * 300 + y * 7) % 65536).astype(np.uint16))
    elif mode == "RGBA":
        image.putalpha(Image.fromarray(((x * y) % 256).astype(np.uint8)))
    elif mode != "RGB":
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def media(items: dict[int, bytes]) -> list[dict[str, Any]]:
    return [{"data": base64.b64encode(b).decode(), "id": i} for i, b in items.items()]


def score_request(prompts: list[str], max_tokens: int, items: dict[int, bytes]) -> Any:
    body = {
        "rows": [{"prompt": p, "candidates": [" Yes", " No"]} for p in prompts],
        "max_tokens": max_tokens,
        "media": media(items),
    }
    return decode_score_request(json.dumps(body).encode())


def completion_request(prompt: str, items: dict[int, bytes]) -> Any:
    body = {"Prompt": prompt, "Options": {"num_predict": 1}, "Media": media(items)}
    return decode_completion_request(json.dumps(body).encode())


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    """Every image decoded through the pool, by the pixels its header declares."""
    seen: list[int] = []
    original = prepare_module.decode_on_pool

    def counting(work, check, pixels=0):
        seen.append(pixels)
        return original(work, check, pixels)

    monkeypatch.setattr(prepare_module, "decode_on_pool", counting)
    return seen


@pytest.fixture
def tiny_images(engine, llama_loaded):
    """A fresh runner around the tiny Llama with toy images (tests/image_model.py)."""

    def make(causal: bool = False) -> Runner:
        def build(job) -> Runner:
            model = TinyImageModel(llama_loaded.model, causal=causal)
            return Runner(engine, model, llama_loaded.tokenizer, "tiny-image")

        return engine.call(build)

    return make


# --- the header says what decoding will give --------------------------------------------------

# (width, height): smart_resize's cases with factor 16 (patch 8, merge 2): exact multiples,
# one off either way, halves that Python rounds to even (24 / 16 = 1.5 -> 2, 40 / 16 = 2.5
# -> 2), grown to min_pixels, shrunk to max_pixels (1,003,520 by default), aspect ratio 200.
QWEN_SIZES = [
    (1, 1),
    (1, 200),
    (200, 1),
    (3, 5),
    (15, 17),
    (16, 16),
    (24, 40),
    (40, 24),
    (56, 72),
    (55, 57),
    (100, 7),
    (250, 250),
    (256, 255),
    (992, 992),
    (993, 1011),
    (1008, 1000),
    (1024, 1024),
    (1600, 8),
    (4000, 250),
    (2816, 2816),
]


def _random_sizes(n: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        w, h = (int(v) for v in rng.integers(1, 1500, 2))
        if max(w, h) / min(w, h) <= 200:
            out.append((w, h))
    return out


def _plan_equals_decoding(model: Any, data: bytes, width: int, height: int) -> None:
    plan = model.plan_image(data)
    expansion = model.prepare_image(data)
    assert expansion.tokens == plan.tokens, (width, height)
    assert plan.pixels == width * height
    assert plan.item_bytes == sum(item.pixels.nbytes for item in expansion.items), (width, height)


@pytest.mark.parametrize("preprocessor", ["default", "golden"])
def test_qwen_tokens_from_the_header_equal_the_decoded_ones(loaded_models, preprocessor):
    from runner.models.qwen3_5_vision.processor import Qwen3_5ImagePreprocessor
    from tests.golden.make_qwen3_5_vision_goldens import PREPROCESSOR

    model = loaded_models(QWEN).model
    saved = model.preprocessor
    if preprocessor == "golden":  # min 1024, max 4096 pixels: growth and shrinking both
        model.preprocessor = Qwen3_5ImagePreprocessor(model.vision, PREPROCESSOR)
    try:
        grids = set()
        for width, height in QWEN_SIZES + _random_sizes(30, 7):
            data = image_bytes(width, height)
            _plan_equals_decoding(model, data, width, height)
            grids.add(model.preprocessor.grid(height, width)[0])
        assert len(grids) >= 15  # many shapes, grown and shrunk
        for width, height in ((1, 201), (300, 1)):  # refused alike, from the header
            data = image_bytes(width, height)
            with pytest.raises(ValueError, match=r"^invalid image data: aspect ratio"):
                model.plan_image(data)
            with pytest.raises(ValueError, match=r"^invalid image data: aspect ratio"):
                model.prepare_image(data)
    finally:
        model.preprocessor = saved


@pytest.mark.parametrize("arch", [QWEN, GEMMA])
@pytest.mark.parametrize(
    ("fmt", "mode", "kwargs"),
    [
        ("JPEG", "RGB", {}),
        ("JPEG", "L", {"progressive": True}),
        ("JPEG", "CMYK", {}),
        ("PNG", "RGBA", {}),
        ("PNG", "P", {"transparency": 0}),
        ("PNG", "LA", {}),
        ("PNG", "I;16", {}),
        ("GIF", "P", {}),
        ("WEBP", "RGBA", {"lossless": True}),
        ("WEBP", "RGB", {}),
    ],
)
def test_every_format_plans_what_it_decodes(loaded_models, arch, fmt, mode, kwargs):
    model = loaded_models(arch).model
    for width, height in ((37, 23), (300, 410), (1100, 90)):
        data = image_bytes(width, height, fmt, mode, **kwargs)
        assert read_header(data).pixels == width * height
        assert decode_image(data).size == (width, height)
        _plan_equals_decoding(model, data, width, height)


# --- what cannot fit decodes nothing ---------------------------------------------------------


def test_a_row_over_max_tokens_decodes_none_of_its_images(loaded_models, decodes):
    """Qwen3.5: two valid 2816 x 2816 images (3,846 tokens each) in a row of max_tokens 1024
    are refused for the row's length, as decoding would count it, with nothing decoded."""
    runner = loaded_models(QWEN)
    big = {0: alpha_png(2816, 2816), 1: alpha_png(2816, 2816, shade=90)}
    prompt = "[img-0][img-1]" + QUESTION
    with pytest.raises(BadRequest, match=r"^prompt 0 has (\d+) tokens; expected 1–1024") as e:
        ScoreEndpoint(runner).prepare(score_request([prompt], 1024, big))
    assert decodes == []
    count = int(str(e.value).split()[3])
    images = RequestImages(score_request([prompt], 1024, big).media, runner.model)
    decoded = plan_prompt(prompt, images, runner.tokenizer, False).realize()
    assert len(decoded.tokens) == count


def test_a_completion_over_the_context_decodes_nothing(loaded_models, decodes):
    runner = loaded_models(QWEN)
    count = runner.context_length // 3846 + 1
    with pytest.raises(BadRequest, match=r"^input length \(\d+ tokens\) exceeds the model's"):
        CompletionEndpoint(runner).prepare(
            completion_request("[img-0]" * count, {0: alpha_png(2816, 2816)})
        )
    assert decodes == []


def test_gemma_rows_of_many_images_are_refused_before_decoding(loaded_models, decodes):
    runner = loaded_models(GEMMA)
    items = {i: alpha_png(300, 200, shade=i) for i in range(30)}  # 20 tokens each
    prompt = "".join(f"[img-{i}]" for i in items) + QUESTION
    with pytest.raises(BadRequest, match=r"^prompt 0 has \d+ tokens; expected 1–50"):
        ScoreEndpoint(runner).prepare(score_request([prompt], 50, items))
    assert decodes == []


def test_a_million_tags_are_counted_not_listed(tiny_images, monkeypatch):
    runner = tiny_images()
    tokenizer = runner.tokenizer
    texts: list[int] = []
    original = tokenizer.encode_within

    def spy(batch, limit):
        texts.append(len(batch))
        return original(batch, limit)

    count = 7 * 1_000_000 + len(tokenizer.encode(QUESTION))  # 15 bytes: 5 + 2 tokens a tag
    monkeypatch.setattr(tokenizer, "encode_within", spy)
    request = score_request(["[img-0]" * 1_000_000 + QUESTION], 64, {0: b"\x89PNG red pixels"})
    with pytest.raises(BadRequest, match=f"^prompt 0 has {count} tokens; expected 1–64"):
        ScoreEndpoint(runner).prepare(request)
    assert sum(texts) <= 2  # "" and the question, each once
    assert runner.model.planned == 1 and runner.model.prepared == 0


def test_distinct_images_are_decoded_once_however_many_ids_or_rows(tiny_images):
    runner = tiny_images()
    same = b"\x89PNG the same bytes"
    items = {0: same, 1: same, 2: same, 3: b"\x89PNG other bytes"}
    prompts = ["[img-0][img-1]" + QUESTION, "[img-2][img-3]" + QUESTION, "[img-1]" + QUESTION]
    plan = ScoreEndpoint(runner).prepare(score_request(prompts, 64, items))
    assert runner.model.prepared == 2 and runner.model.planned == 2
    assert plan.rows is not None and len(plan.rows) == 3


@pytest.mark.parametrize(
    ("budget", "value", "message"),
    [
        (
            "MAX_REQUEST_PIXELS",
            40,
            r"images exceed the request's budget of 40 decoded pixels "
            r"\(image 2 brings the request to 48\)",
        ),
        (
            "MAX_REQUEST_ITEM_BYTES",
            150,
            r"images exceed the request's budget of 150 bytes of preprocessed pixels "
            r"\(image 2 brings the request to 192\)",
        ),
    ],
)
def test_a_request_over_its_image_budget_is_refused_before_decoding_more(
    tiny_images, monkeypatch, budget, value, message
):
    """Toy images of 16 bytes: 16 pixels each, and 2 + 16 % 4 = 2 rows of 8 float32 pixels
    (64 bytes) kept: the third distinct image goes over either budget, undecoded."""
    monkeypatch.setattr(prepare_module, budget, value)
    runner = tiny_images()
    items = {i: b"\x89PNG image #%04d" % i for i in range(4)}
    assert all(len(b) == 16 for b in items.values())
    prompt = "".join(f"[img-{i}]" for i in items) + QUESTION
    with pytest.raises(BadRequest, match=f"^{message}$"):
        ScoreEndpoint(runner).prepare(score_request([prompt], 64, items))
    assert runner.model.prepared == 2


def test_decoding_errors_come_after_the_row_length_and_before_its_candidates(tiny_images):
    """A row's images decode once its length is known to fit: a broken image in a row that
    is too long answers the length (Go's decoding would answer the image); in a row that
    fits, the image (before the candidates' count)."""
    runner = tiny_images()
    broken = {0: BROKEN + b" pixels"}
    with pytest.raises(BadRequest, match=r"^prompt 0 has \d+ tokens"):
        ScoreEndpoint(runner).prepare(score_request(["[img-0]" + QUESTION], 3, broken))
    body = {
        "rows": [{"prompt": "[img-0]" + QUESTION, "candidates": []}],
        "max_tokens": 64,
        "media": media(broken),
    }
    with pytest.raises(BadRequest, match=r"^invalid image data: broken pixels$"):
        ScoreEndpoint(runner).prepare(decode_score_request(json.dumps(body).encode()))


# --- the pool, cancellation, memory ----------------------------------------------------------


def test_images_decode_on_the_image_pool_however_many_callers(tiny_images):
    runner = tiny_images()
    threads: set[str] = set()
    original = runner.model.prepare_image

    def recording(data):
        threads.add(threading.current_thread().name)
        return original(data)

    runner.model.prepare_image = recording
    endpoint = ScoreEndpoint(runner)

    def one(seed: int) -> None:
        items = {i: b"\x89PNG caller %d image %d" % (seed, i) for i in range(3)}
        prompt = "".join(f"[img-{i}]" for i in items) + QUESTION
        endpoint.prepare(score_request([prompt], 64, items))

    callers = [threading.Thread(target=one, args=(seed,)) for seed in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert runner.model.prepared == 24
    assert threads and all(name.startswith("image") for name in threads), threads
    assert len(threads) <= pool.IMAGE_WORKERS


def test_a_cancelled_preparation_stops_within_one_image(tiny_images):
    runner = tiny_images()
    items = {i: b"\x89PNG image %d" % i for i in range(5)}
    prompt = "".join(f"[img-{i}]" for i in items) + QUESTION

    def check() -> None:  # the client leaves while the first image decodes
        if runner.model.prepared >= 1:
            raise Cancelled()

    request = score_request([prompt], 64, items)
    with pytest.raises(Cancelled):
        prepare_rows(request, runner.tokenizer, 4096, runner.model.vocab_size, runner.model, check)
    assert runner.model.prepared == 1


class BlockingImages(TinyImageModel):
    """Its first decode waits for `release`; `started` is set once it is inside."""

    def __init__(self, base: Any):
        super().__init__(base)
        self.started, self.release = threading.Event(), threading.Event()

    def prepare_image(self, data: bytes):
        if self.prepared == 0:
            self.started.set()
            self.release.wait(60)
        return super().prepare_image(data)


async def test_a_client_that_leaves_stops_the_decoding_within_one_image(
    engine, llama_loaded, make_client, monkeypatch
):
    from runner.server import app as app_module

    def build(job) -> Runner:
        model = BlockingImages(llama_loaded.model)
        return Runner(engine, model, llama_loaded.tokenizer, "tiny-image")

    runner = engine.call(build)
    cancelled, prepared = threading.Event(), threading.Event()
    original_cancel = app_module.RequestScope.cancel

    def cancel(self) -> None:
        cancelled.set()
        original_cancel(self)

    monkeypatch.setattr(app_module.RequestScope, "cancel", cancel)
    original_prepare = ScoreEndpoint.prepare

    def prepare(self, request, check=None):
        try:
            return original_prepare(self, request, check)
        finally:
            prepared.set()

    monkeypatch.setattr(ScoreEndpoint, "prepare", prepare)
    executed = []
    monkeypatch.setattr(ScoreEndpoint, "execute", lambda self, plan, job: executed.append(plan))
    client = await make_client(runner)
    items = {i: b"\x89PNG image %d" % i for i in range(6)}
    prompt = "".join(f"[img-{i}]" for i in items) + QUESTION
    body = {
        "rows": [{"prompt": prompt, "candidates": [" Yes"]}],
        "max_tokens": 64,
        "media": media(items),
    }
    post = asyncio.ensure_future(client.post("/v1/score", json=body))
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, runner.model.started.wait, 30)
    post.cancel()  # the client goes away while the first image decodes
    await client.close()
    assert await loop.run_in_executor(None, cancelled.wait, 30)
    runner.model.release.set()
    assert await loop.run_in_executor(None, prepared.wait, 30)
    assert runner.model.prepared == 1 and executed == []


def test_a_large_image_gives_its_memory_back(monkeypatch):
    trims = []
    monkeypatch.setattr(pool, "release_memory", lambda: trims.append(1))
    assert pool.decode_on_pool(lambda: 1, lambda: None, pool.TRIM_PIXELS + 1) == 1
    assert pool.decode_on_pool(lambda: 2, lambda: None, 1000) == 2
    assert trims == [1]
    with pytest.raises(ValueError):  # an image that fails gives it back too
        pool.decode_on_pool(_fails, lambda: None, pool.TRIM_PIXELS + 1)
    assert trims == [1, 1]


def _fails() -> None:
    raise ValueError("invalid image data: broken")


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(pool._TRIM is None, reason="malloc_trim is glibc's")
def test_the_process_keeps_little_after_a_burst_of_large_images(loaded_models):
    """Three 5000 x 5000 RGBA PNGs decoded at once (~300 MB each at its peak): what the
    process keeps afterwards is far below one image's peak (it kept most of it without
    `malloc_trim`; the margin is generous: other tests' threads share the process)."""
    model = loaded_models(GEMMA).model
    data = [alpha_png(5000, 5000, shade=s) for s in (10, 20, 30)]
    model.prepare_image(data[0])  # first use: the pool's threads and Pillow's state exist
    before = _rss()

    def decode(image: bytes) -> None:
        pool.decode_on_pool(lambda: model.prepare_image(image), lambda: None, 25_000_000)

    threads = [threading.Thread(target=decode, args=(d,)) for d in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _rss() - before < 150 << 20


# --- transparency without holding the GIL ---------------------------------------------------


def _reference_rgb(image: Image.Image) -> np.ndarray:
    """transformers' convert_to_rgb path: alpha_composite onto white, then RGB."""
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def test_compositing_equals_alpha_composite_for_every_value_and_alpha(monkeypatch):
    value, alpha = np.meshgrid(np.arange(256), np.arange(256))
    pixels = np.stack([value, 255 - value, (value * 7) % 256, alpha], -1).astype(np.uint8)
    rgba = Image.fromarray(pixels, "RGBA")
    expected = _reference_rgb(rgba)
    la = Image.fromarray(np.stack([value, alpha], -1).astype(np.uint8), "LA")
    expected_la = _reference_rgb(la)
    palette = Image.fromarray((value % 256).astype(np.uint8), "L").convert("P")
    palette.info["transparency"] = 7
    expected_palette = _reference_rgb(palette)
    rgb_key = Image.fromarray(pixels[..., :3].copy(), "RGB")
    rgb_key.info["transparency"] = (0, 255, 0)
    expected_key = _reference_rgb(rgb_key)

    def holds_the_gil(*args: Any) -> None:
        raise AssertionError("Image.alpha_composite holds the GIL")

    monkeypatch.setattr(Image, "alpha_composite", holds_the_gil)
    assert (np.asarray(to_rgb(rgba)) == expected).all()
    assert (np.asarray(to_rgb(la)) == expected_la).all()
    assert (np.asarray(to_rgb(palette)) == expected_palette).all()
    assert (np.asarray(to_rgb(rgb_key)) == expected_key).all()
    plain = Image.fromarray(pixels[..., :3].copy(), "RGB")
    assert to_rgb(plain) is plain  # nothing to convert: no copy


# --- what Go's decoders refuse ---------------------------------------------------------------


@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_declaring_more_than_it_holds_is_refused_from_its_header(progressive):
    data = declared_jpeg(9000, 9000)
    if progressive:
        out = io.BytesIO()
        Image.new("RGB", (16, 16), (90, 30, 200)).save(out, "JPEG", progressive=True)
        data = _declare(out.getvalue(), 9000, 9000)
    with pytest.raises(ValueError, match=r"^invalid image data: JPEG data too short: scan 1"):
        read_header(data)
    with pytest.raises(ValueError, match=r"^invalid image data: JPEG data too short"):
        decode_image(data)


def _declare(data: bytes, width: int, height: int) -> bytes:
    """The JPEG with its SOF header declaring `width` x `height`."""
    out = bytearray(data)
    i = 2
    while out[i + 1] not in (0xC0, 0xC1, 0xC2):
        i += 2 + struct.unpack(">H", out[i + 2 : i + 4])[0]
    out[i + 5 : i + 9] = struct.pack(">HH", height, width)
    return bytes(out)


JPEG_KINDS = [
    {"quality": 90},
    {"quality": 1},
    {"quality": 100, "subsampling": 0},
    {"quality": 75, "subsampling": 1},
    {"quality": 5, "optimize": True},
    {"progressive": True},
    {"progressive": True, "optimize": True, "quality": 1},
    {"progressive": True, "subsampling": 0, "quality": 95},
]


@pytest.mark.parametrize("kwargs", JPEG_KINDS)
@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_valid_jpegs_pass_the_check_even_at_its_bound(kwargs, mode):
    """Smooth, noisy and uniform images (a uniform one with optimised tables is coded in
    exactly the bound's bits: one DC and one AC bit a block) at many sizes."""
    rng = np.random.default_rng(3)
    for width, height in ((1, 1), (8, 8), (9, 17), (64, 48), (333, 201), (1024, 8), (1600, 1600)):
        for content in ("uniform", "noise", "smooth"):
            if content == "noise" and (kwargs.get("progressive") or width * height > 100_000):
                continue  # Pillow's progressive encoder runs out of its buffer on noise
            if content == "uniform":
                pixels = np.full((height, width, 3), 77, np.uint8)
            elif content == "noise":
                pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            else:
                y, x = np.mgrid[0:height, 0:width]
                pixels = np.stack([x % 256, y % 256, (x ^ y) % 256], -1).astype(np.uint8)
            out = io.BytesIO()
            image = Image.fromarray(pixels)
            (image if mode == "RGB" else image.convert(mode)).save(out, "JPEG", **kwargs)
            check_jpeg(out.getvalue())
            read_header(out.getvalue())


@pytest.mark.parametrize(
    ("marker", "name"), [(0xC3, "lossless"), (0xC5, "hierarchical"), (0xC9, "arithmetic")]
)
def test_jpeg_codings_go_does_not_decode_are_refused(marker, name):
    data = bytearray(image_bytes(32, 32, "JPEG"))
    i = 2
    while data[i + 1] != 0xC0:
        i += 2 + struct.unpack(">H", data[i + 2 : i + 4])[0]
    data[i + 1] = marker
    with pytest.raises(ValueError, match=rf"^invalid image data: unsupported JPEG coding \({name}"):
        check_jpeg(bytes(data))
    data[i + 1] = 0xC0
    data[i + 4] = 12  # 12-bit samples
    with pytest.raises(ValueError, match=r"^invalid image data: unsupported JPEG precision"):
        check_jpeg(bytes(data))


def _chunks(header: bytes, compressed: bytes) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", compressed)
        + chunk(b"IEND", b"")
    )


def _png(width: int, height: int, rows: bytes) -> bytes:
    """An RGB PNG whose IDAT holds `rows` (not necessarily all its rows)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return _chunks(header, zlib.compress(rows, 9))


def test_a_png_too_short_for_its_rows_is_refused_from_its_header():
    """8 rows of data for a 3000 x 3000 header: Pillow decoded it (the rest left black)."""
    data = _png(3000, 3000, b"".join(b"\0" + b"\x80" * 9000 for _ in range(8)))
    with pytest.raises(
        ValueError, match=r"^invalid image data: PNG data too short: \d+ compressed"
    ):
        read_header(data)


@pytest.mark.parametrize("kwargs", [{}, {"optimize": True}, {"compress_level": 9}])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1", "I;16"])
def test_valid_pngs_pass_the_check_even_at_its_bound(kwargs, mode):
    """Uniform images compress to ~1/1000 of their rows at zlib's best, near the bound."""
    for width, height in ((1, 1), (7, 3), (1000, 1000), (4000, 3000)):
        image = Image.new("RGB", (width, height), (200, 10, 10))
        image = image if mode == "RGB" else image.convert(mode)
        out = io.BytesIO()
        image.save(out, "PNG", **kwargs)
        read_header(out.getvalue())


def _adam7_png(width: int, height: int, rows_kept: int | None = None) -> bytes:
    """A uniform RGB PNG, interlaced (Adam7); `rows_kept` cuts its data to that many rows."""
    rows = []
    for x0, y0, dx, dy in images_module._ADAM7:
        across = -(-(width - x0) // dx) if width > x0 else 0
        down = -(-(height - y0) // dy) if height > y0 else 0
        if across:
            rows += [b"\0" + b"\x40\x80\xc0" * across] * down
    rows = rows[:rows_kept]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 1)
    return _chunks(header, zlib.compress(b"".join(rows), 9))


def test_interlaced_pngs_are_counted_by_their_passes():
    for width, height in ((1, 1), (5, 3), (9, 17), (3000, 2000)):
        data = _adam7_png(width, height)
        read_header(data)
        assert decode_image(data).size == (width, height)
    with pytest.raises(ValueError, match="PNG data too short"):
        read_header(_adam7_png(3000, 2000, rows_kept=10))


def test_a_gif_declaring_more_than_it_holds_is_refused():
    out = io.BytesIO()
    Image.new("P", (8, 8), 3).save(out, "GIF")
    data = bytearray(out.getvalue())
    data[6:10] = struct.pack("<HH", 4000, 4000)  # the logical screen
    descriptor = data.index(0x2C, 13)
    data[descriptor + 5 : descriptor + 9] = struct.pack("<HH", 4000, 4000)
    with pytest.raises(ValueError, match=r"^invalid image data: "):
        decode_image(bytes(data))


# --- tags and texts --------------------------------------------------------------------------


@pytest.mark.parametrize("digit", ["\u0663", "\uff13", "\u09e9", "3\u0663"])
def test_tags_take_ascii_digits_only(tiny_images, digit):
    assert split_prompt(f"a[img-{digit}]b") == [f"a[img-{digit}]b"]
    runner = tiny_images()
    plan = ScoreEndpoint(runner).prepare(
        score_request([f"[img-{digit}]{QUESTION}"], 64, {3: b"\x89PNG red pixels"})
    )
    assert plan.rows is not None and not plan.rows[0].has_images
    assert runner.model.planned == 0


@pytest.mark.parametrize(
    "data",
    [b"not an image at all", b"BM" + b"\0" * 60, b"\x00\x00\x01\x00" + b"\0" * 40],
)
def test_an_unsupported_format_is_named_without_an_address(data):
    if data.startswith(b"BM"):  # a real BMP: Pillow reads it, Go's runner does not
        out = io.BytesIO()
        Image.new("RGB", (4, 4)).save(out, "BMP")
        data = out.getvalue()
    with pytest.raises(ValueError) as e:
        read_header(data)
    assert str(e.value) == (
        "invalid image data: not a PNG, JPEG, GIF or WebP image (unsupported format)"
    )


def test_the_pixel_limit_cited_is_the_one_applied():
    over = pixel_bomb_png(20000, 20000)  # over twice the limit: Pillow's own error cited 2x
    with pytest.raises(ValueError) as e:
        read_header(over)
    assert str(e.value) == (
        "invalid image data: 20000 x 20000 is 400000000 pixels, over the limit of "
        f"{MAX_IMAGE_PIXELS} pixels per image"
    )
    just_over = pixel_bomb_png(MAX_IMAGE_PIXELS // 8000 + 1, 8000)
    with pytest.raises(ValueError, match=f"over the limit of {MAX_IMAGE_PIXELS} pixels"):
        read_header(just_over)
    at = _png(MAX_IMAGE_PIXELS // 9000, 9000, b"\0" * 9000 * 100)  # at the limit: not that
    with pytest.raises(ValueError, match="PNG data too short"):
        read_header(at)
