"""`python -m bench.vision`: vision decisions, one image and many questions.

One `/v1/score` request (in process, through the runner's endpoint) of `--rows` rows, each
the same image followed by its own question, candidates " Yes" and " No", on the tiny random
`Gemma3ForConditionalGeneration` of tests/ (SigLIP tower, projector, 16 soft tokens per
image). The runner decodes and encodes the image once, computes the shared prefix (text, the
image, text) once and batches the questions over it. The baseline is transformers run per
row, as a user without a scoring server would: the processor's pixels (computed once, not
timed) and a full forward per row. Both give the candidates' logits at the last position;
the report is the seconds of each, the ratio, and the largest difference between their
logits.

    python -m bench.vision --rows 32 --repeats 3
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from runner.native import preload

QUESTIONS = ("is the sky blue", "is it red", "is the cat on the mat", "is the dog by the door")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preload.reexec_preloaded("bench.vision", argv)  # the BLAS is chosen at process start
    p = argparse.ArgumentParser(prog="python -m bench.vision", description=__doc__)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from runner.engine import Engine
    from runner.protocol.wire import decode_score_request
    from runner.server.endpoints import ScoreEndpoint
    from runner.service import Runner
    from tests.golden.make_gemma3_vision_goldens import (
        ARCH,
        all_image_bytes,
        reference_logits,
        reference_model,
        reference_pixels,
    )
    from tests.tiny import write_tiny_model

    image = all_image_bytes()["large"]
    rows = [
        {
            "prompt": f"[img-0] Question {i}: {QUESTIONS[i % 4]}? Answer:",
            "candidates": [" Yes", " No"],
        }
        for i in range(args.rows)
    ]
    media = [{"data": base64.b64encode(image).decode(), "id": 0, "Kind": "image"}]
    body = json.dumps({"rows": rows, "max_tokens": 512, "media": media}).encode()
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp:
        model_dir = write_tiny_model(ARCH, Path(tmp) / "m")
        engine = Engine()
        ours_s, theirs_s = [], []
        try:
            runner = Runner.load(engine, str(model_dir))
            endpoint = ScoreEndpoint(runner)
            plan = endpoint.prepare(decode_score_request(body))
            reference = reference_model(model_dir)
            size = runner.model.preprocessor.size
            pixels = reference_pixels({"large": image}, size)["large"]
            for _ in range(args.repeats):
                fresh = engine.call(
                    lambda job: Runner(engine, runner.model, runner.tokenizer, runner.name)
                )
                started = time.perf_counter()
                ours = ScoreEndpoint(fresh)(decode_score_request(body))
                ours_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                theirs = [
                    reference_logits(reference, row.prompt.tokens, [pixels])[-1, row.candidates]
                    for row in plan.rows
                ]
                theirs_s.append(time.perf_counter() - started)
        finally:
            engine.stop(timeout=10)
    diff = float(np.abs(np.array(ours.logits) - np.array(theirs)).max())
    o, t = statistics.median(ours_s), statistics.median(theirs_s)
    tokens = sum(len(row.prompt.tokens) for row in plan.rows)
    print(
        f"vision decisions: {args.rows} rows, one image, {tokens} prompt tokens, "
        f"medians of {args.repeats}"
    )
    print(f"  ours (one request)         {o:8.3f} s  cached_tokens {ours.cached_tokens}")
    print(f"  transformers (row by row)  {t:8.3f} s  ratio {t / o:.1f}x  max|Δlogit| {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
