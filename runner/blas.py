"""Pick an optimised BLAS for MLX's CPU backend on Linux.

The `mlx-cpu` wheel links the netlib reference BLAS it bundles (about 4 GFLOP/s for a
float32 matmul here); libmlx resolves `cblas_sgemm` dynamically, so preloading OpenBLAS
(Debian's `libopenblas0-pthread`) makes the same code ~30x faster with the same results.
`LD_PRELOAD` only works at process start, so the runner re-executes itself once with it set.
`OLLAMA_MLX_RUNNER_BLAS=reference` keeps the bundled BLAS.

Two OpenBLAS thread pools then live in the process: MLX's (preloaded) and numpy's own, which
decode steps use (runner/models/cpu_gemv.py). An idle OpenBLAS thread spins on sched_yield
for 2**28 cycles (~0.1 s) before sleeping, so each pool's spinning took the cores from the
other's work and from MLX's single-threaded element-wise ops: with both pools busy, a
16-token forward of Qwen3-0.6B took 1892 ms against 338 ms with `OPENBLAS_THREAD_TIMEOUT=4`
(2**4 cycles: threads sleep at once). The re-exec sets it too, unless it is already set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


def preload_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when nothing should change."""
    library = optimised_blas()
    if library is None or env.get(MARKER):
        return None
    changes = {}
    preloaded = env.get("LD_PRELOAD", "")
    if library not in preloaded.split(":"):
        changes["LD_PRELOAD"] = ":".join(p for p in (library, preloaded) if p)
    name, value = THREAD_TIMEOUT
    if name not in env:
        changes[name] = value
    if not changes:
        return None
    return {**env, **changes, MARKER: library}


def describe() -> str:
    """Which BLAS this process uses, for the start-up log."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    library = next((p for p in CANDIDATES if p in preloaded.split(":")), None)
    if library:
        return f"OpenBLAS ({library}) preloaded over the mlx-cpu reference BLAS"
    if sys.platform.startswith("linux"):
        return "the mlx-cpu reference BLAS (install libopenblas0-pthread for ~30x faster matmul)"
    return "the platform BLAS"
