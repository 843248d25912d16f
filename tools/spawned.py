"""A runner spawned as a supervisor would, and plain HTTP to it: shared by tests, bench, demo.

`SpawnedRunner(*flags)` starts `python -m runner FLAGS --port P` on a free port with its
output in a log file (never a pipe nobody reads), `wait_ready()` polls /v1/status every
100 ms as the Go supervisor does, `stop()` sends SIGINT and waits. The HTTP helpers use plain
`urllib` (no event loop to share with MLX) and follow a 307/308 with the same method and
body, as Go's client does; `HTTPStatus` carries a non-2xx answer. `KeptConnection` posts a
series of requests over one kept connection, as a supervisor's client does (the bench's
per-request latencies).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
READY_POLL_SECONDS = 0.1
REQUEST_TIMEOUT_SECONDS = 3600.0


class HTTPStatus(Exception):
    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url} answered {status}: {body.strip()[:200]}")
        self.status = status
        self.body = body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_post(url: str, data: bytes, timeout: float = REQUEST_TIMEOUT_SECONDS) -> Any:
    """POST `data`; follow 307/308 with the same body. Returns the open response; a non-2xx
    answer raises HTTPStatus. `.redirects` on the response lists the statuses followed."""
    followed = []
    for _ in range(3):
        request = urllib.request.Request(url, data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            response = urllib.request.urlopen(request, timeout=timeout)
            response.redirects = followed
            return response
        except urllib.error.HTTPError as e:
            if e.code not in (307, 308):
                raise HTTPStatus(url, e.code, e.read().decode(errors="replace")) from None
            followed.append(e.code)
            url = urllib.parse.urljoin(url, e.headers["Location"])
    raise HTTPStatus(url, 310, "too many redirects")


def post_json(url: str, body: Any, timeout: float = REQUEST_TIMEOUT_SECONDS) -> Any:
    with open_post(url, json.dumps(body).encode(), timeout) as response:
        return json.loads(response.read())


def post_jsonl(url: str, body: Any, timeout: float = REQUEST_TIMEOUT_SECONDS) -> Iterator[dict]:
    """One decoded object per non-empty line of a streamed answer."""
    with open_post(url, json.dumps(body).encode(), timeout) as response:
        for line in response:
            if line.strip():
                yield json.loads(line)


class KeptConnection:
    """POSTs of JSON over one HTTP/1.1 connection kept open between requests, as a Go
    supervisor's `http.Client` keeps its connections: `post_json` opens a new TCP
    connection (and urllib's machinery) for every request, ~1-3 ms of a decision request
    on the 2-core VM. No redirects; a dropped connection is opened again once."""

    def __init__(self, base_url: str, timeout: float = REQUEST_TIMEOUT_SECONDS):
        parts = urllib.parse.urlsplit(base_url)
        self.base_url, self.host, self.port = base_url, parts.hostname, parts.port
        self.timeout = timeout
        self._connection: http.client.HTTPConnection | None = None

    def post_json(self, path: str, body: Any) -> Any:
        data = json.dumps(body).encode()
        for attempt in (0, 1):
            if self._connection is None:
                self._connection = http.client.HTTPConnection(
                    self.host or "127.0.0.1", self.port, timeout=self.timeout
                )
            try:
                self._connection.request(
                    "POST", path, body=data, headers={"Content-Type": "application/json"}
                )
                response = self._connection.getresponse()
                answer = response.read()
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
                continue
            if not 200 <= response.status < 300:
                text = answer.decode(errors="replace")
                raise HTTPStatus(self.base_url + path, response.status, text)
            return json.loads(answer)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, so a killed test or
    benchmark leaves no runner behind holding gigabytes."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class SpawnedRunner:
    """`python -m runner *flags --port P` (P free, unless `port` is given), output in a log;
    `checkout`: another checkout of the runner to run (a bench comparing two commits), else
    this one."""

    def __init__(
        self,
        *flags: str,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        port: int | None = None,
        port_flag: str = "--port",
        checkout: Path | None = None,
    ):
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        # a log of our own making is read back and removed on exit (the test suite spawns
        # hundreds of runners: their logs would pile up in the temporary directory)
        self._owns_log = log_path is None
        self._kept: str | None = None
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="runner-", suffix=".log")
            os.close(handle)
            log_path = Path(name)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (lives as long as the process)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runner", *flags, port_flag, str(self.port)],
            cwd=checkout or REPO,  # `python -m runner` runs that checkout's package
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def __enter__(self) -> SpawnedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_log()

    def _close_log(self) -> None:
        self._log.close()
        if self._owns_log and self._kept is None:
            self._kept = self.log_path.read_text(errors="replace")
            self.log_path.unlink(missing_ok=True)

    def wait_ready(self, timeout: float = 600.0) -> dict:
        """/v1/status once it answers 200; raises RuntimeError if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"runner exited with {self.process.returncode}: {self.tail()}")
            try:
                return get_json(self.url + "/v1/status", timeout=1)
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                time.sleep(READY_POLL_SECONDS)
        raise RuntimeError(f"runner not ready after {timeout:.0f} s: {self.tail()}")

    def memory_bytes(self) -> int | None:
        """MLX memory the runner reports in /v1/status."""
        try:
            return int(get_json(self.url + "/v1/status")["Memory"])
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, KeyError):
            return None

    def output(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        if self._kept is not None:
            return self._kept
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 5) -> str:
        return " | ".join(self.output().strip().splitlines()[-lines:])

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 10.0) -> int:
        """Signal the runner and wait for it (killed after `timeout`); its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()
        return self.process.returncode
