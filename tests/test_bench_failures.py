"""Every `seconds` and ratio of the bench is the requests' own time, whatever the bench does
between them: a slow probe moves the harness's clock instead of sleeping, so nothing here
asserts a duration.
"""

from __future__ import annotations

import statistics
import time

import pytest

from bench import harness, report
from bench.base import Context
from bench.harness import run_system
from bench.models import SHAPES, load_tokenizer, write_model_dir
from bench.ours import Ours
from bench.workloads import build_workloads
from runner.engine import Engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(SHAPES["small"], tmp_path_factory.mktemp("bench-model"))


@pytest.fixture(scope="module")
def bench_engine():
    engine = Engine(name="bench-mlx")
    yield engine
    engine.stop(timeout=10)


def test_a_slow_probe_leaves_seconds_unchanged(model_dir, bench_engine, tmp_path, monkeypatch):
    """Our runner's matmul-rate probes between its requests fall in the trial's wall time,
    never in its seconds: with a probe that takes 100 s of the harness's clock, a trial's
    seconds are still its requests' own times (and ours' ratio 1)."""
    skew = [0.0]
    monkeypatch.setattr(harness, "clock", lambda: time.perf_counter() + skew[0])

    def slow_probe() -> float:
        skew[0] += 100.0  # as if it had taken 100 s
        return 50.0

    ctx = Context(model_dir, bench_engine, tmp_path, SHAPES["small"].context)
    ctx.probe_rate, ctx.measure_peak = slow_probe, lambda: 50.0
    (variants,) = build_workloads(["requests"], "small", load_tokenizer(model_dir).encode)
    (result,) = run_system(Ours(), [variants], ctx, repeats=2, sample_rows=None)
    assert result.status == "ok", result.reason
    probes = len(variants.get(1).requests) + 1  # before the first request and after each
    assert len(result.trials) == len(result.wall_trials) == 2
    for seconds, wall in zip(result.trials, result.wall_trials, strict=True):
        assert wall - seconds >= 100.0 * probes
    assert result.trials[0] == sum(result.outcome.request_seconds)  # trial 1's outcome
    assert len(result.outcome.request_rates) == probes - 1  # the probes did run
    assert result.seconds == statistics.median(result.trials)
    workload = variants.get(1)
    report.compute_metrics(workload, [result], SHAPES["small"], 50.0)
    assert result.metrics["ratio"] == 1.0
    table = "\n".join(report.format_workload(workload, [result]))
    assert "between requests (rate probes and the bench's own work, not counted)" in table
