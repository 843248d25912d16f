"""`python -m bench.native_step`: short forwards through the native decoder step against MLX.

The CPU backend runs forwards of up to `native_step_max_tokens` tokens of Llama-shaped
models in one native call (runner/backend/native_step.py). This measures where that pays:
the same model loaded twice (the step on, and off), a prompt of `--cached` tokens in each
one's cache, then forwards of T new tokens after it with the head over the last row (a
decode step is T = 1), best of `--repeats`, in interleaved rounds; each T's MLX time as a
ratio to the native one. The threshold in runner/backend/__init__.py comes from this.

    python -m bench.native_step --model default --tokens 1,4,8,16,24,32,48,64
"""

from __future__ import annotations

import argparse
import sys
import time

from runner.native import preload


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preload.reexec_preloaded("bench.native_step", argv)  # the BLAS is chosen at process start
    p = argparse.ArgumentParser(prog="python -m bench.native_step", description=__doc__)
    p.add_argument("--model", default="default", help="a model directory, or `default`")
    p.add_argument("--cached", type=int, default=480)
    p.add_argument("--tokens", default="1,4,16,64,128,256,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import mlx.core as mx
    import numpy as np

    from runner.backend import Backend
    from runner.models import build_model
    from runner.sources.default_model import resolve_default_model
    from runner.sources.loader import load_model_source

    path = str(resolve_default_model()) if args.model == "default" else args.model
    source = load_model_source(path)
    sizes = [int(t) for t in args.tokens.split(",")]
    native = build_model(source, Backend.cpu().replace(native_step_max_tokens=max(sizes)))
    plain = build_model(source, Backend.cpu().replace(native_step_max_tokens=None))
    if getattr(native, "_native", None) is None:
        raise SystemExit("this model (or this machine: no dispatch library) has no native step")
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 5000, size=args.cached + max(sizes)).tolist()

    def timed(model, t: int) -> float:
        caches = model.make_caches()
        if args.cached:
            mx.eval(model.hidden(mx.array([prompt[: args.cached]], dtype=mx.int32), caches))
        best = float("inf")
        for _ in range(args.repeats):
            for c in caches:
                c.offset = args.cached  # rewind to the prompt (a KV cache's rewind)
            new = mx.array([prompt[args.cached : args.cached + t]], dtype=mx.int32)
            started = time.perf_counter()
            hidden = model.hidden(new, caches)
            mx.eval(model.unembed(hidden[:, -1:]))
            best = min(best, time.perf_counter() - started)
        return best

    best: dict[tuple[int, str], float] = {}
    for _ in range(args.rounds):  # interleaved: the machine's load drifts
        for t in sizes:
            for name, model in (("native", native), ("mlx", plain)):
                key = (t, name)
                best[key] = min(best.get(key, float("inf")), timed(model, t))
    print(
        f"model {path}: {args.cached} tokens cached, then T new; best of {args.repeats} x "
        f"{args.rounds} rounds; ms for the forward and the head's last row"
    )
    for t in sizes:
        n, m = best[(t, "native")] * 1e3, best[(t, "mlx")] * 1e3
        print(f"T={t:3d}  native {n:7.1f} ms  mlx {m:7.1f} ms  mlx/native x{m / n:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
