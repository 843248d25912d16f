"""The BLAS under MLX's CPU backend on Linux: OpenBLAS, and the runner's sgemm dispatch.

The `mlx-cpu` wheel links the netlib reference BLAS it bundles (about 4 GFLOP/s for a
float32 matmul here); libmlx resolves `cblas_sgemm` dynamically, so preloading OpenBLAS
(Debian's `libopenblas0-pthread`) makes the same code ~30x faster with the same results.
`LD_PRELOAD` only works at process start, so the runner re-executes itself once with it set.
`OLLAMA_MLX_RUNNER_BLAS=reference` keeps the bundled BLAS.

Ahead of OpenBLAS goes the runner's own `cblas_sgemm` (runner/native/dispatch.c),
which sends the products OpenBLAS handles badly (one row: decode; a few rows: short
forwards) to the kernels that do them well, and passes everything else through. It is
compiled once with the machine's C compiler into the runner's cache directory; without a
compiler the runner runs on OpenBLAS alone and decode steps take numpy's gemv instead
(runner/backend/gemv.py), which `Backend.for_device` decides by `dispatch_active()`.

Two OpenBLAS thread pools may live in the process: MLX's (preloaded) and numpy's own. An
idle OpenBLAS thread spins on sched_yield for 2**28 cycles (~0.1 s) before sleeping, so each
pool's spinning took the cores from the other's work and from MLX's single-threaded
element-wise ops: with both pools busy, a 16-token forward of Qwen3-0.6B took 1892 ms against
338 ms with `OPENBLAS_THREAD_TIMEOUT=4` (2**4 cycles: threads sleep at once). The re-exec
sets it too, unless it is already set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

from runner.native import build

log = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)
MARKER = "OLLAMA_MLX_RUNNER_BLAS"
THREAD_TIMEOUT = ("OPENBLAS_THREAD_TIMEOUT", "4")


def optimised_blas() -> str | None:
    """The OpenBLAS library to preload on this machine, or None."""
    if not sys.platform.startswith("linux") or os.environ.get(MARKER) == "reference":
        return None
    return next((path for path in CANDIDATES if Path(path).exists()), None)


def preload_libraries() -> list[str]:
    """What to preload, in order: the dispatch (when OpenBLAS is there and it builds), then
    OpenBLAS; empty when the reference BLAS is kept or no OpenBLAS is installed."""
    blas = optimised_blas()
    if blas is None:
        return []
    dispatch = build.library()
    return [dispatch, blas] if dispatch else [blas]


def preload_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when nothing should change."""
    if env.get(MARKER):
        return None
    libraries = preload_libraries()
    if not libraries:
        return None
    changes = {}
    preloaded = env.get("LD_PRELOAD", "").split(":")
    missing = [lib for lib in libraries if lib not in preloaded]
    if missing:
        changes["LD_PRELOAD"] = ":".join([*missing, *(p for p in preloaded if p)])
    name, value = THREAD_TIMEOUT
    if name not in env:
        changes[name] = value
    if not changes:
        return None
    return {**env, **changes, MARKER: libraries[-1]}


def reexec_preloaded(module: str, argv: list[str]) -> None:
    """Re-execute `python -m module *argv` once with the preloads, when they change anything
    (LD_PRELOAD acts only at process start): for the bench programs."""
    env = preload_env(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def dispatch_active() -> bool:
    """Whether the runner's sgemm dispatch is in this process (preloaded)."""
    try:
        return hasattr(ctypes.CDLL(None), build.DISPATCH_SYMBOL)
    except OSError:
        return False


def describe() -> str:
    """Which BLAS this process uses, for the start-up log."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    library = next((p for p in CANDIDATES if p in preloaded.split(":")), None)
    if library:
        dispatch = " behind the runner's sgemm dispatch" if dispatch_active() else ""
        return f"OpenBLAS ({library}) preloaded over the mlx-cpu reference BLAS{dispatch}"
    if sys.platform.startswith("linux"):
        return "the mlx-cpu reference BLAS (install libopenblas0-pthread for ~30x faster matmul)"
    return "the platform BLAS"


if __name__ == "__main__":  # scripts/test: what to preload for an in-process test run
    print(":".join(preload_libraries()))
