"""The machine a run happened on, and its measured float32 matmul rate in MLX.

`describe()` is a plain dict (CPU model, cores, backend, BLAS as runner/native/preload.py
reports it, package versions, the runner's git commit); `matmul_rates(engine)` times square
matmuls on the MLX thread and returns GFLOP/s per case (2·n³ FLOPs each).
`dispatch_level()` is the instruction-set level of the runner's native dispatch in this
process (in `describe()` too), `llama_cpp_info()` llama.cpp's own account of its build
(`llama_print_system_info()`), read in a process of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import importlib.util
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from runner.native import preload

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("mlx", "mlx-lm", "torch", "transformers", "tokenizers", "numpy")
MATMUL_CASES = {
    "default": (("float32", 1024), ("float32", 2048), ("bfloat16", 1024)),
    "small": (("float32", 1024),),  # quick even on the reference BLAS (~4 GFLOP/s)
}
MATMUL_TRIALS = 5
MATMUL_SECONDS = 2.0  # fewer trials once a case has taken this long
PROBE_SIZES = {"default": 1024, "small": 256}  # RateProbe
PROBE_TRIALS = 2


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=5
    )
    return done.stdout.strip()


def _git_commit() -> str | None:
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{' (modified)' if dirty else ''}" if head else None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, Arm `Features`); empty
    elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The dispatch's levels (runner_native.h `runner_native_level()`), in words.
LEVELS = {
    "avx512": "AVX-512 (256-bit vectors and half panels, 512-bit wide panel tiles)",
    "avx2": "AVX2 (256-bit vectors, half panels)",
    "avx": "AVX (256-bit vectors, no half panels)",
    "sse": "SSE2 (128-bit vectors, no half panels)",
    "neon": "NEON (128-bit vectors, no half panels)",
    "generic": "generic vectors, no half panels",
}
# What tells that the runner's library is in the process, newest first.
VERSION_SYMBOLS = ("runner_native_abi_version", "runner_sgemm_dispatch_version")


def dispatch_level(flags: set[str] | None = None, library: object | None = None) -> str:
    """The instruction-set level of the runner's native dispatch in this process (its
    library, built with -march=native), in words, and where the level came from.

    A library that exports `runner_native_level()` says it. An older one exports only its
    version and whether its products read half-precision panels (`runner_half_weights`:
    AVX2 + F16C with 256-bit vectors); the rest is then derived from the CPU's flags the way
    its compile-time choice follows the macros -march=native defines: 256-bit vectors
    wherever there is AVX (AVX-512 CPUs included), with AVX-512F the wide (512-bit) panel
    tiles beside them, 128-bit vectors otherwise."""
    if library is None:
        try:
            library = ctypes.CDLL(None)
        except OSError:
            return "not loaded"
    symbol = next((name for name in VERSION_SYMBOLS if hasattr(library, name)), None)
    if symbol is None:
        return "not loaded (OpenBLAS or the reference BLAS alone)"
    version = getattr(library, symbol)()
    if hasattr(library, "runner_native_level"):
        level_of = library.runner_native_level
        with contextlib.suppress(AttributeError):  # a ctypes function: it returns a string
            level_of.restype = ctypes.c_char_p
        level = level_of()
        level = level.decode() if isinstance(level, bytes) else str(level)
        source = "runner_native_level()"
    else:
        half = hasattr(library, "runner_half_weights") and bool(library.runner_half_weights())
        flags = cpu_flags() if flags is None else flags
        if half:
            level = "avx512" if "avx512f" in flags else "avx2"
        elif "avx" in flags:
            level = "avx"
        elif "sse2" in flags:
            level = "sse"
        elif flags & {"asimd", "neon"}:
            level = "neon"
        else:
            level = "generic"
        source = "derived from the CPU's flags"
    limbs = ""  # decode steps' Q4_K / Q6_K products by 8-bit limbs (docs/DESIGN.md §4.4)
    if hasattr(library, "runner_limb_products"):
        limbs = "; decode by limbs" if library.runner_limb_products() else "; decode in float32"
    return f"{LEVELS.get(level, level)}; {symbol}() {version}, level {source}{limbs}"


LLAMA_CPP_INFO = """
import llama_cpp
print(llama_cpp.__version__)
print(llama_cpp.llama_print_system_info().decode(errors="replace").strip())
"""


def llama_cpp_info() -> dict[str, str] | None:
    """llama-cpp-python's version and llama.cpp's `llama_print_system_info()` (the features
    its build uses: AVX512, AMX_INT8, REPACK, ...), from a process of its own as the llama.cpp
    systems run; None when llama-cpp-python is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", LLAMA_CPP_INFO], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as e:
        return {"version": "?", "system_info": f"not read: {e!r}"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " ".join((done.stderr or "").strip().splitlines()[-1:])
        return {"version": "?", "system_info": f"not read (exit {done.returncode}): {tail}"}
    return {"version": lines[0], "system_info": " ".join(" ".join(lines[1:]).split())}


def describe() -> dict[str, object]:
    import mlx.core as mx

    versions = {p: _version(p) for p in PACKAGES}
    versions["runner"] = _version("ollama-mlx-runner")
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "backend": str(mx.default_device()),
        "blas": preload.describe(),
        "versions": versions,
        "runner_commit": _git_commit(),
        "dispatch": dispatch_level(),
    }


def matmul_rates(engine, size: str = "default") -> dict[str, float]:
    """GFLOP/s of n×n @ n×n in MLX per (dtype, n), median of a few trials after a warm-up."""

    def measure(_job) -> dict[str, float]:
        import mlx.core as mx

        rates = {}
        for dtype_name, n in MATMUL_CASES[size]:
            dtype = getattr(mx, dtype_name)
            a = mx.random.normal((n, n), key=mx.random.key(0)).astype(dtype)
            b = mx.random.normal((n, n), key=mx.random.key(1)).astype(dtype)
            mx.eval(a, b, a @ b)
            times: list[float] = []
            while len(times) < MATMUL_TRIALS and sum(times) < MATMUL_SECONDS:
                start = time.perf_counter()
                mx.eval(a @ b)
                times.append(time.perf_counter() - start)
            rates[f"{dtype_name} {n}^3"] = 2 * n**3 / statistics.median(times) / 1e9
        return rates

    return engine.call(measure)


class RateProbe:
    """The float32 matmul rate at this moment: the better of PROBE_TRIALS products of square
    matrices (default size: 1024², ~25 ms at this VM's ~170 GFLOP/s), on `engine`'s thread. The
    harness takes it between our runner's latency requests, whose own cost is then reckoned
    at the rate of their own moment: this VM's rate moves by a third between phases that
    last from seconds to minutes, and a best rate measured minutes away counts the slow
    phase's arithmetic as the runner's own."""

    def __init__(self, engine, size: str = "default") -> None:
        self.engine = engine
        self.n = PROBE_SIZES[size]
        self.operands = None

    def __call__(self) -> float:
        return self.engine.call(self._measure)

    def _measure(self, _job) -> float:
        import mlx.core as mx

        n = self.n
        if self.operands is None:
            a = mx.random.normal((n, n), key=mx.random.key(0))
            b = mx.random.normal((n, n), key=mx.random.key(1))
            mx.eval(a, b, a @ b)
            self.operands = (a, b)
        a, b = self.operands
        best = math.inf
        for _ in range(PROBE_TRIALS):
            start = time.perf_counter()
            mx.eval(a @ b)
            best = min(best, time.perf_counter() - start)
        return 2 * n**3 / best / 1e9


def peak_gflops(rates: dict[str, float]) -> float | None:
    """The best float32 rate measured: the reference for a system's share of the machine."""
    return max((v for k, v in rates.items() if k.startswith("float32")), default=None)


def format_machine(
    info: dict[str, object], rates: dict[str, float], llama_cpp: dict[str, str] | None = None
) -> list[str]:
    """The header: the machine, the BLAS, versions, then the matmul rates with the runner's
    dispatch level and llama.cpp's build beside them."""
    versions = info["versions"]
    assert isinstance(versions, dict)
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    lines = [
        f"machine: {info['cpu']}, {info['cores']} cores, {info['platform']}, "
        f"Python {info['python']}",
        f"backend: MLX {info['backend']}; BLAS: {info['blas']}",
        f"versions: {shown}; runner commit {info['runner_commit']}",
    ]
    if rates:
        lines.append("matmul: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in rates.items()))
    if info.get("dispatch"):
        lines.append(f"dispatch: {info['dispatch']}")
    if llama_cpp is not None:
        lines.append(
            f"llama.cpp: llama-cpp-python {llama_cpp['version']}; {llama_cpp['system_info']}"
        )
    return lines
