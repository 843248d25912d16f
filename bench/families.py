"""`python -m bench.families`: which families the CPU's native decoder step serves, and what a
short forward costs each family on the path it takes.

Every text family of the tests' tiny models (tests/tiny.py: 2-4 layers, hidden 64, random
weights, loaded by the runner's own loader) is run twice: as the runner runs it on this CPU
(the native step where it serves the family, docs/DESIGN.md §4.2), and on MLX's path alone
(`mlx_only`). After a 64-token prompt: decode steps (one token, the head's row) and 15-token
forwards (a decision suffix), each timed as the median of `--steps` successive forwards
appended to the cache (a rotating or recurrent cache cannot be rewound). At these sizes the
products are nothing: the times are what a forward costs besides its arithmetic (MLX's CPU
graph at ~5 us an operation; the step's one call), per layer, which is what separates the
families left on MLX from the others at any size (bench/RESULTS.md has real-size figures).

    python -m bench.families
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runner.native import preload


def timed_forwards(model: Any, prompt: list[int], tokens: int, steps: int) -> float:
    """The median ms of `steps` successive forwards of `tokens` tokens after `prompt`."""
    import mlx.core as mx

    caches = model.make_caches()
    mx.eval(model.hidden(mx.array([prompt], dtype=mx.int32), caches))
    times = []
    for step in range(steps):
        new = mx.array([[3 + (step * tokens + t) % 200 for t in range(tokens)]], dtype=mx.int32)
        started = time.perf_counter()
        hidden = model.hidden(new, caches)
        mx.eval(model.unembed(hidden[:, -1:]))
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's figures: whether the native step serves it, its layers, and the median
    ms of a decode step and a 15-token forward as the runner runs it and on MLX's path."""

    arch: str
    native: bool
    layers: int
    decode_ms: float
    decode_mlx_ms: float
    forward_ms: float
    forward_mlx_ms: float


def measure(archs: list[str], steps: int) -> list[Family]:
    """Each of `archs` (tests/tiny.py's architectures) loaded as the runner loads it on this
    device, and timed."""
    from runner.backend import Backend
    from tests.tiny import load_tiny_model, tiny_config

    backend = Backend.for_device()
    prompt = [3 + i % 200 for i in range(64)]
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        for arch in archs:
            model = load_tiny_model(arch, Path(scratch) / arch, backend=backend)
            text = tiny_config(arch)
            text = text.get("text_config") or text
            layers = int(text.get("num_hidden_layers") or len(text["layers_block_type"]))
            ms = []
            for tokens in (1, 15):
                ms.append(timed_forwards(model, prompt, tokens, steps))
                with getattr(model, "mlx_only", contextlib.nullcontext)():
                    ms.append(timed_forwards(model, prompt, tokens, steps))
            native = getattr(model, "native", None) is not None
            out.append(Family(arch, native, layers, *ms))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preload.reexec_preloaded("bench.families", argv)  # the runner's process, preloaded
    p = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)

    from runner.backend import Backend
    from tests.tiny import TINY_ARCHITECTURES

    print(
        f"tiny models (tests/tiny.py), {Backend.for_device().name} backend, native step "
        f"{'on' if preload.dispatch_active() else 'off (no library)'}; median of {args.steps} "
        f"forwards after 64 cached, ms (per layer in brackets), {time.strftime('%Y-%m-%d %H:%M')}"
    )
    heads = ("1 token", "MLX", "15 tokens", "MLX")
    print(f"{'family':40s} {'step':6s} " + " ".join(f"{h:>16s}" for h in heads))
    for f in measure(list(TINY_ARCHITECTURES), args.steps):
        times = (f.decode_ms, f.decode_mlx_ms, f.forward_ms, f.forward_mlx_ms)
        cells = [f"{ms:7.2f} ({ms / f.layers:5.2f})" for ms in times]
        print(
            f"{f.arch:40s} {'yes' if f.native else 'MLX':6s} "
            + " ".join(f"{c:>16s}" for c in cells)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
