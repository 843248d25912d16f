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
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

from bench.base import (
    RUNNER_SYSTEMS,
    Context,
    GenerateOutcome,
    ScoreOutcome,
    Skipped,
    System,
    Unavailable,
)
from bench.workloads import Variants, Workload

WARMUP_ROWS = 2
WARMUP_NEW_TOKENS = 2

clock = time.perf_counter  # the harness's clock (a test replaces it)


@dataclass
class Result:
    workload: str
    system: str
    status: str  # ok | skipped | unavailable | n/a | error
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

    @property
    def wall_seconds(self) -> float | None:
        return statistics.median(self.wall_trials) if self.wall_trials else None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def work_seconds(outcome: Any, wall: float) -> float:
    """A trial's work: the sum of its requests' own times where the system timed every
    request it sent (what happened between them is not the system's work), else the call's
    wall time."""
    if isinstance(outcome, ScoreOutcome) and outcome.request_seconds:
        return sum(outcome.request_seconds)
    return wall


def run_system(
    system: System,
    workloads: list[Variants],
    ctx: Context,
    repeats: int,
    sample_rows: int | None,
) -> list[Result]:
    """All workloads on one system; a `fresh_per_workload` system is prepared again (a new
    runner, empty caches) before each workload."""
    results: list[Result] = []
    prepared = False
    try:
        for variants in workloads:
            reason = system.supports(variants.get(1))
            if reason is not None:  # nothing to prepare for
                results.append(Result(variants.name, system.name, "n/a", reason))
                continue
            if prepared and system.fresh_per_workload:
                system.close()
                prepared = False
            setup = None
            if not prepared:
                started = clock()
                failure = _prepare(system, ctx)
                if failure is not None:
                    results += [
                        replace(failure, workload=w.name) for w in workloads[len(results) :]
                    ]
                    return results
                prepared = True
                setup = clock() - started
            results.append(_run_one(system, variants, repeats, sample_rows, setup, ctx))
        return results
    finally:
        if prepared:
            system.close()


def _prepare(system: System, ctx: Context) -> Result | None:
    """None when prepared, else the result to report for every remaining workload."""
    try:
        log(f"[{system.name}] preparing")
        system.prepare(ctx)
        return None
    except Skipped as e:
        log(f"[{system.name}] skipped: {e}")
        return Result("", system.name, "skipped", str(e))
    except Exception as e:
        traceback.print_exc()
        return Result("", system.name, "error", f"prepare: {e!r}")


def _call(system: System, workload: Workload, limit: int | None, warmup: bool) -> Any:
    if workload.kind == "generate":
        new_tokens = WARMUP_NEW_TOKENS if warmup else workload.new_tokens
        return system.generate(workload, new_tokens)
    requests = [workload.requests[0][:WARMUP_ROWS]] if warmup else workload.requests
    return system.score(requests, 1 if warmup and system.one_by_one else limit)


def _run_one(
    system: System,
    variants: Variants,
    repeats: int,
    sample_rows: int | None,
    setup: float | None,
    ctx: Context,
) -> Result:
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
    try:
        _call(system, variants.get(0), limit, warmup=True)
        if beside is not None:
            peaks.append(beside())
        for trial in range(1, repeats + 1):
            # probes between requests add to the trial's wall time, not to its requests'
            system.rate_probe = ctx.probe_rate if beside is not None else None
            started = clock()
            try:
                outcome = _call(system, variants.get(trial), limit, warmup=False)
            finally:
                system.rate_probe = None
            wall = clock() - started
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
        traceback.print_exc()
        result.status, result.reason = "error", repr(e)
        return result
    if beside is not None:
        peaks.append(beside())
        result.peak_beside = max((p for p in peaks if p), default=None)
    result.memory_bytes = system.memory_bytes()
    result.measured_seconds = statistics.median(result.trials)
    result.seconds = result.measured_seconds
    outcome = result.outcome
    if isinstance(outcome, ScoreOutcome):
        total = len(workload.rows)
        if outcome.rows_done < total:
            result.sampled = True
            result.seconds = result.measured_seconds * total / outcome.rows_done
    return result
