"""The BLAS under MLX's CPU backend on Linux: OpenBLAS, and the runner's sgemm dispatch.

The `mlx-cpu` wheel links the netlib reference BLAS it bundles (about 4 GFLOP/s for a
float32 matmul here); libmlx resolves `cblas_sgemm` dynamically, so preloading OpenBLAS
(Debian's `libopenblas0-pthread`) makes the same code ~30x faster with the same results.
`LD_PRELOAD` only works at process start, so the runner re-executes itself once with it set.
`OLLAMA_MLX_RUNNER_BLAS=reference` keeps the bundled BLAS.

Ahead of OpenBLAS goes the runner's own `cblas_sgemm` (runner/native/sgemm_dispatch.c),
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

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)
MARKER = "OLLAMA_MLX_RUNNER_BLAS"
THREAD_TIMEOUT = ("OPENBLAS_THREAD_TIMEOUT", "4")
DISPATCH_SOURCE = Path(__file__).parent / "native" / "sgemm_dispatch.c"
DISPATCH_SYMBOL = "runner_sgemm_dispatch_version"
DISPATCH_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC", "-pthread")


def optimised_blas() -> str | None:
    """The OpenBLAS library to preload on this machine, or None."""
    if not sys.platform.startswith("linux") or os.environ.get(MARKER) == "reference":
        return None
    return next((path for path in CANDIDATES if Path(path).exists()), None)


def sgemm_dispatch(cache_dir: Path | None = None) -> str | None:
    """The compiled sgemm dispatch library, building it on first use; None when no C
    compiler is found or the build fails (the reason is logged)."""
    from runner.default_model import cache_root

    # Built for this CPU (-march=native): the name keys the source, the flags and the CPU.
    sources = sorted(DISPATCH_SOURCE.parent.glob("*.c"))  # the dispatch and what it includes
    source = b"".join(path.read_bytes() for path in sources)
    source += " ".join(DISPATCH_FLAGS).encode() + _cpu().encode()
    digest = hashlib.sha256(source).hexdigest()[:12]
    target = (cache_dir or cache_root() / "native") / f"sgemm_dispatch-{digest}.so"
    if target.exists():
        with contextlib.suppress(OSError):
            os.utime(target)  # in use: not stale for another version's clean-up below
        return str(target)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: MLX's one-row products stay in OpenBLAS's sgemm")
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            command = [compiler, *DISPATCH_FLAGS, "-o", str(built), str(DISPATCH_SOURCE)]
            subprocess.run([*command, "-ldl", "-lm"], check=True, capture_output=True, timeout=120)
            built.replace(target)  # atomic: a concurrent build leaves one complete file
        _remove_stale(target)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build the sgemm dispatch (%s); using OpenBLAS alone", e)
        return None
    return str(target)


STALE_AFTER_S = 14 * 24 * 3600


def _remove_stale(target: Path) -> None:
    """Remove other builds (an older source's, another CPU's) unused for two weeks: another
    installed version of the runner sharing the cache directory keeps its own (each use
    refreshes a build's time), and a running process keeps its mapped copy anyway."""
    now = time.time()
    for stale in target.parent.glob("sgemm_dispatch-*.so"):
        with contextlib.suppress(OSError):
            if stale != target and now - stale.stat().st_mtime > STALE_AFTER_S:
                stale.unlink()


def _cpu() -> str:
    """What identifies this CPU's instruction set (the model name and flags on Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = ("model name", "flags", "Features")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def preload_libraries() -> list[str]:
    """What to preload, in order: the dispatch (when OpenBLAS is there and it builds), then
    OpenBLAS; empty when the reference BLAS is kept or no OpenBLAS is installed."""
    library = optimised_blas()
    if library is None:
        return []
    dispatch = sgemm_dispatch()
    return [dispatch, library] if dispatch else [library]


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
        return hasattr(ctypes.CDLL(None), DISPATCH_SYMBOL)
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
