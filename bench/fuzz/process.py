"""The runner under test as a process: the tiny random-weight Llama written, a runner spawned
on it as a supervisor would, its resident memory read."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def write_model(path: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.tiny import write_tiny_model

    return write_tiny_model("LlamaForCausalLM", path)


def spawn(model_dir: Path, log_dir: Path, *flags: str) -> Any:
    from tools.spawned import SpawnedRunner

    log_dir.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix="runner-", suffix=".log", dir=log_dir)
    os.close(handle)
    runner = SpawnedRunner("--model", str(model_dir), *flags, log_path=Path(name))
    runner.wait_ready(timeout=300)
    return runner


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
