"""Building the runner's native library (runner/native/*.c: the sgemm dispatch, its pool and
tiles, the decoder step; runner_native.h is its ABI), compiled once per source, flags and CPU
with the machine's C compiler into the runner's cache directory (`$OLLAMA_MLX_RUNNER_CACHE` or
~/.cache/ollama-mlx-runner, then `native/`). runner/native/preload.py decides whether the
process preloads it; runner/native/abi.py binds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from runner.sources.default_model import cache_root

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
# What tells that the library is in the process (preloaded): runner_native.h's version.
DISPATCH_SYMBOL = "runner_native_abi_version"
# Built for this CPU: -march=native chooses the instruction-set path (internal.h: 256-bit
# vectors wherever there is AVX, half panels with AVX2 + F16C, wide tiles with AVX-512).
MARCH = "-march=native"
DISPATCH_FLAGS = (
    "-O3",
    MARCH,
    "-ffp-contract=fast",
    "-fvisibility=hidden",
    "-shared",
    "-fPIC",
    "-pthread",
)
PREFIX = "runner_native-"
STALE_PREFIXES = (PREFIX, "sgemm_dispatch-")  # the latter: builds of earlier versions


def sources() -> list[Path]:
    """Every source of the library: one per job, built into one library."""
    return sorted(SOURCE_DIR.glob("*.c"))


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_library(target: Path, flags: Sequence[str] = DISPATCH_FLAGS, cc: str | None = None):
    """Compile every source into `target` with `flags` (atomically: a concurrent build leaves
    one complete file). Raises OSError / subprocess.SubprocessError (CalledProcessError's
    stderr says why)."""
    cc = cc or compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [cc, *flags, f"-I{SOURCE_DIR}", "-o", str(built), *map(str, sources())]
        subprocess.run([*command, "-ldl", "-lm"], check=True, capture_output=True, timeout=300)
        built.replace(target)


def library(cache_dir: Path | None = None) -> str | None:
    """The compiled library, building it on first use; None when no C compiler is found or
    the build fails (the reason is logged)."""
    # The name keys the sources and headers, the flags and the CPU.
    key = b"".join(p.read_bytes() for p in [*sources(), *sorted(SOURCE_DIR.glob("*.h"))])
    key += " ".join(DISPATCH_FLAGS).encode() + _cpu().encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    target = (cache_dir or cache_root() / "native") / f"{PREFIX}{digest}.so"
    if target.exists():
        with contextlib.suppress(OSError):
            os.utime(target)  # in use: not stale for another version's clean-up below
        return str(target)
    if compiler() is None:
        log.info("no C compiler: MLX's one-row products stay in OpenBLAS's sgemm")
        return None
    try:
        compile_library(target)
        _remove_stale(target)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build the native library (%s); using OpenBLAS alone", e)
        return None
    return str(target)


STALE_AFTER_S = 14 * 24 * 3600


def _remove_stale(target: Path) -> None:
    """Remove other builds (an older source's, another CPU's) unused for two weeks: another
    installed version of the runner sharing the cache directory keeps its own (each use
    refreshes a build's time), and a running process keeps its mapped copy anyway."""
    now = time.time()
    for prefix in STALE_PREFIXES:
        for stale in target.parent.glob(f"{prefix}*.so"):
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
