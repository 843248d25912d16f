"""Building the runner's native library: the sgemm dispatch and the decoder step
(runner/native/*.c), compiled once per source, flags and CPU with the machine's C compiler
into the runner's cache directory (`$OLLAMA_MLX_RUNNER_CACHE` or ~/.cache/ollama-mlx-runner,
then `native/`). runner/native/preload.py decides whether the process preloads it.
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
from pathlib import Path

from runner.sources.default_model import cache_root

log = logging.getLogger(__name__)

DISPATCH_SOURCE = Path(__file__).parent / "sgemm_dispatch.c"
DISPATCH_SYMBOL = "runner_sgemm_dispatch_version"
DISPATCH_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC", "-pthread")


def library(cache_dir: Path | None = None) -> str | None:
    """The compiled sgemm dispatch library, building it on first use; None when no C
    compiler is found or the build fails (the reason is logged)."""
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
