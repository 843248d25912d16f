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
(runner/native/dispatch.c ahead of OpenBLAS, as the runner runs), `dispatch-1t` (the
same on one thread: the kernel's efficiency, less sensitive to a busy second core), `panels`
and `panels-1t` (the native step's products on exact float16 copies stored as panels,
`runner_weight_product`: what a checkpoint stored in half precision gets; half the bytes, so
their GB/s column counts two bytes a weight), `f16-rows`, `f16-rows-1t` and their `-decode`
(the same values as a GGUF's F16 matrix stored by rows, W_GF16: made into panels a block at
a time, a decode step's rows by the rows' stream tiles), `q2`, `q3`, `q4`, `q5`, `q6`, `q8`
and their `-1t` (the native
step's products on MLX's affine quantization, group 64, float16 scales and biases, read as
MLX stores it: runner/native/quantized.c; their GB/s column counts the codes, scales and
biases), `q4k`, `q5k`, `q6k`, `q3k`, `q2k`, `iq4xs`, `iq4nl` and their `-1t` (GGML's Q4_K,
Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS and IQ4_NL blocks as a GGUF stores them, read by the same
library; random blocks, rows of whole blocks only: the Qwen3 shape, and SmolLM2's for IQ4_NL's
blocks of 32), `iq2xxs`, `iq2xs`, `iq2s`, `iq3xxs`, `iq3s`, `iq1s`, `iq1m` and their `-1t`
(the grid i-quants' blocks, the same way), `q4k-decode`, `q5k-decode`, `q6k-decode`,
`q3k-decode`, `q2k-decode`, `iq4xs-decode`, `q5-decode`, the grid i-quants' (`iq3s-decode`
and the like) and their `-1t` (the same products as
a decode step's rows: by integer limbs where the library has them, runner_limb_products), any
of these with `-noamx` after it (`q4k-noamx`, `q4k-1t-noamx`: with OLLAMA_MLX_RUNNER_AMX=0,
the float tiles where Intel's AMX tiles would take Q4_K's rows: runner/native/amx.c), and
`mlx-q4`, `mlx-q8` (MLX's own CPU `quantized_matmul` on the same weights); `fp4`, `fp4-1t`
and `mlx-fp4` the same for MLX's mxfp4 mode (gpt-oss's experts; `--shape
gpt-oss-20b-experts`: the 4 experts a gpt-oss-20b token chooses in each of 4 layers). `--library
FILE` runs another build of the library instead of this CPU's (x86-64-v3's, what an AVX2-only
CPU runs: `bench.decode_builds`' `library_for`).

    python -m bench.sgemm --rows 1,15,40 --settings openblas,dispatch,panels
    python -m bench.sgemm --shape qwen3-0.6b --rows 1,8,18,128 --settings panels,f16-rows
    python -m bench.sgemm --rows 1,16,128,512 --settings dispatch,panels,q4,mlx-q4
    python -m bench.sgemm --shape qwen3-0.6b --rows 1,2,18 --settings q4k-1t,q6k-1t,q4-1t
    python -m bench.sgemm --shape qwen3-0.6b --rows 1,2 --settings q4k-1t,q4k-decode-1t
    python -m bench.sgemm --shape qwen3-0.6b --rows 18 --settings q4k --library /tmp/v3.so
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (out, in) of each product in a layer, and the layer count: q/o, k/v, gate/up, down.
SHAPES = {
    "smollm2-135m": ([(576, 576), (192, 576), (192, 576), (576, 576),
                      (1536, 576), (1536, 576), (576, 1536)], 30),
    "qwen3-0.6b": ([(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048),
                    (3072, 1024), (3072, 1024), (1024, 3072)], 28),
    "tiny": ([(48, 32), (16, 32), (16, 32), (32, 48), (72, 32), (72, 32), (32, 72)], 2),  # tests
    "tiny-blocks": ([(24, 256), (8, 256), (8, 256), (16, 256), (40, 256), (40, 256), (16, 512)], 2),
    # gpt-oss-20b's experts as a token meets them: the 4 it chooses a layer, each its fused
    # gate/up [5760, 2880] and its down [2880, 2880]; 4 of its 24 layers (212 MB as mxfp4)
    "gpt-oss-20b-experts": ([(5760, 2880), (2880, 2880)] * 4, 4),
}  # fmt: skip
SETTINGS = ("openblas", "dispatch", "dispatch-1t", "panels", "panels-1t")
EXTRA_SETTINGS = (
    *("f16-rows", "f16-rows-1t", "f16-rows-decode", "f16-rows-decode-1t"),
    *("q4", "q5", "q8", "q4k", "q4k-1t", "q5k", "q5k-1t", "q6k", "q6k-1t"),
    *("q3k", "q3k-1t", "q2k", "q2k-1t", "iq4xs", "iq4xs-1t", "iq4nl", "iq4nl-1t"),
    *("q3k-decode", "q2k-decode", "q3k-decode-1t", "q2k-decode-1t"),
    *("iq4xs-decode", "iq4xs-decode-1t"),
    *(f"{g}-decode{end}" for g in ("iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s", "iq1m")
      for end in ("", "-1t")),
    *("q4k-decode", "q5k-decode", "q6k-decode", "q4k-decode-1t", "q5k-decode-1t", "q6k-decode-1t"),
    *("q5-decode", "q5-decode-1t"),
    *(f"q{b}{end}" for b in (2, 3, 6) for end in ("", "-1t", "-decode", "-decode-1t")),
    *(f"q{b}{end}" for b in (4, 8) for end in ("-1t", "-decode", "-decode-1t")),
    *("q4k-noamx", "q4k-1t-noamx"),
    *(f"q{b}{end}-noamx" for b in (2, 3, 4, 5) for end in ("", "-1t")),
    *("mlx-q4", "mlx-q8"),
    *("fp4", "fp4-1t", "mlx-fp4"),
    *(f"{g}{end}" for g in ("iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s", "iq1m")
      for end in ("", "-1t")),
)  # fmt: skip
GROUP = 64  # the affine settings' group size (mlx-lm's default)
# bytes a weight, for the GB/s column
WEIGHT_BYTES = {
    "panels": 2.0, "f16-rows": 2.0, "q2": 0.25, "q3": 0.375, "q4": 0.5, "q5": 0.625, "q6": 0.75,
    "q8": 1.0, "fp4": 0.5 + 1 / 32,
}  # fmt: skip
# GGML blocks: bytes a block of 256 weights (IQ4_NL: of 32, GGML_BLOCK_WEIGHTS)
GGML_BLOCK_BYTES = {
    "q4k": 144, "q5k": 176, "q6k": 210, "q3k": 110, "q2k": 84, "iq4xs": 136, "iq4nl": 18,
    "iq2xxs": 66, "iq2xs": 74, "iq2s": 82, "iq3xxs": 98, "iq3s": 110, "iq1s": 50, "iq1m": 56,
}  # fmt: skip
GGML_BLOCK_WEIGHTS = {"iq4nl": 32}  # where a block is not 256 weights
# where each keeps its float16 d (and dmin) in a block
GGML_HALVES = {
    "q4k": (0, 2), "q5k": (0, 2), "q6k": (208,), "q3k": (108,), "q2k": (80, 82), "iq4xs": (0,),
    "iq4nl": (0,), "iq2xxs": (0,), "iq2xs": (0,), "iq2s": (0,), "iq3xxs": (0,), "iq3s": (0,),
    "iq1s": (0,), "iq1m": (),  # IQ1_M's d: the scale words' top nibbles (random: any d)
}  # fmt: skip


def setting_kind(setting: str) -> str:
    """What a setting's child computes with: sgemm, panels, q4/q5/q8 (the library's affine
    products), q4k/q5k/q6k/q3k/q2k/iq4xs/iq4nl (GGML blocks; `-decode` on these and the affine ones:
    as a decode step's rows, by limbs where the build has them) or mlx-q4/mlx-q8 (MLX's
    quantized_matmul)."""
    base = setting.removesuffix("-noamx").removesuffix("-1t")
    affine = ("q2", "q3", "q4", "q5", "q6", "q8")
    if base.removesuffix("-decode") in (*GGML_BLOCK_BYTES, *affine, "fp4", "f16-rows"):
        return base
    known = ("panels", *WEIGHT_BYTES, "mlx-q4", "mlx-q8", "mlx-fp4")
    return base if base in known else "sgemm"


def weight_bytes(setting: str) -> float:
    kind = setting_kind(setting).removeprefix("mlx-").removesuffix("-decode")
    if kind == "fp4":
        return WEIGHT_BYTES[kind]  # a byte of scale a group of 32
    if kind in ("q2", "q3", "q4", "q5", "q6", "q8"):
        return WEIGHT_BYTES[kind] + 4 / GROUP  # a float16 scale and bias a group
    if kind in GGML_BLOCK_BYTES:
        return GGML_BLOCK_BYTES[kind] / GGML_BLOCK_WEIGHTS.get(kind, 256)
    return WEIGHT_BYTES.get(kind, 4.0)


def child(shape: str, rows: list[int], kind: str = "sgemm") -> dict[str, float]:
    """In a process with the BLAS preloaded: best GFLOP/s per row count."""
    import numpy as np

    from runner.native import abi

    process = ctypes.CDLL(None)
    sgemm = process.cblas_sgemm
    p = ctypes.c_void_p
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, p, ctypes.c_int, p, ctypes.c_int]
    sgemm.argtypes += [ctypes.c_float, p, ctypes.c_int]
    products, layers = SHAPES[shape]
    decode = int(kind.endswith("-decode"))
    kind = kind.removesuffix("-decode")
    rng = np.random.default_rng(0)
    # each layer's operands: float32 weights [n, k], or the panels of float16 values (exact),
    # or MLX's affine quantization of them
    operands: list[list[Any]] = [
        [rng.standard_normal((n, k), dtype=np.float32) for n, k in products] for _ in range(layers)
    ]
    functions = abi.load(process)
    if kind != "sgemm" and functions is None:
        raise SystemExit("the native library is not preloaded (or its ABI differs)")
    for layer in operands:
        for i, w in enumerate(layer):
            if kind == "panels":
                layer[i] = _panels(functions, w.astype(np.float16).astype(np.float32))
            elif kind == "f16-rows":  # a GGUF's F16 matrix as stored (W_GF16)
                stored = np.ascontiguousarray(w.astype(np.float16))
                layer[i] = abi.Weight(format=abi.GF16, data=stored.ctypes.data), stored
            elif kind in GGML_BLOCK_BYTES:
                layer[i] = _ggml_blocks(kind, w.shape, rng)
            elif kind.endswith("fp4"):
                layer[i] = _mxfp4(w, kind.startswith("mlx-"))
            elif kind != "sgemm":
                layer[i] = _affine(w, int(kind[-1]), kind.startswith("mlx-"))

    def multiply(m: int, n: int, k: int, w: Any, a: np.ndarray, c: np.ndarray) -> None:
        if kind == "mlx-fp4":
            import mlx.core as mx

            mx.eval(mx.quantized_matmul(a, *w, transpose=True, group_size=32, bits=4, mode="mxfp4"))
        elif kind.startswith("mlx-"):
            import mlx.core as mx

            mx.eval(
                mx.quantized_matmul(a, *w, transpose=True, group_size=GROUP, bits=int(kind[-1]))
            )
        elif kind != "sgemm":
            functions.weight_product(
                m,
                n,
                k,
                a.ctypes.data_as(abi.F32),
                ctypes.byref(w[0]),
                c.ctypes.data_as(abi.F32),
                decode,
            )
        else:
            sgemm(101, 111, 112, m, n, k, 1.0, a.ctypes.data, k, w.ctypes.data, k,
                  0.0, c.ctypes.data, n)  # fmt: skip

    result = {}
    for m in rows:
        a: dict[int, Any] = {k: rng.standard_normal((m, k), dtype=np.float32) for _, k in products}
        if kind.startswith("mlx-"):
            import mlx.core as mx

            a = {k: mx.array(x) for k, x in a.items()}
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


def _ggml_blocks(kind: str, shape: tuple[int, int], rng: Any) -> Any:
    """Random GGML Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL or grid i-quant blocks of
    `shape` (their float16 d, dmin set to 0.01, the rest random bytes: any codes and scales
    take the tiles' time), as a step_weight with its array."""
    import numpy as np

    from runner.native import abi

    n, k = shape
    weights = GGML_BLOCK_WEIGHTS.get(kind, 256)
    if k % weights:
        raise SystemExit(f"{kind}: rows of {k} weights are not whole blocks of {weights}")
    size = GGML_BLOCK_BYTES[kind]
    blocks = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for at in GGML_HALVES[kind]:
        blocks[:, :, at : at + 2] = half
    form = {
        "q4k": abi.Q4K, "q5k": abi.Q5K, "q6k": abi.Q6K, "q3k": abi.Q3K, "q2k": abi.Q2K,
        "iq4xs": abi.IQ4XS, "iq4nl": abi.IQ4NL, "iq2xxs": abi.IQ2XXS, "iq2xs": abi.IQ2XS,
        "iq2s": abi.IQ2S, "iq3xxs": abi.IQ3XXS, "iq3s": abi.IQ3S, "iq1s": abi.IQ1S,
        "iq1m": abi.IQ1M,
    }[kind]  # fmt: skip
    return abi.Weight(format=form, data=blocks.ctypes.data), blocks


def _panels(functions: Any, exact: Any) -> Any:
    """The float16 panels of `exact` (float32 values float16 holds), as a step_weight."""
    import numpy as np

    from runner.native import abi

    n, k = exact.shape
    panels = np.empty(functions.panel_halves(n, k), np.uint16)
    if not functions.narrow_panels(exact.ctypes.data_as(abi.F32), n, k, panels.ctypes.data, 1):
        raise SystemExit("a float16 value did not survive the narrowing")
    return abi.Weight(format=abi.HALF_FORMATS["float16"], data=panels.ctypes.data), panels


def _mxfp4(w: Any, for_mlx: bool) -> Any:
    """`w` in MLX's mxfp4 mode (e2m1 codes, an e8m0 scale a group of 32, no biases: gpt-oss's
    experts): MLX's arrays (for_mlx), or a step_weight over them with the arrays."""
    import mlx.core as mx
    import numpy as np

    from runner.native import abi

    q, s = mx.quantize(mx.array(w), 32, 4, mode="mxfp4")
    mx.eval(q, s)
    if for_mlx:
        return q, s
    arrays = [np.array(x) for x in (q, s)]
    weight = abi.Weight(
        format=abi.AFFINE, bits=4, group=32, scale_format=abi.E8M0,
        data=arrays[0].ctypes.data, scales=arrays[1].ctypes.data, biases=None,
    )  # fmt: skip
    return weight, arrays


def _affine(w: Any, bits: int, for_mlx: bool) -> Any:
    """`w` quantized as mlx-lm does (affine, GROUP, float16 scales and biases): MLX's arrays
    (for_mlx), or a step_weight over them with the arrays it points into."""
    import mlx.core as mx
    import numpy as np

    from runner.native import abi

    q, s, b = mx.quantize(mx.array(w), GROUP, bits)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    mx.eval(q, s, b)
    if for_mlx:
        return q, s, b
    arrays = [np.array(x) for x in (q, s, b)]
    weight = abi.Weight(
        format=abi.AFFINE, bits=bits, group=GROUP, scale_format=abi.SCALE_FORMATS["float16"],
        data=arrays[0].ctypes.data, scales=arrays[1].ctypes.data, biases=arrays[2].ctypes.data,
    )  # fmt: skip
    return weight, arrays


def run_setting(
    setting: str, shape: str, rows: list[int], dispatch: str | None = None
) -> dict[str, float]:
    """Best GFLOP/s per row count of `setting` in a child process, with `dispatch` (a library
    file; None: the one the runner builds for this CPU) preloaded."""
    from runner.native import build, preload

    library = preload.optimised_blas()
    if library is None:
        raise SystemExit("needs Linux with Debian's libopenblas0-pthread")
    env = {**os.environ, preload.MARKER: library, "OPENBLAS_THREAD_TIMEOUT": "4"}
    if setting == "openblas":
        env["LD_PRELOAD"] = library
    else:
        dispatch = dispatch or build.library()
        if dispatch is None:
            raise SystemExit("the sgemm dispatch did not build (no C compiler?)")
        env["LD_PRELOAD"] = f"{dispatch}:{library}"
        if setting.endswith("-noamx"):  # the float tiles where AMX would take Q4_K's rows
            env["OLLAMA_MLX_RUNNER_AMX"] = "0"
        if setting.removesuffix("-noamx").endswith("-1t"):
            env["RUNNER_BLAS_THREADS"] = "1"
            env["OPENBLAS_NUM_THREADS"] = "1"
    if setting.startswith("mlx-"):
        env.pop("RUNNER_BLAS_THREADS", None)  # MLX's CPU kernels: its own threads
    command = [sys.executable, "-m", "bench.sgemm", "--child", shape, ",".join(map(str, rows))]
    command.append(setting_kind(setting))
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(argv[1], [int(m) for m in argv[2].split(",")], argv[3])))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.sgemm", description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--rows", default="1,4,8,20,40")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"of {', '.join(SETTINGS + EXTRA_SETTINGS)}",
    )
    p.add_argument(
        "--library",
        help="the native library file to run (another level's build, e.g. x86-64-v3's from "
        "bench.decode_builds' library_for), instead of this CPU's",
    )
    args = p.parse_args(argv)
    if args.library and not Path(args.library).is_file():
        raise SystemExit(f"no library at {args.library}")
    rows = [int(m) for m in args.rows.split(",")]
    settings = args.settings.split(",")
    best: dict[str, dict[str, float]] = {s: {} for s in settings}
    for _ in range(args.rounds):  # interleaved: the machine's load drifts
        for setting in settings:
            for m, rate in run_setting(setting, args.shape, rows, args.library).items():
                best[setting][m] = max(best[setting].get(m, 0.0), rate)
    products, layers = SHAPES[args.shape]
    megabytes = sum(n * k for n, k in products) * layers * 4 / 1e6
    print(
        f"shape {args.shape}: {megabytes:.0f} MB of float32 weights, best of {args.rounds} "
        f"rounds, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print("rows  " + "".join(f"{s:>26}" for s in settings))
    for m in rows:
        cells = []
        for s in settings:
            rate = best[s][str(m)]
            ratio = rate / best["openblas"][str(m)] if "openblas" in best else float("nan")
            streamed = rate / (2 * m) * weight_bytes(s)  # GB/s of weights at this rate
            cells.append(f"{rate:6.1f} GF/s {streamed:5.1f} GB/s x{ratio:4.2f}")
        print(f"{m:4d}  " + "".join(f"{c:>26}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
