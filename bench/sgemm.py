"""`python -m bench.sgemm`: the few-row products of a short forward, dispatch against OpenBLAS.

A decode step or a short scoring forward multiplies a few rows by every weight matrix of the
model, each read from memory once (cold: the model is larger than the last-level cache). This
times exactly that: `C = A W^T` for `--rows` rows against one model's worth of distinct
weights of each shape (SmolLM2-135M's by default), through `cblas_sgemm` as MLX calls it, in
one child process per BLAS setting (the BLAS is chosen at process start), in interleaved
rounds, best of each; GFLOP/s, the weights' streaming rate, and each setting's ratio to
OpenBLAS alone in the same run.

    python -m bench.sgemm --rows 1,4,20,40 --rounds 3
    python -m bench.sgemm --shape qwen3-0.6b

Settings: `openblas` (OpenBLAS alone, what a runner without a C compiler uses), `dispatch`
(runner/native/sgemm_dispatch.c ahead of OpenBLAS, as the runner runs), `dispatch-1t` (the
same on one thread: the kernel's efficiency, less sensitive to a busy second core), `panels`
and `panels-1t` (the native step's products on exact float16 copies stored as panels,
`runner_weight_product`: what a checkpoint stored in half precision gets; half the bytes, so
their GB/s column counts two bytes a weight).

    python -m bench.sgemm --rows 1,15,40 --settings openblas,dispatch,panels
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

# (out, in) of each product in a layer, and the layer count: q/o, k/v, gate/up, down.
SHAPES = {
    "smollm2-135m": ([(576, 576), (192, 576), (192, 576), (576, 576),
                      (1536, 576), (1536, 576), (576, 1536)], 30),
    "qwen3-0.6b": ([(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048),
                    (3072, 1024), (3072, 1024), (1024, 3072)], 28),
    "tiny": ([(48, 32), (16, 32), (16, 32), (32, 48), (72, 32), (72, 32), (32, 72)], 2),  # tests
}  # fmt: skip
SETTINGS = ("openblas", "dispatch", "dispatch-1t", "panels", "panels-1t")
FLOAT16 = 1  # W_F16 in runner/native/sgemm_dispatch.c


def child(shape: str, rows: list[int], panels: bool = False) -> dict[str, float]:
    """In a process with the BLAS preloaded: best GFLOP/s per row count."""
    import numpy as np

    process = ctypes.CDLL(None)
    sgemm = process.cblas_sgemm
    p = ctypes.c_void_p
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, p, ctypes.c_int, p, ctypes.c_int]
    sgemm.argtypes += [ctypes.c_float, p, ctypes.c_int]
    products, layers = SHAPES[shape]
    rng = np.random.default_rng(0)
    # each layer's operands: float32 weights [n, k], or the panels of float16 values (exact)
    operands = [
        [rng.standard_normal((n, k), dtype=np.float32) for n, k in products] for _ in range(layers)
    ]
    if panels:
        narrow, product = process.runner_narrow_panels, process.runner_weight_product
        narrow.argtypes = [p, ctypes.c_int, ctypes.c_int, p, ctypes.c_int]
        product.argtypes = [ctypes.c_int] * 3 + [p, p, ctypes.c_int, p]
        process.runner_panel_halves.restype = ctypes.c_long
        for layer in operands:
            for i, ((n, k), w) in enumerate(zip(products, layer, strict=True)):
                exact = w.astype(np.float16).astype(np.float32)
                layer[i] = np.empty(process.runner_panel_halves(n, k), np.uint16)
                if not narrow(exact.ctypes.data, n, k, layer[i].ctypes.data, FLOAT16):
                    raise SystemExit("a float16 value did not survive the narrowing")

    def multiply(m: int, n: int, k: int, w: np.ndarray, a: np.ndarray, c: np.ndarray) -> None:
        if panels:
            product(m, n, k, a.ctypes.data, w.ctypes.data, FLOAT16, c.ctypes.data)
        else:
            sgemm(101, 111, 112, m, n, k, 1.0, a.ctypes.data, k, w.ctypes.data, k,
                  0.0, c.ctypes.data, n)  # fmt: skip

    result = {}
    for m in rows:
        a = {k: rng.standard_normal((m, k), dtype=np.float32) for _, k in products}
        c = {n: np.empty((m, n), np.float32) for n, _ in products}
        best = 0.0
        for _ in range(3):
            flops, started = 0.0, time.perf_counter()
            for layer in operands:
                for (n, k), w in zip(products, layer, strict=True):
                    multiply(m, n, k, w, a[k], c[n])
                    flops += 2.0 * m * n * k
            best = max(best, flops / (time.perf_counter() - started) / 1e9)
        result[str(m)] = best
    return result


def run_setting(setting: str, shape: str, rows: list[int]) -> dict[str, float]:
    from runner.native import build, preload

    library = preload.optimised_blas()
    if library is None:
        raise SystemExit("needs Linux with Debian's libopenblas0-pthread")
    env = {**os.environ, preload.MARKER: library, "OPENBLAS_THREAD_TIMEOUT": "4"}
    if setting == "openblas":
        env["LD_PRELOAD"] = library
    else:
        dispatch = build.library()
        if dispatch is None:
            raise SystemExit("the sgemm dispatch did not build (no C compiler?)")
        env["LD_PRELOAD"] = f"{dispatch}:{library}"
        if setting.endswith("-1t"):
            env["RUNNER_BLAS_THREADS"] = "1"
            env["OPENBLAS_NUM_THREADS"] = "1"
    kind = "panels" if setting.startswith("panels") else "sgemm"
    command = [sys.executable, "-m", "bench.sgemm", "--child", shape, ",".join(map(str, rows))]
    command.append(kind)
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        panels = argv[3:4] == ["panels"]
        print(json.dumps(child(argv[1], [int(m) for m in argv[2].split(",")], panels)))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.sgemm", description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--rows", default="1,4,8,20,40")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settings", default=",".join(SETTINGS))
    args = p.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    settings = args.settings.split(",")
    best: dict[str, dict[str, float]] = {s: {} for s in settings}
    for _ in range(args.rounds):  # interleaved: the machine's load drifts
        for setting in settings:
            for m, rate in run_setting(setting, args.shape, rows).items():
                best[setting][m] = max(best[setting].get(m, 0.0), rate)
    products, layers = SHAPES[args.shape]
    megabytes = sum(n * k for n, k in products) * layers * 4 / 1e6
    print(f"shape {args.shape}: {megabytes:.0f} MB of float32 weights, best of {args.rounds}")
    print("rows  " + "".join(f"{s:>26}" for s in settings))
    for m in rows:
        cells = []
        for s in settings:
            rate = best[s][str(m)]
            ratio = rate / best["openblas"][str(m)] if "openblas" in best else float("nan")
            size = 2 if s.startswith("panels") else 4  # bytes a weight
            streamed = rate / (2 * m) * size  # GB/s of weights at this rate
            cells.append(f"{rate:6.1f} GF/s {streamed:5.1f} GB/s x{ratio:4.2f}")
        print(f"{m:4d}  " + "".join(f"{c:>26}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
