"""Soak the runner: many mixed requests under a small cache budget, then many start/stop cycles.

    python -m bench.soak --requests 1000 --cycles 100 --seed 0 [--cache-bytes N] [--out DIR]

Both parts run a tiny random-weight Llama (tests/tiny.py) written to a temporary directory,
spawned as a supervisor would (tools/spawned.py).

(a) Requests: one runner with `--cache-bytes` (32 MiB by default, so both prefix caches
    evict all along) gets `--requests` requests from two client threads: `/v1/score` with
    1-64 rows sharing one of a few long prefixes, `/v1/completions` with random options,
    `/v1/tokenize`, `/v1/status`. Every answer must be 200 or 4xx and match docs/openapi.yaml
    (bench/fuzz's checks); the runner's RSS (`VmRSS` in /proc/PID/status) is read after the
    warm-up (the first tenth of the requests) and every tenth after, and the growth reported.
(b) Cycles: `--cycles` times, start a runner, wait a random time and send SIGINT or SIGTERM
    at random: while the model loads, idle, or with a long completion or a 64-row score in
    flight. The promise (docs/PROTOCOL.md §1.4) is exit code 0 within 5 s every time and no
    abort; every exit code, the time to exit and any `terminate called`, `Aborted`,
    `Traceback` or `KeyboardInterrupt` in the runner's output are recorded, with its log.

The summary ends with the failures; the exit status is 1 when there are any.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fuzz.client import MIB, Answer, send
from bench.fuzz.fuzzer import check_answer
from bench.fuzz.openapi import openapi
from bench.fuzz.process import rss_bytes, spawn, write_model

MARKERS = ("terminate called", "Aborted", "Traceback", "KeyboardInterrupt", "core dumped")
EXIT_DEADLINE_S = 5.0
TEXT = (
    "the sky is blue and the grass is green the cat sat on the mat and the dog slept by the "
    "door a small model reads a short story about a river a bridge and a town where the "
    "bakers wake before the sun numbers like 1 2 3 and 42 appear in many texts"
)
WORDS = TEXT.split()
QUESTIONS = ("Is the sky blue?", "Is grass red?", "Is it?", "Is the sea wet?", "Is it big?")
CANDIDATES = (" Yes", " No", " A", " B", " C", " D", " the", " a", " is")


def _text(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words))


# --- (a) mixed requests ----------------------------------------------------------------------


@dataclass
class RequestsReport:
    requests: int = 0
    seconds: float = 0.0
    cache_bytes: int = 0
    by_status: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    rss: list[tuple[int, int | None]] = field(default_factory=list)  # (requests done, bytes)
    warmup: int = 0
    alive: bool = True

    @property
    def rss_warm(self) -> int | None:
        return next((b for n, b in self.rss if n >= self.warmup), None)

    @property
    def rss_end(self) -> int | None:
        return self.rss[-1][1] if self.rss else None


def _request(rnd: random.Random, prefixes: list[str]) -> tuple[str, str, bytes]:
    """(kind, path, body) of one random request."""
    kind = rnd.choices(("score", "completions", "tokenize", "status"), (40, 30, 15, 15))[0]
    if kind == "score":
        prefix = rnd.choice(prefixes)
        n = rnd.choice((1, 2, 4, 8, 16, 32, 64, rnd.randint(1, 64)))
        rows = []
        for _ in range(n):
            prompt = f"{prefix} {_text(rnd, rnd.randint(0, 12))} {rnd.choice(QUESTIONS)}"
            rows.append({"prompt": prompt, "candidates": rnd.sample(CANDIDATES, rnd.randint(1, 4))})
        return kind, "/v1/score", json.dumps({"rows": rows, "max_tokens": 2048}).encode()
    if kind == "completions":
        options: dict[str, Any] = {"num_predict": rnd.choice((1, 4, 16, 32, 64))}
        for name, values in (
            ("temperature", (0, 0.5, 1.0, 1.5)),
            ("top_k", (0, 1, 10, 40)),
            ("top_p", (0, 0.5, 0.9, 1)),
            ("min_p", (0, 0.05)),
            ("seed", (-1, 0, 7, 123456)),
            ("repeat_last_n", (-1, 0, 16, 64)),
            ("repeat_penalty", (0, 1, 1.1)),
            ("presence_penalty", (0, 0.5)),
            ("frequency_penalty", (0, 0.5)),
        ):
            if rnd.random() < 0.5:
                options[name] = rnd.choice(values)
        body: dict[str, Any] = {
            "Prompt": f"{rnd.choice(prefixes)[: rnd.randint(0, 3000)]} {rnd.choice(QUESTIONS)}",
            "Options": options,
        }
        if rnd.random() < 0.3:
            body.update(Logprobs=True, TopLogprobs=rnd.choice((0, 1, 5)))
        return kind, "/v1/completions", json.dumps(body).encode()
    if kind == "tokenize":
        return kind, "/v1/tokenize", _text(rnd, rnd.randint(0, 400)).encode()
    return kind, "/v1/status", b""


def _get(port: int, path: str) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    answer = Answer()
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        answer.status = response.status
        answer.headers = {k.lower(): v for k, v in response.getheaders()}
        answer.body = response.read()
    except (http.client.HTTPException, OSError) as e:
        answer.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return answer


def soak_requests(
    model_dir: Path, log_dir: Path, count: int, seed: int, cache_bytes: int
) -> RequestsReport:
    rnd = random.Random(seed)
    # a few long shared prefixes (~200-900 tokens): 64 rows over them fill 32 MiB quickly
    prefixes = [_text(rnd, rnd.randint(150, 600)) for _ in range(6)]
    plan = [_request(random.Random(rnd.random()), prefixes) for _ in range(count)]
    report = RequestsReport(requests=count, cache_bytes=cache_bytes, warmup=max(1, count // 10))
    api = openapi()
    runner = spawn(model_dir, log_dir, "--cache-bytes", str(cache_bytes))
    lock = threading.Lock()
    done = 0
    started = time.perf_counter()

    def one(item: tuple[str, str, bytes]) -> None:
        nonlocal done
        kind, path, body = item
        answer = _get(runner.port, path) if kind == "status" else send(runner.port, path, body)
        endpoint = {"/v1/status": None}.get(path, kind)
        problems = []
        if endpoint is None:
            problems = [answer.error] if answer.error else []
            if not answer.error:
                problems += api.check_answer(
                    path, "GET", answer.status, answer.headers, answer.body
                )
        else:
            checks, details = check_answer(api, endpoint, answer, runner.process.poll() is None)
            problems = [f"{c}: {d}" for c, d in zip(checks, details[: len(checks)], strict=False)]
        with lock:
            report.by_status[(kind, answer.status or "no answer")] += 1
            if problems:
                report.failures.append(f"{kind} {body[:100]!r} -> {answer.status}: {problems[:3]}")
            done += 1
            if done == report.warmup or done % max(1, count // 10) == 0 or done == count:
                report.rss.append((done, rss_bytes(runner.process.pid)))

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(one, plan))
        report.alive = runner.process.poll() is None
    finally:
        report.seconds = time.perf_counter() - started
        runner.stop()
    return report


# --- (b) start/stop cycles ----------------------------------------------------------------------


@dataclass
class Cycle:
    index: int
    phase: str  # loading, idle, completion, score64
    signal: str
    delay: float
    exit_code: int | None = None
    exit_seconds: float = 0.0
    markers: list[str] = field(default_factory=list)
    in_flight: str = ""  # what the request in flight saw
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.markers and self.exit_seconds <= EXIT_DEADLINE_S


def _stream_until_closed(port: int, path: str, body: bytes, seen: dict[str, str]) -> None:
    """POST and read the answer to its end; what it saw goes to `seen['result']`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body)
        response = conn.getresponse()
        data = response.read()
        error_line = b'"Error":{' in data
        seen["result"] = (
            f"{response.status}, {len(data)} bytes{', Error line' if error_line else ''}"
        )
    except (http.client.HTTPException, OSError) as e:
        seen["result"] = f"{type(e).__name__}"
    finally:
        conn.close()


def one_cycle(model_dir: Path, log_dir: Path, index: int, rnd: random.Random) -> Cycle:
    from tools.spawned import SpawnedRunner

    phase = rnd.choice(("loading", "idle", "completion", "score64"))
    sig = rnd.choice((signal.SIGINT, signal.SIGTERM))
    log = log_dir / f"cycle-{index:03d}-{phase}-{sig.name}.log"
    runner = SpawnedRunner("--model", str(model_dir), log_path=log)
    cycle = Cycle(index, phase, sig.name, 0.0, log=str(log))
    seen: dict[str, str] = {}
    worker = None
    try:
        if phase == "loading":
            cycle.delay = rnd.uniform(0.0, 4.0)  # loading takes ~4-5 s here
            time.sleep(cycle.delay)
        else:
            runner.wait_ready(timeout=120)
            if phase == "completion":
                body = json.dumps({"Prompt": "Is it?", "Options": {"num_predict": 0}}).encode()
                path = "/v1/completions"
            elif phase == "score64":
                rows = [
                    {"prompt": _text(rnd, 300) + " Is it?", "candidates": [" Yes", " No"]}
                    for _ in range(64)
                ]
                body = json.dumps({"rows": rows, "max_tokens": 2048}).encode()
                path = "/v1/score"
            if phase != "idle":
                worker = threading.Thread(
                    target=_stream_until_closed, args=(runner.port, path, body, seen), daemon=True
                )
                worker.start()
            cycle.delay = rnd.uniform(0.0, 1.0)
            time.sleep(cycle.delay)
        signalled = time.perf_counter()
        runner.send_signal(sig)
        try:
            cycle.exit_code = runner.wait(timeout=15)
        except Exception:
            runner.process.kill()
            cycle.exit_code = runner.wait()
            cycle.markers.append("killed after 15 s")
        cycle.exit_seconds = time.perf_counter() - signalled
    finally:
        with contextlib.suppress(Exception):
            runner.stop(timeout=1)
    if worker is not None:
        worker.join(timeout=10)
        cycle.in_flight = seen.get("result", "")
    output = log.read_text(errors="replace")
    cycle.markers += [m for m in MARKERS if m in output]
    return cycle


def soak_cycles(model_dir: Path, log_dir: Path, count: int, seed: int) -> list[Cycle]:
    rnd = random.Random(seed + 1)
    log_dir.mkdir(parents=True, exist_ok=True)
    cycles = []
    for i in range(count):
        cycle = one_cycle(model_dir, log_dir, i, rnd)
        cycles.append(cycle)
        if not cycle.ok:
            print(
                f"  cycle {i}: {cycle.phase} {cycle.signal} after {cycle.delay:.2f} s -> exit "
                f"{cycle.exit_code} in {cycle.exit_seconds:.2f} s {cycle.markers}",
                file=sys.stderr,
            )
        elif (i + 1) % 10 == 0:
            print(f"  {i + 1}/{count} cycles", file=sys.stderr)
    return cycles


# --- summary -------------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:.1f} MiB"


def summary_requests(r: RequestsReport) -> str:
    lines = [
        f"(a) {r.requests} mixed requests in {r.seconds:.0f} s, 2 client threads, "
        f"--cache-bytes {r.cache_bytes} ({_mib(r.cache_bytes)})"
    ]
    for kind in ("score", "completions", "tokenize", "status"):
        counts = {s: n for (k, s), n in r.by_status.items() if k == kind}
        parts = "  ".join(f"{s}: {n}" for s, n in sorted(counts.items(), key=str))
        lines.append(f"  {kind:<12} {sum(counts.values()):>5}   {parts}")
    warm, end = r.rss_warm, r.rss_end
    growth = "?" if warm is None or end is None else f"{(end - warm) / MIB:+.1f} MiB"
    lines.append(
        f"  RSS after warm-up ({r.warmup} requests) {_mib(warm)}, at the end {_mib(end)}: {growth}"
    )
    lines.append("  RSS by requests done: " + ", ".join(f"{n}: {_mib(b)}" for n, b in r.rss))
    lines.append(f"  runner alive at the end: {r.alive}")
    lines.append(f"  answers other than 200/4xx or off the schema: {len(r.failures)}")
    lines += [f"    {f[:300]}" for f in r.failures[:10]]
    return "\n".join(lines)


def summary_cycles(cycles: list[Cycle]) -> str:
    if not cycles:
        return "(b) no cycles"
    bad = [c for c in cycles if not c.ok]
    times = [c.exit_seconds for c in cycles]
    lines = [
        f"(b) {len(cycles)} start/stop cycles: {len(cycles) - len(bad)} clean (exit 0 within "
        f"{EXIT_DEADLINE_S:.0f} s, no abort), {len(bad)} not"
    ]
    for phase in ("loading", "idle", "completion", "score64"):
        these = [c for c in cycles if c.phase == phase]
        codes = Counter(c.exit_code for c in these)
        lines.append(
            f"  {phase:<11} {len(these):>3} cycles, {sum(c.ok for c in these):>3} clean, "
            f"exit codes {dict(sorted(codes.items(), key=str))}"
        )
    lines.append(
        f"  exit codes: {dict(sorted(Counter(c.exit_code for c in cycles).items(), key=str))}"
    )
    markers = Counter(m for c in cycles for m in c.markers)
    lines.append(f"  output markers: {dict(markers) or 'none'}")
    lines.append(
        f"  seconds from signal to exit: median {statistics.median(times):.2f}, "
        f"max {max(times):.2f}"
    )
    flights = Counter(c.in_flight.split(",")[0] for c in cycles if c.in_flight)
    if flights:
        lines.append(f"  the request in flight saw: {dict(flights)}")
    for c in bad[:15]:
        lines.append(
            f"    cycle {c.index}: {c.phase}, {c.signal} after {c.delay:.2f} s -> exit "
            f"{c.exit_code} in {c.exit_seconds:.2f} s {c.markers} {c.log}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=1000, help="mixed requests (1000)")
    parser.add_argument("--cycles", type=int, default=100, help="start/stop cycles (100)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument("--cache-bytes", type=int, default=32 * MIB, help="for (a): 32 MiB")
    parser.add_argument("--out", type=Path, help="runner logs go here (a new temp dir)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="runner-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak: seed {args.seed}, logs in {out}", file=sys.stderr)
    failed = False
    with tempfile.TemporaryDirectory() as temp:
        model_dir = write_model(Path(temp) / "tiny-llama")
        lines = []
        if args.requests:
            report = soak_requests(model_dir, out, args.requests, args.seed, args.cache_bytes)
            lines.append(summary_requests(report))
            failed |= bool(report.failures) or not report.alive
        if args.cycles:
            cycles = soak_cycles(model_dir, out / "cycles", args.cycles, args.seed)
            lines.append(summary_cycles(cycles))
            failed |= any(not c.ok for c in cycles)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
