"""Hostile media: images that cost the runner far more than their bytes, sent to spawned tiny
image-text runners (tests/tiny.py's Gemma3 and Qwen3.5, the latter with its image processor's
default sizes), each case reported with its answer, its time, the runner's peak RSS
(VmHWM, reset before the case) and RSS after it, and the worst `/v1/status` latency while it
ran (polled every 20 ms from a process of its own).

    python -m bench.fuzz --bodies 0 --media full    # the sizes of the issue's reproductions
    python -m bench.fuzz --bodies 0 --media small   # what tests/test_fuzz_media.py runs

J is a 16x16 baseline JPEG whose SOF0 header declares a much larger image (9000 x 9000 at
full size); the PNG is that size in RGBA, half transparent (~330 KB). The cases:

1. `q-bombs-N`: Qwen3.5, one `/v1/score` row of N tags of J (ids 0..N-1), `max_tokens` 1024;
   `q-bombs-completion`: two of them to `/v1/completions`; `q-over-N`: N valid large
   images (2816 x 2816) in a row that cannot fit (`max_tokens` 64); `q-valid-rows-N`: N
   rows, each with its own large valid image.
2. `g-bombs`: Gemma3, one row of many ids of J, `max_tokens` 50; `g-disconnect-j`: 40 ids of
   J, and `g-disconnect`: valid RGBA PNGs whose decoding takes seconds, the client gone
   after a while: how long the runner keeps working after it left (`busy`, from its CPU
   time).
3. `g-alpha`: one RGBA PNG (the loop must not stall on its compositing);
4. `q-alpha`, `g-alpha-x3` (three at once): peaks, and the RSS left after the burst;
5. `g-declared`: J alone (Go's decoder refuses it: its data ends before its blocks do);
   `g-cut`: a valid JPEG cut in the middle;
6. `g-digit-arabic`, `g-digit-fullwidth`: `[img-٣]`, `[img-３]` with media id 3: Go's tags
   take ASCII digits only, so they are text;
7. `g-garbage` (bytes of no format), `g-pixel-bomb` (a PNG header declaring more than the
   per-image pixel limit): stable texts, no addresses, the limit actually applied;
8. `g-tags`: one row of a million `[img-0]` (7 MB), `max_tokens` 1024.

Each case states what the runner must answer (status and a fragment of the text); `ok` in the
report is whether it did. Peak and status latency are reported, never judged here (the
tests judge what they can without timing).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fuzz.client import MIB, Answer, StatusPoller, send
from bench.fuzz.process import REPO, spawn

GEMMA3 = "Gemma3ForConditionalGeneration"
QWEN3_5 = "Qwen3_5ForConditionalGeneration"


# --- images -------------------------------------------------------------------------------------


def declared_jpeg(width: int, height: int, size: int = 16) -> bytes:
    """A `size` x `size` baseline JPEG whose SOF0 header declares `width` x `height`: its data
    ends long before the blocks it declares (J)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 16, y * 16, (x + y) * 8], -1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=50)
    data = bytearray(buffer.getvalue())
    i = 2
    while i + 4 <= len(data):
        marker = data[i + 1]
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker == 0xC0:
            data[i + 5 : i + 9] = struct.pack(">HH", height, width)
            return bytes(data)
        i += 2 + length
    raise AssertionError("no SOF0 segment")


def alpha_png(width: int, height: int, shade: int = 200) -> bytes:
    """A valid RGBA PNG, one colour at half transparency: ~1/1000 of its pixels' bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGBA", (width, height), (shade, 90, 40, 128)).save(buffer, "PNG")
    return buffer.getvalue()


def plain_png(width: int, height: int, shade: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 255 - shade, 80)).save(buffer, "PNG")
    return buffer.getvalue()


def photo_jpeg(side: int, seed: int) -> bytes:
    """A valid JPEG of smooth content, different for each seed."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    rgb = np.stack([x * 255, y * 255, ((x + y + seed * 0.13) % 1) * 255], -1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


def cut_jpeg(side: int) -> bytes:
    data = photo_jpeg(side, 0)
    return data[: len(data) // 2]


def pixel_bomb_png(width: int, height: int) -> bytes:
    """A PNG header declaring `width` x `height` RGB, with one empty IDAT: a decompression
    bomb by its header alone."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


# --- bodies -------------------------------------------------------------------------------------


def media(images: dict[int, bytes]) -> list[dict[str, Any]]:
    return [
        {"data": base64.b64encode(data).decode(), "id": i, "Kind": "image"}
        for i, data in images.items()
    ]


def score_body(rows: list[str], max_tokens: int, images: dict[int, bytes]) -> bytes:
    body = {
        "rows": [{"prompt": p, "candidates": [" Yes", " No"]} for p in rows],
        "max_tokens": max_tokens,
        "media": media(images),
    }
    return json.dumps(body).encode()


def completion_body(prompt: str, images: dict[int, bytes], num_predict: int = 1) -> bytes:
    body = {"Prompt": prompt, "Options": {"num_predict": num_predict}, "Media": media(images)}
    return json.dumps(body).encode()


def tags(n: int, first: int = 0) -> str:
    return "".join(f"[img-{i}]" for i in range(first, first + n))


# --- cases --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    name: str
    bomb_side: int  # the side J declares
    alpha_side: int  # the RGBA PNG's side
    bomb_counts: tuple[int, ...]  # Qwen3.5: images of J in one row
    gemma_ids: int  # Gemma3: ids of J in one row
    valid_side: int  # Qwen3.5's valid rows: each row's own image
    valid_rows: tuple[int, ...]
    disconnect_ids: int  # Gemma3: ids of J, decoded while the client leaves
    disconnect_images: int  # Gemma3: distinct valid RGBA PNGs, decoded while the client leaves
    disconnect_side: int
    disconnect_after_s: float
    million: int  # `[img-0]` tags in one row
    timeout_s: float
    peak_side: int  # `format_peaks`: one image of each kind, this side


FULL = Sizes(
    "full", 9000, 9000, (1, 2, 4, 8), 30, 2816, (1, 4), 40, 7, 6000, 2.0, 1_000_000, 600, 9000
)
SMALL = Sizes("small", 2048, 256, (2,), 4, 256, (2,), 4, 6, 1024, 0.3, 20_000, 120, 3000)
SIZES = {s.name: s for s in (FULL, SMALL)}


@dataclass
class Case:
    name: str
    model: str  # GEMMA3 or QWEN3_5
    path: str
    bodies: list[bytes]  # sent at once, each on its own connection
    expect_status: int
    expect_text: str = ""  # a fragment of the (first) answer's body
    expect_absent: tuple[str, ...] = ()  # fragments it must not hold
    disconnect_after_s: float | None = None  # the client leaves then (no answer read)
    expect_input_tokens: Callable[[dict], bool] | None = None  # on a 200 score answer
    note: str = ""


def cases(sizes: Sizes) -> list[Case]:
    j = declared_jpeg(sizes.bomb_side, sizes.bomb_side)
    png = alpha_png(sizes.alpha_side, sizes.alpha_side)
    small = plain_png(64, 48, 30)
    question = " Is it bright? Answer:"
    out: list[Case] = []
    for n in sizes.bomb_counts:
        out.append(
            Case(
                f"q-bombs-{n}",
                QWEN3_5,
                "/v1/score",
                [score_body([tags(n) + question], 1024, dict.fromkeys(range(n), j))],
                400,
                "invalid image data: JPEG data too short",
                note=f"{n} x J ({len(j)} B), max_tokens 1024",
            )
        )
    n = 2  # the forward of more (had they been accepted) takes minutes
    out.append(
        Case(
            "q-bombs-completion",
            QWEN3_5,
            "/v1/completions",
            [completion_body(tags(n) + question, dict.fromkeys(range(n), j))],
            400,
            "invalid image data",
            note=f"{n} x J to /v1/completions",
        )
    )
    n = max(sizes.bomb_counts)
    valid = {i: photo_jpeg(sizes.valid_side, i) for i in range(n)}
    out.append(
        Case(
            f"q-over-{n}",
            QWEN3_5,
            "/v1/score",
            [score_body([tags(n) + question], 64, valid)],
            400,
            "prompt 0 has",
            note=f"{n} valid {sizes.valid_side}^2 JPEGs in a row, max_tokens 64",
        )
    )
    for rows in sizes.valid_rows:
        images = {i: photo_jpeg(sizes.valid_side, i) for i in range(rows)}
        prompts = [f"[img-{i}]{question}" for i in range(rows)]
        out.append(
            Case(
                f"q-valid-rows-{rows}",
                QWEN3_5,
                "/v1/score",
                [score_body(prompts, 8192, images)],
                200,
                note=f"{rows} rows, each its own {sizes.valid_side}^2 JPEG",
            )
        )
    out.append(
        Case(
            "g-bombs",
            GEMMA3,
            "/v1/score",
            [
                score_body(
                    [tags(sizes.gemma_ids) + question], 50, dict.fromkeys(range(sizes.gemma_ids), j)
                )
            ],
            400,
            "invalid image data: JPEG data too short",
            note=f"{sizes.gemma_ids} ids of J, max_tokens 50",
        )
    )
    ids = sizes.disconnect_ids
    out.append(
        Case(
            "g-disconnect-j",
            GEMMA3,
            "/v1/score",
            [score_body([tags(ids) + question], 4096, dict.fromkeys(range(ids), j))],
            0,
            disconnect_after_s=sizes.disconnect_after_s,
            note=f"{ids} ids of J, client gone after {sizes.disconnect_after_s} s",
        )
    )
    side = sizes.disconnect_side
    distinct = {i: alpha_png(side, side, 10 + 17 * i) for i in range(sizes.disconnect_images)}
    out.append(
        Case(
            "g-disconnect",
            GEMMA3,
            "/v1/score",
            [score_body([tags(len(distinct)) + question], 4096, distinct)],
            0,
            disconnect_after_s=sizes.disconnect_after_s,
            note=f"{len(distinct)} distinct {side}^2 RGBA PNGs, client gone after "
            f"{sizes.disconnect_after_s} s",
        )
    )
    alpha = score_body(["[img-0]" + question], 1024, {0: png})
    out.append(
        Case("g-alpha", GEMMA3, "/v1/score", [alpha], 200, note=f"RGBA PNG ({len(png) // 1024} KB)")
    )
    qwen_alpha = score_body(["[img-0]" + question], 8192, {0: png})
    out.append(Case("q-alpha", QWEN3_5, "/v1/score", [qwen_alpha], 200, note="the same PNG"))
    out.append(Case("g-alpha-x3", GEMMA3, "/v1/score", [alpha] * 3, 200, note="three at once"))
    out.append(
        Case(
            "g-declared",
            GEMMA3,
            "/v1/score",
            [score_body(["[img-0]" + question], 1024, {0: j})],
            400,
            "invalid image data",
            note="J alone",
        )
    )
    out.append(
        Case(
            "g-cut",
            GEMMA3,
            "/v1/score",
            [score_body(["[img-0]" + question], 1024, {0: cut_jpeg(256)})],
            400,
            "invalid image data",
            note="a JPEG cut in the middle",
        )
    )
    for name, digit in (("arabic", "\u0663"), ("fullwidth", "\uff13")):
        prompt = f"[img-{digit}]{question}"
        out.append(
            Case(
                f"g-digit-{name}",
                GEMMA3,
                "/v1/score",
                [score_body([prompt], 1024, {3: small})],
                200,
                expect_input_tokens=lambda answer: answer["input_tokens"] < 20,
                note=f"[img-{digit}] with media id 3 (an image is 20 tokens)",
            )
        )
    out.append(
        Case(
            "g-garbage",
            GEMMA3,
            "/v1/score",
            [score_body(["[img-0]" + question], 1024, {0: b"not an image at all" * 4})],
            400,
            "invalid image data",
            expect_absent=("0x", "BytesIO"),
            note="bytes of no format",
        )
    )
    out.append(
        Case(
            "g-pixel-bomb",
            GEMMA3,
            "/v1/score",
            [score_body(["[img-0]" + question], 1024, {0: pixel_bomb_png(20000, 20000)})],
            400,
            "89478485",
            expect_absent=("178956970",),
            note="a PNG header declaring 20000 x 20000",
        )
    )
    out.append(
        Case(
            "g-tags",
            GEMMA3,
            "/v1/score",
            [score_body(["[img-0]" * sizes.million], 1024, {0: small})],
            400,
            "prompt 0 has",
            note=f"{sizes.million:,} x [img-0]",
        )
    )
    return out


# --- measuring ----------------------------------------------------------------------------------


def _status_field(pid: int, name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux: clear_refs 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_seconds_after(pid: int, quiet_s: float = 1.0, limit_s: float = 600.0) -> float:
    """Seconds from now until the process stops working (under half a core for `quiet_s`;
    answering the status poller takes ~15%): how long it kept working."""
    started = time.monotonic()
    last_busy = started
    previous = cpu_seconds(pid)
    while time.monotonic() - started < limit_s:
        time.sleep(0.1)
        now, used = time.monotonic(), cpu_seconds(pid)
        if used - previous > 0.05:
            last_busy = now
        previous = used
        if now - last_busy >= quiet_s:
            break
    return last_busy - started


def send_and_leave(port: int, path: str, body: bytes, after_s: float) -> None:
    """Send the request, then close the connection after `after_s` without reading."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
        time.sleep(after_s)


@dataclass
class Result:
    case: Case
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0
    peak: int | None = None  # VmHWM during the case
    rss_before: int | None = None
    rss_after: int | None = None
    worst_status_s: float = 0.0
    polls: int = 0
    status_errors: list[str] = field(default_factory=list)
    busy_after_s: float | None = None  # g-disconnect: work after the client left
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def judge(result: Result) -> None:
    case = result.case
    if case.disconnect_after_s is not None:
        return
    for answer in result.answers:
        text = answer.text(2000)
        if answer.error:
            result.problems.append(f"no answer: {answer.error}")
        elif answer.status != case.expect_status:
            result.problems.append(f"status {answer.status} (expected {case.expect_status})")
        elif case.expect_text and case.expect_text not in text:
            result.problems.append(f"text lacks {case.expect_text!r}")
        for fragment in case.expect_absent:
            if fragment in text:
                result.problems.append(f"text holds {fragment!r}")
        check = case.expect_input_tokens
        if check is not None and answer.status == 200 and not check(json.loads(answer.body)):
            result.problems.append(f"input_tokens: {text[-80:]!r}")
    if result.status_errors:
        result.problems.append(f"/v1/status failed: {result.status_errors[0]}")


def run_case(runner: Any, case: Case, timeout: float, settle_s: float = 1.0) -> Result:
    pid = runner.process.pid
    result = Result(case)
    time.sleep(settle_s)
    reset_peak(pid)
    result.rss_before = _status_field(pid, "VmRSS")
    poller = StatusPoller(runner.port)
    poller.start()
    time.sleep(0.3)  # the poller is polling
    started = time.perf_counter()
    try:
        if case.disconnect_after_s is not None:
            send_and_leave(runner.port, case.path, case.bodies[0], case.disconnect_after_s)
            result.busy_after_s = busy_seconds_after(pid, limit_s=timeout)
        else:
            answers: list[Answer | None] = [None] * len(case.bodies)

            def post(i: int, body: bytes) -> None:
                answers[i] = send(runner.port, case.path, body, timeout=timeout)

            threads = [
                threading.Thread(target=post, args=(i, b)) for i, b in enumerate(case.bodies)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            result.answers = [a for a in answers if a is not None]
        result.seconds = time.perf_counter() - started
        result.peak = _status_field(pid, "VmHWM")
        time.sleep(settle_s)
        result.rss_after = _status_field(pid, "VmRSS")
    finally:
        poller.stop()
    result.worst_status_s = max(poller.latencies, default=0.0)
    result.polls = len(poller.latencies)
    result.status_errors = poller.errors
    judge(result)
    return result


def write_models(root: Path) -> dict[str, Path]:
    sys.path.insert(0, str(REPO))
    from tests.tiny import write_tiny_model

    return {arch: write_tiny_model(arch, root / arch) for arch in (GEMMA3, QWEN3_5)}


def run_media(
    sizes: Sizes,
    only: Callable[[Case], bool] | None = None,
    log_dir: Path | None = None,
    fresh: bool = True,
    progress: bool = False,
    settle_s: float = 1.0,
) -> list[Result]:
    """Every case of `sizes` (those `only` keeps), in order: each against a runner of its own
    (`fresh`: its peak and the RSS it keeps are the case's alone), else one runner per model."""
    chosen = [c for c in cases(sizes) if only is None or only(c)]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="hostile-media-") as tmp:
        root = Path(tmp)
        models = write_models(root)
        logs = log_dir or root / "logs"
        for arch in (QWEN3_5, GEMMA3):
            runner = None
            try:
                for case in (c for c in chosen if c.model == arch):
                    if runner is not None and (fresh or runner.process.poll() is not None):
                        runner.stop()
                        runner = None
                    if runner is None:
                        runner = spawn(models[arch], logs)
                    result = run_case(runner, case, sizes.timeout_s, settle_s)
                    if runner.process.poll() is not None:
                        result.problems.append(f"the runner died: {runner.tail()}")
                    results.append(result)
                    if progress:
                        print(row(result), flush=True)
            finally:
                if runner is not None:
                    runner.stop()
    return results


# --- one image's peak, by format ---------------------------------------------------------------


def format_images(side: int) -> dict[str, bytes]:
    """One `side` x `side` image of each kind whose decoding peak differs: the transparent
    ones (composited onto white), a progressive JPEG's coefficients, WebP's canvases."""
    import numpy as np
    from PIL import Image

    ramp = np.broadcast_to(np.linspace(0, 255, side, dtype=np.float32)[None, :], (side, side))
    grey = Image.fromarray(ramp.astype(np.uint8))
    rgb = Image.merge("RGB", [grey, grey.transpose(Image.Transpose.TRANSPOSE), grey])
    flat = Image.new("RGB", (side, side), (1, 2, 3))
    kinds: dict[str, tuple[Image.Image, str, dict[str, Any]]] = {
        "RGBA PNG": (Image.new("RGBA", (side, side), (200, 90, 40, 128)), "PNG", {}),
        "P PNG, transparent": (Image.new("P", (side, side), 3), "PNG", {"transparency": 3}),
        "RGB PNG, transparent": (flat, "PNG", {"transparency": (1, 2, 3)}),
        "RGB PNG": (flat, "PNG", {}),
        "LA PNG": (Image.new("LA", (side, side), (100, 50)), "PNG", {}),
        "I;16 PNG": (Image.new("I;16", (side, side), 1000), "PNG", {}),
        "JPEG 4:2:0": (rgb, "JPEG", {"quality": 75}),
        "JPEG progressive 4:4:4": (rgb, "JPEG", {"progressive": True, "subsampling": 0}),
        "CMYK JPEG progressive": (rgb.convert("CMYK"), "JPEG", {"progressive": True}),
        "GIF": (Image.new("P", (side, side), 3), "GIF", {}),
        "RGBA WebP lossless": (
            Image.new("RGBA", (side, side), (200, 90, 40, 128)),
            "WEBP",
            {"lossless": True},
        ),
        "RGB WebP": (rgb, "WEBP", {"quality": 50}),
    }
    out = {}
    for name, (image, fmt, options) in kinds.items():
        buffer = io.BytesIO()
        image.save(buffer, fmt, **options)
        out[name] = buffer.getvalue()
    return out


def image_peaks(model_dir: Path, images: list[Path]) -> list[dict[str, Any]]:
    """In this process: the model loaded, then each image prepared on the image pool, the
    heap trimmed and the peak reset (VmHWM) before each; the peak RSS each added, per
    declared pixel."""
    import gc

    from runner.media import pool
    from runner.media.images import read_header
    from runner.models import build_model
    from runner.sources.loader import load_local_dir

    model = build_model(load_local_dir(model_dir))
    model.prepare_image(plain_png(32, 32, 9))  # the pool and Pillow's state exist
    pid = os.getpid()
    out = []
    for image in images:
        data = image.read_bytes()
        header = read_header(data)
        gc.collect()
        pool.release_memory()
        reset_peak(pid)
        before = _status_field(pid, "VmRSS") or 0
        started = time.perf_counter()
        pool.decode_on_pool(
            functools.partial(model.prepare_image, data), lambda: None, header.pixels
        )
        seconds = time.perf_counter() - started
        peak = (_status_field(pid, "VmHWM") or 0) - before
        out.append(
            {
                "bytes": len(data),
                "pixels": header.pixels,
                "peak_bytes": peak,
                "per_pixel": round(peak / header.pixels, 2),
                "seconds": round(seconds, 2),
            }
        )
    return out


def format_peaks(side: int, arch: str = GEMMA3, progress: bool = False) -> dict[str, dict]:
    """`image_peaks` of `format_images(side)`, in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="media-peaks-") as tmp:
        root = Path(tmp)
        model_dir = write_models(root)[arch]
        images = format_images(side)
        paths = []
        for i, data in enumerate(images.values()):
            paths.append(root / f"image-{i}")
            paths[-1].write_bytes(data)
        child = subprocess.run(
            [sys.executable, "-m", "bench.fuzz.media", "peaks", str(model_dir), *map(str, paths)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
    lines = child.stdout.strip().splitlines()
    measured = json.loads(lines[-1]) if child.returncode == 0 and lines else []
    if len(measured) != len(images):
        raise RuntimeError(f"the peaks' process failed: {child.stderr[-2000:]}")
    out = dict(zip(images, measured, strict=True))
    if progress:
        print(peaks_summary(out, side), flush=True)
    return out


def peaks_summary(peaks: dict[str, dict], side: int) -> str:
    lines = [f"one {side} x {side} image prepared (Gemma3), peak RSS added:"]
    for name, p in peaks.items():
        if not p:
            lines.append(f"  {name:<24} failed")
            continue
        lines.append(
            f"  {name:<24} {p['bytes'] / 1024:>8.0f} KB  {p['peak_bytes'] / MIB:>6.0f} MiB  "
            f"{p['per_pixel']:>5.2f} B/pixel  {p['seconds']:.2f} s"
        )
    return "\n".join(lines)


# --- the report ---------------------------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:,.0f}"


HEADER = (
    f"{'case':<20} {'answer':<44} {'s':>7} {'peak MiB':>9} {'+MiB':>7} {'after':>7} "
    f"{'status ms':>9}  ok"
)


def row(result: Result) -> str:
    case = result.case
    if case.disconnect_after_s is not None:
        answer = f"left after {case.disconnect_after_s} s, busy {result.busy_after_s:.1f} s more"
    elif result.answers:
        first = result.answers[0]
        answer = f"{first.status} {first.text(200).strip()}" if not first.error else first.error
        if first.status == 200 and case.path == "/v1/score":
            answer = f"200 input_tokens {json.loads(first.body).get('input_tokens')}"
        if len(result.answers) > 1:
            answer += f" (x{len(result.answers)})"
    else:
        answer = "-"
    grown = (
        result.peak - result.rss_before if result.peak and result.rss_before is not None else None
    )
    return (
        f"{case.name:<20} {answer[:44]:<44} {result.seconds:>7.2f} {_mb(result.peak):>9} "
        f"{_mb(grown):>7} {_mb(result.rss_after):>7} {result.worst_status_s * 1000:>9.0f}  "
        f"{'ok' if result.ok else 'NO: ' + '; '.join(result.problems)}"
    )


def media_summary(results: list[Result], sizes: Sizes) -> str:
    lines = [f"hostile media ({sizes.name}): {len(results)} cases", HEADER]
    lines += [row(r) for r in results]
    lines.append("notes: " + "; ".join(f"{r.case.name}: {r.case.note}" for r in results))
    return "\n".join(lines)


def media_json(results: list[Result]) -> list[dict[str, Any]]:
    return [
        {
            "case": r.case.name,
            "statuses": [a.status for a in r.answers],
            "answer": r.answers[0].text(300) if r.answers else "",
            "seconds": round(r.seconds, 3),
            "peak_bytes": r.peak,
            "rss_before": r.rss_before,
            "rss_after": r.rss_after,
            "worst_status_s": round(r.worst_status_s, 4),
            "busy_after_s": r.busy_after_s,
            "problems": r.problems,
        }
        for r in results
    ]


if __name__ == "__main__":  # `python -m bench.fuzz.media peaks MODEL_DIR IMAGE...`
    print(json.dumps(image_peaks(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])))
