"""`python -m bench.prefill_chunks`: what prefill chunk sizes cost.

The runner prefills a prompt in chunks and checks for cancellation between them, so the chunk
bounds the work done after a client has gone (runner/backend `prefill_chunk_tokens`). Each
chunk reads every weight once more; this measures what that costs: a prompt of `--tokens`
tokens prefilled through a fresh scoring prefix cache at each chunk size, in interleaved
rounds (the machine is shared and noisy), with each size's median as a ratio to the largest.

    python -m bench.prefill_chunks --model-dir /tmp/bench-default --tokens 2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from runner.native import preload


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preload.reexec_preloaded("bench.prefill_chunks", argv)  # the BLAS is chosen at process start
    p = argparse.ArgumentParser(prog="python -m bench.prefill_chunks", description=__doc__)
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a model directory (default: the random Qwen3-0.6B-shape model, built in a temp dir)",
    )
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunks", default="2048,1024,512,256")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import tempfile

    from bench.models import SHAPES, write_model_dir
    from runner.backend import Backend
    from runner.cache.prefix_cache import PrefixCache
    from runner.engine import Engine
    from runner.models import build_model
    from runner.sources.loader import load_model_source

    chunks = [int(c) for c in args.chunks.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        model_dir = args.model_dir or write_model_dir(SHAPES["default"], Path(tmp) / "m", 0)
        engine = Engine()
        model = engine.call(lambda job: build_model(load_model_source(str(model_dir))))
        times: dict[int, list[float]] = {c: [] for c in chunks}
        for round_ in range(args.rounds):
            for chunk in chunks:
                tokens = [(7 * i + 13 * round_ + chunk) % 30000 + 10 for i in range(args.tokens)]

                def prefill(job, chunk=chunk, tokens=tokens) -> float:
                    cache = PrefixCache(
                        model,
                        name="chunks",
                        chunk_tokens=chunk,
                        batch_tokens=Backend.for_device().batch_tokens,
                        keep_hidden=True,
                    )
                    started = time.perf_counter()
                    cache.last_hidden(tokens, job.check)
                    return time.perf_counter() - started

                times[chunk].append(engine.call(prefill))
        engine.stop(timeout=10)
    base = statistics.median(times[max(chunks)])
    print(f"prefill of {args.tokens} tokens, {args.rounds} interleaved rounds, median:")
    for chunk in chunks:
        median = statistics.median(times[chunk])
        print(
            f"  chunk {chunk:5d}: {median:6.2f} s  {args.tokens / median:6.0f} tok/s  "
            f"x{median / base:.3f} of chunk {max(chunks)}  (all: "
            + ", ".join(f"{t:.2f}" for t in times[chunk])
            + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
