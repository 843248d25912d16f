"""Time every system on every workload: prepare, warm up, N trials, median, close.

One system at a time, all its workloads, then the next (so one model at a time is in
memory besides a spawned runner). The warm-up is a small request on variant 0 of the
workload (the first two rows of the first request, one row for one-by-one systems; two new
tokens for generation), so a slow system does not pay a whole extra run; trial k runs
variant k (bench/workloads.py `Variants`), and the answers kept for checking are trial 1's,
which every system runs. Given `sample_rows`, a system whose rows are independent
(`sampled_ok`) times only that many rows and its median is scaled to the whole workload
(marked `sampled`).

A trial's time is its work alone: the sum of its requests' own times where the system times
each request (every scoring system does), else the wall time of the call. Whatever the
harness or a system does between requests (our runner's matmul-rate probes, bookkeeping) is
in the wall time kept beside it (`wall_trials`), never in `seconds` or a ratio.

A failing system is a row, never the end of the run. Every call into a system (prepare,
warm-up, trial, close, memory) runs on a thread of the system's own (`Worker`) with a
deadline (`Context.deadline_s`), and whatever it raises is caught:
- `error`: the call raised; the system stays prepared for the next workload;
- `died`: its own process ended (a signal: "llama.cpp process died: SIGILL"); it is closed and
  prepared afresh for the next workload;
- `timeout`: no answer within the deadline; it is closed (within a deadline too) and its
  remaining workloads are not run (a call still running would share the machine with them).
`close()` never raises out of the harness: what it raised is kept as a warning on the row.
"""

from __future__ import annotations

import http.client
import queue
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bench.base import (
    RUNNER_SYSTEMS,
    Context,
    Died,
    GenerateOutcome,
    ScoreOutcome,
    Skipped,
    System,
    Unavailable,
    exit_reason,
)
from bench.workloads import Variants, Workload

WARMUP_ROWS = 2
WARMUP_NEW_TOKENS = 2
CLOSE_DEADLINE_S = 60.0  # at most this long for close(), whatever the call deadline
# Errors that say the other end went away: the harness then gives a process a moment to be
# reaped before asking how it ended.
LOST = (EOFError, OSError, http.client.HTTPException)
LOST_WAIT_S = 5.0

clock = time.perf_counter  # the harness's clock (a test replaces it)


@dataclass
class Result:
    workload: str
    system: str
    status: str  # ok | skipped | unavailable | n/a | error | died | timeout
    reason: str = ""
    description: str = ""
    setup_seconds: float | None = None
    trials: list[float] = field(default_factory=list)  # each trial's work (`work_seconds`)
    wall_trials: list[float] = field(default_factory=list)  # each trial's call, wall clock
    measured_seconds: float | None = None  # median of the trials
    seconds: float | None = None  # the same, scaled to the whole workload when sampled
    sampled: bool = False
    memory_bytes: int | None = None  # what the system holds after its trials, if it says
    peak_beside: float | None = None  # the best matmul rate just before and after the trials
    outcome: ScoreOutcome | GenerateOutcome | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # filled in by bench/report.py
    warnings: list[str] = field(default_factory=list)  # e.g. what close() raised after it

    @property
    def wall_seconds(self) -> float | None:
        return statistics.median(self.wall_trials) if self.wall_trials else None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Hung(Exception):
    """A call into a system gave no answer within the deadline."""


class Worker:
    """The one thread that makes every call into a system, for as long as the system lives,
    waited for at most a deadline a call. One thread for all of them, not one a call: a
    process the system spawns may ask to be signalled when its parent dies
    (PR_SET_PDEATHSIG: tools/spawned.py's runners), and for the kernel its parent is the
    thread that spawned it, so it would be stopped as soon as a per-call thread ended. A call
    past its deadline is left running (it cannot be stopped from outside); the worker is
    then `stuck`, and is asked nothing more."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stuck = False
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, box, done = item
            try:
                box["value"] = call()
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e
            finally:
                done.set()

    def call(self, deadline: float | None, what: str, call: Callable[[], Any]) -> Any:
        """`call()` on the worker's thread: its value, or what it raised; Hung when it has
        not returned within `deadline` seconds (None: no limit)."""
        if self.stuck:
            raise Hung(f"{what}: not asked, {self.name} is still in an earlier call")
        box: dict[str, Any] = {}
        done = threading.Event()
        self._calls.put((call, box, done))
        if not done.wait(deadline):
            self.stuck = True
            raise Hung(f"no answer to {what} within {deadline:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self) -> None:
        """The thread ends after the call it is in, if any."""
        self._calls.put(None)


def within(deadline: float | None, what: str, call: Callable[[], Any]) -> Any:
    """`call()` on a thread of its own (a Worker for one call), within `deadline`."""
    worker = Worker(f"bench {what}")
    try:
        return worker.call(deadline, what, call)
    finally:
        worker.stop()


def work_seconds(outcome: Any, wall: float) -> float:
    """A trial's work: the sum of its requests' own times where the system timed every
    request it sent (what happened between them is not the system's work), else the call's
    wall time."""
    if isinstance(outcome, ScoreOutcome) and outcome.request_seconds:
        return sum(outcome.request_seconds)
    return wall


def _exit_code(system: System, wait: float) -> int | None:
    try:
        return system.exit_code(wait)
    except Exception:
        return None


def failure(system: System, error: BaseException) -> tuple[str, str]:
    """The status and reason a failed call gives the row: `died` where the system's own
    process has ended (whatever the call raised, a Died says so itself), `timeout` for a call
    that gave no answer, else `error`."""
    if isinstance(error, Died):
        return "died", str(error)
    code = _exit_code(system, LOST_WAIT_S if isinstance(error, LOST) else 0.0)
    if code is not None:
        name = system.process_name or system.name
        return "died", f"{exit_reason(name, code)} ({type(error).__name__}: {error})"
    if isinstance(error, Hung):
        return "timeout", str(error)
    return "error", repr(error)


def close_quietly(
    system: System, ctx: Context, result: Result | None, worker: Worker | None = None
) -> None:
    """system.close() within a deadline, on the system's worker unless that is stuck in a
    call; what it raises is logged and kept on `result`."""
    deadline = min(ctx.deadline_s or CLOSE_DEADLINE_S, CLOSE_DEADLINE_S)
    what = f"{system.name} close"
    try:
        if worker is None or worker.stuck:
            within(deadline, what, system.close)
        else:
            worker.call(deadline, what, system.close)
    except Exception as e:
        log(f"[{system.name}] close failed: {e!r}")
        if result is not None:
            result.warnings.append(f"close: {e!r}")


def run_system(
    system: System,
    workloads: list[Variants],
    ctx: Context,
    repeats: int,
    sample_rows: int | None,
    into: list[Result] | None = None,
) -> list[Result]:
    """All workloads on one system, a row each whatever happens to it (appended to `into`
    as they finish, when given, so an interrupted run keeps them); a `fresh_per_workload`
    system is prepared again (a new runner, empty caches) before each workload."""
    results: list[Result] = [] if into is None else into
    first = len(results)
    prepared = False
    worker = Worker(f"bench {system.name}")
    stopped: Result | None = None  # after a timeout: the row for every workload left

    def last() -> Result | None:
        return results[-1] if len(results) > first else None

    try:
        for index, variants in enumerate(workloads):
            if stopped is not None:
                results.append(replace(stopped, workload=variants.name))
                continue
            reason = system.supports(variants.get(1))
            if reason is not None:  # nothing to prepare for
                results.append(Result(variants.name, system.name, "n/a", reason))
                continue
            if prepared and system.fresh_per_workload:
                prepared = False
                close_quietly(system, ctx, last(), worker)
            setup = None
            if not prepared:
                started = clock()
                failed = _prepare(system, ctx, worker)
                if failed is not None:
                    if failed.status != "skipped":  # it may have started something
                        close_quietly(system, ctx, None, worker)
                    results += [replace(failed, workload=w.name) for w in workloads[index:]]
                    return results
                prepared = True
                setup = clock() - started
            result = _run_one(system, variants, repeats, sample_rows, setup, ctx, worker)
            results.append(result)
            if result.status in ("died", "timeout"):
                prepared = False
                close_quietly(system, ctx, result, worker)
            if result.status == "timeout":
                stopped = Result(
                    "",
                    system.name,
                    "timeout",
                    f"not run: {system.name} stopped answering in {variants.name}",
                )
        return results
    finally:
        if prepared:
            close_quietly(system, ctx, last(), worker)
        worker.stop()


def _prepare(system: System, ctx: Context, worker: Worker) -> Result | None:
    """None when prepared, else the result to report for every remaining workload."""
    log(f"[{system.name}] preparing")
    try:
        worker.call(ctx.deadline_s, f"{system.name} prepare", lambda: system.prepare(ctx))
        return None
    except Skipped as e:
        log(f"[{system.name}] skipped: {e}")
        return Result("", system.name, "skipped", str(e))
    except Exception as e:
        status, reason = failure(system, e)
        log(f"[{system.name}] prepare: {status}: {reason}")
        if status == "error":
            traceback.print_exception(e)
        return Result("", system.name, status, f"prepare: {reason}")


def _call(system: System, workload: Workload, limit: int | None, warmup: bool) -> Any:
    if workload.kind == "generate":
        new_tokens = WARMUP_NEW_TOKENS if warmup else workload.new_tokens
        return system.generate(workload, new_tokens)
    requests = [workload.requests[0][:WARMUP_ROWS]] if warmup else workload.requests
    return system.score(requests, 1 if warmup and system.one_by_one else limit)


def _timed(system: System, workload: Workload, limit: int | None) -> tuple[Any, float]:
    started = clock()
    outcome = _call(system, workload, limit, warmup=False)
    return outcome, clock() - started


def _optional(ctx: Context, worker: Worker, what: str, call: Callable[[], Any]) -> Any:
    """A measurement beside the trials (a matmul rate, memory): None when it fails."""
    try:
        return worker.call(ctx.deadline_s, what, call)
    except Exception as e:
        log(f"{what} failed: {e!r}")
        return None


def _run_one(
    system: System,
    variants: Variants,
    repeats: int,
    sample_rows: int | None,
    setup: float | None,
    ctx: Context,
    worker: Worker | None = None,
) -> Result:
    """One workload on a prepared system, its calls on `worker` (a worker of its own when
    None)."""
    if worker is None:
        own = Worker(f"bench {system.name}")
        try:
            return _run_one(system, variants, repeats, sample_rows, setup, ctx, own)
        finally:
            own.stop()
    workload = variants.get(1)
    result = Result(workload.name, system.name, "ok", setup_seconds=setup)
    result.description = system.description
    limit = sample_rows if system.sampled_ok else None
    # our runner's own cost per request is reckoned at the matmul rate of these minutes
    beside = (
        ctx.measure_peak
        if system.name in RUNNER_SYSTEMS and getattr(workload, "latency", False)
        else None
    )
    peaks: list[float | None] = []
    deadline = ctx.deadline_s
    try:
        warmup = variants.get(0)
        worker.call(
            deadline,
            f"{system.name} {workload.name} warm-up",
            lambda: _call(system, warmup, limit, warmup=True),
        )
        if beside is not None:
            peaks.append(_optional(ctx, worker, "matmul rate", beside))
        for trial in range(1, repeats + 1):
            # probes between requests add to the trial's wall time, not to its requests'
            system.rate_probe = ctx.probe_rate if beside is not None else None
            timed = variants.get(trial)
            try:
                outcome, wall = worker.call(
                    deadline,
                    f"{system.name} {workload.name} trial {trial}",
                    lambda timed=timed: _timed(system, timed, limit),
                )
            finally:
                system.rate_probe = None
            result.trials.append(work_seconds(outcome, wall))
            result.wall_trials.append(wall)
            result.outcome = result.outcome or outcome
            log(
                f"[{system.name}] {workload.name} trial {trial}/{repeats}: "
                f"{result.trials[-1]:.3f} s (wall {wall:.3f} s)"
            )
    except Unavailable as e:
        log(f"[{system.name}] {workload.name} unavailable: {e}")
        result.status, result.reason = "unavailable", str(e)
        return result
    except Exception as e:
        result.status, result.reason = failure(system, e)
        log(f"[{system.name}] {workload.name}: {result.status}: {result.reason}")
        if result.status == "error":
            traceback.print_exception(e)
        result.outcome = None
        return result
    if beside is not None:
        peaks.append(_optional(ctx, worker, "matmul rate", beside))
        result.peak_beside = max((p for p in peaks if p), default=None)
    result.memory_bytes = _optional(ctx, worker, f"{system.name} memory", system.memory_bytes)
    result.measured_seconds = statistics.median(result.trials)
    result.seconds = result.measured_seconds
    outcome = result.outcome
    if isinstance(outcome, ScoreOutcome):
        total = len(workload.rows)
        if outcome.rows_done < total:
            result.sampled = True
            result.seconds = result.measured_seconds * total / outcome.rows_done
    return result
