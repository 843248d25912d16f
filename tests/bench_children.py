"""What runs in the child processes of tests/test_bench_failures.py's fake systems: kept apart
from the test module so that a spawned child imports only this (and bench.base), no MLX."""

from __future__ import annotations

import os
import resource
import signal
import sys
from typing import Any

from bench.base import GenerateOutcome, ScoreOutcome

# A line echoed back for each line read, until stdin closes: the child of a fake system that
# talks to its own process over pipes.
ECHO = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()\n"
AMX_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |"


def _answer(method: str, args: tuple) -> Any:
    if method == "score":
        rows = args[0]
        values = [[0.0] * len(row.candidates) for row in rows]
        return ScoreOutcome(values, len(rows), 0, request_seconds=[0.001] * len(rows))
    return GenerateOutcome("", 1, 1, 0.001, 0.001, 1)


def serve_then_fault(connection: Any, path: str, max_tokens: int, kv_type: str | None) -> None:
    """A stand-in for bench/llamacpp.py `_serve`: ready with an AMX build's system info, the
    first call (the warm-up) answered, then SIGILL on the second, as llama.cpp's AMX kernels
    died on the Intel VM (no core file)."""
    connection.send(("ready", AMX_BUILD))
    calls = 0
    while (call := connection.recv()) is not None:
        calls += 1
        if calls == 2:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGILL)
        connection.send(("ok", _answer(*call)))
