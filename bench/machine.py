"""The machine a run happened on, and its measured float32 matmul rate in MLX.

`describe()` is a plain dict (CPU model, cores, backend, BLAS as runner/blas.py reports it,
package versions, the runner's git commit); `matmul_rates(engine)` times square matmuls on
the MLX thread and returns GFLOP/s per case (2·n³ FLOPs each).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import statistics
import subprocess
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


def format_machine(info: dict[str, object], rates: dict[str, float]) -> list[str]:
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
    return lines
