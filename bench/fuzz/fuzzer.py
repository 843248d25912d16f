"""The fuzz itself: each case sent to a runner and its answer judged by every check (the Go
oracle's verdict, a twin sent when Go decodes the body), failing bodies written out; a whole
run (`run_fuzz`): cases generated, a tiny runner spawned (again when a body kills it),
`/v1/status` polled throughout."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.fuzz.cases import LONG_LENGTHS, Case, generate_cases
from bench.fuzz.client import MIB, PATHS, Answer, StatusPoller, send
from bench.fuzz.go_oracle import go_verdict
from bench.fuzz.openapi import OpenAPI, openapi
from bench.fuzz.process import rss_bytes, spawn, write_model
from bench.fuzz.report import Failure, Report


def check_answer(
    api: OpenAPI, endpoint: str, answer: Answer, alive: bool
) -> tuple[list[str], list[str]]:
    """The per-body checks that need no Go model: (failed checks, details)."""
    checks, details = [], []
    if answer.error:
        checks.append("answered")
        details.append(f"no whole answer: {answer.error}")
    if answer.status and not (answer.status == 200 or 400 <= answer.status < 500):
        checks.append("no-5xx")
        details.append(f"status {answer.status}: {answer.text()!r}")
    if answer.status and not answer.error:
        problems = api.check_answer(
            PATHS[endpoint],
            "POST",
            answer.status,
            answer.headers,
            answer.body,
            complete=answer.complete,
        )
        if problems:
            checks.append("schema")
            details += problems[:5]
    if endpoint == "completions" and answer.status == 200 and b'"Error":{' in answer.body:
        checks.append("no-error-line")
        details.append(
            "Error line: "
            + answer.body[answer.body.find(b'"Error":{') :][:200].decode("utf-8", "replace")
        )
    if not alive:
        checks.append("alive")
        details.append("the runner exited")
    return checks, details


def _message(answer: Answer) -> str:
    return answer.body.decode("utf-8", "replace")


class Fuzzer:
    """Sends cases to a runner, checks every answer; `runner` is a tools.spawned.SpawnedRunner,
    `restart` makes a new one when it dies (None: a death ends the run)."""

    def __init__(
        self, runner: Any, out_dir: Path, seed: int, restart: Callable[[], Any] | None = None
    ):
        self.runner = runner
        self.restart = restart
        self.api = openapi()
        self.out = out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.report = Report(seed=seed, out_dir=str(out_dir))
        self._twins: dict[tuple[str, bytes], Answer] = {}
        self.poller: StatusPoller | None = None

    def _alive(self) -> bool:
        return self.runner.process.poll() is None

    def _post(self, endpoint: str, body: bytes, label: str) -> Answer:
        if self.poller is not None:
            self.poller.in_flight = label
        answer = send(self.runner.port, PATHS[endpoint], body)
        if self.poller is not None:
            self.poller.in_flight = ""
        return answer

    def run(
        self, cases: list[Case], progress: Callable[[int, Report], None] | None = None
    ) -> Report:
        report = self.report
        started = time.perf_counter()
        report.rss_before = rss_bytes(self.runner.process.pid)
        self.poller = StatusPoller(self.runner.port)
        self.poller.start()
        try:
            for index, case in enumerate(cases):
                self.one(index, case)
                if progress is not None:
                    progress(index + 1, report)
                if not self._alive():
                    if self.restart is None:
                        break
                    self.poller.pause(True)
                    self.runner = self.restart()
                    self.poller.port = self.runner.port
                    self.poller.pause(False)
                    report.restarts += 1
        finally:
            self.poller.stop()
        if self._alive():
            report.rss_after = rss_bytes(self.runner.process.pid)
        report.latencies = self.poller.latencies
        report.worst_status = self.poller.worst()
        report.slow_status = len(self.poller.slow)
        report.slow_polls = list(self.poller.slow)
        report.status_errors = self.poller.errors
        if self.poller.slow:
            report.by_check["status-latency"] = [-1]
        report.seconds = time.perf_counter() - started
        return report

    def one(self, index: int, case: Case) -> None:
        report = self.report
        body = case.materialize()
        label = f"#{index} {case.endpoint} {','.join(case.tags)} {body[:60]!r}"
        answer = self._post(case.endpoint, body, label)
        report.bodies += 1
        report.by_status[(case.endpoint, answer.status or answer.error.split(":")[0])] += 1
        checks, details = check_answer(self.api, case.endpoint, answer, self._alive())
        verdict = None
        if case.endpoint != "tokenize" and answer.status and self._alive():
            verdict = go_verdict(case.endpoint, body) if not case.pad_to else None
            if case.pad_to:  # documented: the runner refuses bodies over 64 MiB, Go has no limit
                if answer.status != 400 or not answer.body.startswith(b"request body too large"):
                    checks.append("go-status")
                    details.append(
                        f"over 64 MiB: expected 400 request body too large, got {answer.status}"
                    )
            elif not verdict.ok:
                if answer.status != 400:
                    checks.append("go-status")
                    details.append(
                        f"Go rejects the body ({verdict.error}): expected 400, got {answer.status}"
                    )
                elif case.endpoint == "completions" and answer.body != b"Bad Request\n":
                    checks.append("go-message")
                    details.append(
                        f"Go cannot decode it ({verdict.error}): expected 'Bad Request', "
                        f"got {_message(answer)!r}"
                    )
            else:
                twin = self._twin(case.endpoint, verdict.canonical, index)
                if twin is not None and twin.status and answer.status != twin.status:
                    checks.append("go-status")
                    details.append(
                        f"Go decodes it as {verdict.canonical[:300]!r}, answered {twin.status} "
                        f"({twin.text(120)!r}); this body got {answer.status} "
                        f"({answer.text(120)!r})"
                    )
                elif (
                    twin is not None
                    and answer.status == twin.status == 400
                    and answer.body != twin.body
                ):
                    checks.append("go-message")
                    details.append(
                        f"400 {_message(answer)!r}, Go decodes it as "
                        f"{verdict.canonical[:200]!r}: {_message(twin)!r}"
                    )
        if checks:
            self._record(index, case, body, answer, checks, details, verdict)

    def _twin(self, endpoint: str, canonical: bytes, index: int) -> Answer | None:
        key = (endpoint, canonical)
        if key not in self._twins:
            twin = self._post(endpoint, canonical, f"#{index} twin {canonical[:60]!r}")
            self.report.twins += 1
            checks, details = check_answer(self.api, endpoint, twin, self._alive())
            if checks:  # a plain, valid-syntax body failing is a failure of its own
                self._record(
                    index,
                    Case(endpoint, canonical, ("twin",)),
                    canonical,
                    twin,
                    checks,
                    details,
                    None,
                )
            if not self._alive():
                return None
            self._twins[key] = twin
        return self._twins[key]

    def _record(self, index, case, body, answer, checks, details, verdict) -> None:
        name = f"{index:05d}-{case.endpoint}{'-twin' if case.tags == ('twin',) else ''}"
        failure = Failure(
            index, case.endpoint, checks, details, body, case.tags, answer.status, answer.text(500)
        )
        if len(body) <= 8 * MIB:
            (self.out / f"{name}.body").write_bytes(body)
            failure.file = str(self.out / f"{name}.body")
        meta = {
            "index": index,
            "endpoint": case.endpoint,
            "path": PATHS[case.endpoint],
            "checks": checks,
            "details": details,
            "tags": list(case.tags),
            "status": answer.status,
            "error": answer.error,
            "answer": answer.text(2000),
            "body_bytes": len(body),
            "go": None
            if verdict is None
            else {
                "decodes": verdict.ok,
                "error": verdict.error,
                "canonical": None
                if verdict.canonical is None
                else verdict.canonical[:2000].decode(),
            },
        }
        (self.out / f"{name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        self.report.failures.append(failure)
        for check in checks:
            self.report.by_check[check].append(index)


def run_fuzz(
    bodies: int,
    seed: int,
    out_dir: Path,
    model_dir: Path | None = None,
    *,
    cache_bytes: int = 64 * MIB,
    restart: bool = True,
    allow_oversize: bool = True,
    long_lengths: tuple[int, ...] = LONG_LENGTHS,
    progress: bool = False,
) -> Report:
    """Generate `bodies` cases, spawn a tiny runner (`--cache-bytes cache_bytes`, so that RSS
    growth is not the prefix caches filling up), send them; the report."""
    cases = generate_cases(bodies, seed, allow_oversize=allow_oversize, long_lengths=long_lengths)
    with contextlib.ExitStack() as stack:
        if model_dir is None:
            temp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            model_dir = write_model(temp / "tiny-llama")
        runners: list[Any] = []

        def start() -> Any:
            runner = spawn(model_dir, out_dir / "logs", "--cache-bytes", str(cache_bytes))
            runners.append(runner)
            return runner

        stack.callback(lambda: [r.stop() for r in runners])
        fuzzer = Fuzzer(start(), out_dir, seed, restart=start if restart else None)

        def show(done: int, report: Report) -> None:
            if progress and (done % 250 == 0 or done == len(cases)):
                failing = len(report.failures)
                print(f"  {done}/{len(cases)} bodies, {failing} failing", file=sys.stderr)

        return fuzzer.run(cases, show)
