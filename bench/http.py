"""Talking to a runner over HTTP: spawn one as a supervisor would, POST JSON, read JSONL.

Plain `urllib` (no event loop to share with MLX); a 307/308 is followed with the same body,
as Go's client does. `HTTPStatus` carries a non-2xx answer so callers can tell "this endpoint
is not there" (404/405/501) from a real failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_SECONDS = 600.0
READY_POLL_SECONDS = 0.1
STOP_TIMEOUT_SECONDS = 10.0
REQUEST_TIMEOUT_SECONDS = 3600.0
MISSING_ENDPOINT = (404, 405, 501)


class HTTPStatus(Exception):
    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url} answered {status}: {body.strip()[:200]}")
        self.status = status
        self.body = body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _open(url: str, body: Any, timeout: float) -> Any:
    data = json.dumps(body).encode()
    for _ in range(3):
        request = urllib.request.Request(url, data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as e:
            if e.code not in (307, 308):
                raise HTTPStatus(url, e.code, e.read().decode(errors="replace")) from None
            url = urllib.parse.urljoin(url, e.headers["Location"])
    raise HTTPStatus(url, 310, "too many redirects")


def post_json(url: str, body: Any, timeout: float = REQUEST_TIMEOUT_SECONDS) -> Any:
    with _open(url, body, timeout) as response:
        return json.loads(response.read())


def post_jsonl(url: str, body: Any, timeout: float = REQUEST_TIMEOUT_SECONDS) -> Iterator[dict]:
    """One decoded object per non-empty line of a streamed answer."""
    with _open(url, body, timeout) as response:
        for line in response:
            if line.strip():
                yield json.loads(line)


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the benchmark process dies, so a
    killed run (e.g. out of memory) leaves no runner behind holding gigabytes."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class SpawnedRunner:
    """`python -m runner --model DIR --port P`, ready once /v1/status answers 200."""

    def __init__(self, model_dir: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log: BinaryIO = open(log_path, "wb")  # noqa: SIM115 (lives as long as the process)
        command = [sys.executable, "-m", "runner", "--model", str(model_dir)]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port)],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"runner exited with {self.process.returncode}: {self.tail()}")
            try:
                get_json(self.url + "/v1/status", timeout=1)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                time.sleep(READY_POLL_SECONDS)
        raise RuntimeError(f"runner not ready after {timeout:.0f} s: {self.tail()}")

    def memory_bytes(self) -> int | None:
        """MLX memory the runner reports in /v1/status."""
        try:
            return int(get_json(self.url + "/v1/status")["Memory"])
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, KeyError):
            return None

    def tail(self, lines: int = 5) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
