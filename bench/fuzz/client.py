"""HTTP to the runner under test: a POST sent exactly as given and read as the checks need it
(a completions stream only so far), and the `/v1/status` poller, a process of its own."""

from __future__ import annotations

import http.client
import multiprocessing
import queue
import time
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("score", "completions", "tokenize")
PATHS = {"score": "/v1/score", "completions": "/v1/completions", "tokenize": "/v1/tokenize"}
STATUS_LATENCY_LIMIT_S = 0.100
MAX_STREAM_LINES = 96  # a completions stream is read this far, then the client hangs up
REQUEST_TIMEOUT_S = 120.0
MIB = 1 << 20


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""  # a dropped connection, a timeout: no whole answer
    complete: bool = True  # False: the client stopped reading a long stream
    seconds: float = 0.0

    def text(self, limit: int = 300) -> str:
        return self.body[:limit].decode("utf-8", "replace")


def send(port: int, path: str, body: bytes, *, timeout: float = REQUEST_TIMEOUT_S) -> Answer:
    """POST `body` exactly as given; a completions stream is read MAX_STREAM_LINES lines at most."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    answer = Answer()
    try:
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError) as e:
            answer.error = f"send: {type(e).__name__}"  # the server may have answered early
        response = conn.getresponse()
        answer.error = ""
        answer.status = response.status
        answer.headers = {k.lower(): v for k, v in response.getheaders()}
        if answer.headers.get("content-type", "").startswith("application/jsonl"):
            lines = []
            while True:
                line = response.readline()
                if not line:
                    break
                lines.append(line)
                if len(lines) >= MAX_STREAM_LINES:
                    answer.complete = False
                    break
            answer.body = b"".join(lines)
        else:
            answer.body = response.read()
    except (http.client.HTTPException, OSError) as e:
        answer.error = answer.error or f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    answer.seconds = time.perf_counter() - started
    return answer


def _poll_status(port: Any, interval: float, halt: Any, paused: Any, results: Any) -> None:
    """The poller's process: GET /v1/status on one kept-alive connection until `halt`,
    putting (start, seconds, error) for each poll, then None."""
    conn, connected_to = None, None
    while not halt.is_set():
        if paused.is_set():
            time.sleep(interval)
            continue
        target = port.value
        if conn is None or target != connected_to:
            if conn is not None:
                conn.close()
            conn, connected_to = http.client.HTTPConnection("127.0.0.1", target, timeout=10), target
        started = time.monotonic()
        error = ""
        try:
            conn.request("GET", "/v1/status")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200 or not body.startswith(b'{"Status":0'):
                error = f"{response.status}: {body[:100]!r}"
        except (http.client.HTTPException, OSError) as e:
            if not paused.is_set():
                error = f"{type(e).__name__}: {e}"
            conn.close()
            conn = None
        results.put((started, time.monotonic() - started, error))
        time.sleep(interval)
    if conn is not None:
        conn.close()
    results.put(None)


class StatusPoller:
    """GET /v1/status in a loop, from a process of its own: a thread here would wait for this
    process's GIL while it builds and judges megabyte bodies, and count that as the runner's
    latency (measured: a worst poll of 211 ms from a thread, 93 ms from a process, over the
    same kind of bodies). Records every latency and, for the slow ones, which body was in
    flight (`in_flight`, set by the sender; matched by time). Results are read at `stop()`."""

    def __init__(self, port: int, interval: float = 0.02, limit: float = STATUS_LATENCY_LIMIT_S):
        context = multiprocessing.get_context("spawn")
        self.interval, self.limit = interval, limit
        self.latencies: list[float] = []
        self.slow: list[tuple[float, str]] = []  # (seconds, what was in flight)
        self.errors: list[str] = []
        self._port = context.Value("i", port)
        self._halt, self._paused = context.Event(), context.Event()
        self._results = context.Queue()
        self._process = context.Process(
            target=_poll_status,
            args=(self._port, interval, self._halt, self._paused, self._results),
            daemon=True,
            name="status-poller",
        )
        self._flights: list[tuple[float, float, str]] = []  # (start, end, label)
        self._current: tuple[float, str] | None = None

    @property
    def port(self) -> int:
        return int(self._port.value)

    @port.setter
    def port(self, value: int) -> None:
        self._port.value = value

    @property
    def in_flight(self) -> str:
        return self._current[1] if self._current else ""

    @in_flight.setter
    def in_flight(self, label: str) -> None:
        now = time.monotonic()
        if self._current is not None:
            self._flights.append((self._current[0], now, self._current[1]))
        self._current = (now, label) if label else None

    def start(self) -> None:
        self._process.start()

    def pause(self, paused: bool) -> None:
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    def stop(self) -> None:
        self.in_flight = ""
        self._halt.set()
        while True:
            try:
                item = self._results.get(timeout=15)
            except queue.Empty:
                break
            if item is None:
                break
            started, elapsed, error = item
            flight = self._flight_at(started, started + elapsed)
            self.latencies.append(elapsed)
            if error:
                self.errors.append(f"{error} (in flight: {flight})")
            if elapsed > self.limit:
                self.slow.append((elapsed, flight))
        self._process.join(timeout=5)

    def _flight_at(self, begin: float, end: float) -> str:
        """The body in flight while a poll ran (the latest that overlaps it)."""
        for start, stop, label in reversed(self._flights):
            if start <= end and stop >= begin:
                return label
        return ""

    def worst(self) -> tuple[float, str]:
        if not self.slow:
            return (max(self.latencies, default=0.0), "")
        return max(self.slow)
