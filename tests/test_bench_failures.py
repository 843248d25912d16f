"""The bench tells the truth whatever its systems do: a system that raises, stops answering or
whose process dies is a row with its status and reason, and the run goes on; `seconds` (and
every ratio) is the requests' own time, whatever the bench does between them.

Fake systems stand in for the failing ones (one of them talks to a real child process, which
is killed with SIGKILL in the middle of a workload); our runner and mlx-lm run for real
beside them on the small random model. Nothing here asserts a duration: the hang is a wait on
an event past a deadline, and the slow probe moves the harness's clock instead of sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

from bench import harness, report
from bench.__main__ import parse_args, run
from bench.base import Context, Died, GenerateOutcome, ScoreOutcome, System, exit_reason
from bench.harness import run_system
from bench.llamacpp import LlamaCpp, fault_hint
from bench.machine import LEVELS, dispatch_level, format_machine
from bench.models import SHAPES, load_tokenizer, write_model_dir
from bench.ours import Ours
from bench.peers import MlxLm
from bench.workloads import build_workloads
from runner.engine import Engine
from tests import bench_children

WORKLOADS = ["requests", "decisions", "generate"]
RELEASE = threading.Event()  # what the hanging fakes wait for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(SHAPES["small"], tmp_path_factory.mktemp("bench-model"))


@pytest.fixture(scope="module")
def bench_engine():
    engine = Engine(name="bench-mlx")
    yield engine
    engine.stop(timeout=10)


@pytest.fixture
def release():
    """Lets the calls a test left hanging end once it is over."""
    RELEASE.clear()
    yield
    RELEASE.set()


def _outcome(requests) -> ScoreOutcome:
    rows = [row for request in requests for row in request]
    values = [[0.0] * len(row.candidates) for row in rows]
    return ScoreOutcome(values, len(rows), 0, request_seconds=[0.001] * len(requests))


class Raises(System):
    name = "raises"

    def score(self, requests, limit):
        raise RuntimeError("boom: the system failed")

    def generate(self, workload, new_tokens):
        raise RuntimeError("boom: the system failed")


class Hangs(System):
    name = "hangs"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, requests, limit):
        self.calls += 1
        RELEASE.wait()
        raise RuntimeError("released after the test")

    def generate(self, workload, new_tokens):
        return self.score([], None)


class Killed(System):
    """A system served by a child process of its own (a line echoed for a line), which is
    killed with SIGKILL after the first answer of every timed call, as the OOM killer would;
    its close() then writes to the dead child's pipe and raises BrokenPipeError, as
    llama.cpp's did."""

    name = "killed"
    process_name = "echo"

    def prepare(self, ctx) -> None:
        command = [sys.executable, "-c", bench_children.ECHO]
        self.child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.calls = 0

    def _exchange(self) -> None:
        self.child.stdin.write(b"ping\n")
        self.child.stdin.flush()
        if self.child.stdout.readline() != b"ping\n":
            raise EOFError("the child's pipe closed")

    def _talk(self) -> None:
        self.calls += 1
        self._exchange()
        if self.calls > 1:  # a timed call, in the middle
            os.kill(self.child.pid, signal.SIGKILL)
            self._exchange()

    def score(self, requests, limit):
        self._talk()
        return _outcome(requests)

    def generate(self, workload, new_tokens):
        self._talk()
        return GenerateOutcome("", 1, 1)

    def exit_code(self, wait: float = 0.0) -> int | None:
        try:
            return self.child.wait(timeout=wait) if wait else self.child.poll()
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        self.child.stdin.write(b"bye\n")
        self.child.stdin.flush()
        self.child.stdin.close()
        self.child.wait(timeout=10)


def test_failing_systems_are_rows_and_the_run_goes_on(model_dir, tmp_path, capsys, release):
    """A system that raises, one that hangs and one whose process is killed run between ours
    and mlx-lm: the run ends normally, the report and the JSON have every row, the failed
    ones with their status and reason, and the systems after them ran."""
    out = tmp_path / "results.json"
    args = parse_args(
        [
            *("--size", "small", "--repeats", "1", "--workloads", ",".join(WORKLOADS)),
            *("--systems", "ours,mlx-lm", "--deadline", "10", "--json", str(out)),
            *("--model-dir", str(model_dir)),
        ]
    )
    systems = [Ours(), Raises(), Hangs(), Killed(), MlxLm()]
    assert run(args, tmp_path, systems) == 0

    document = json.loads(out.read_text())
    dispatch = document["machine"]["dispatch"]
    assert dispatch.startswith("not loaded") or ", level " in dispatch, dispatch
    assert [w["name"] for w in document["workloads"]] == WORKLOADS
    for section in document["workloads"]:
        rows = {r["system"]: r for r in section["results"]}
        assert list(rows) == ["ours", "raises", "hangs", "killed", "mlx-lm"]
        assert rows["mlx-lm"]["status"] == "ok", rows["mlx-lm"]
        if section["kind"] == "score":
            assert rows["ours"]["status"] == "ok"
            assert rows["mlx-lm"]["checked_against"] == "ours"
            assert rows["mlx-lm"]["argmax_agree"] == 1.0
        assert rows["raises"]["status"] == "error"
        assert "boom: the system failed" in rows["raises"]["reason"]
        hangs = rows["hangs"]
        assert hangs["status"] == "timeout"
        if section["name"] == "requests":  # the first call past its deadline
            assert hangs["reason"] == "no answer to hangs requests warm-up within 10 s"
        else:  # and never asked again
            assert hangs["reason"] == "not run: hangs stopped answering in requests"
        killed = rows["killed"]
        assert killed["status"] == "died", killed
        assert killed["reason"].startswith("echo process died: SIGKILL")
        assert any(w.startswith("close: BrokenPipeError") for w in killed["warnings"])
    assert systems[2].calls == 1

    printed = capsys.readouterr().out
    for name in WORKLOADS:
        section = printed.split(f"== {name} (")[1].split("\n== ")[0]
        lines = {line.split()[0]: line for line in section.splitlines()[2:] if line.strip()}
        for system in ("raises", "hangs", "killed", "mlx-lm"):
            assert system in lines, section
        assert "died" in lines["killed"] and "echo process died: SIGKILL" in lines["killed"]
        assert "timeout" in lines["hangs"] and "error" in lines["raises"]


def test_a_system_that_stops_answering_is_left_behind(model_dir, bench_engine, tmp_path, release):
    """Past the deadline a system is closed (its close() given a deadline too) and its other
    workloads are not run: run_system returns although every call into it still hangs."""

    class HangsEverywhere(Hangs):
        def close(self) -> None:
            RELEASE.wait()

    system = HangsEverywhere()
    workloads = build_workloads(WORKLOADS, "small", load_tokenizer(model_dir).encode)
    ctx = Context(model_dir, bench_engine, tmp_path, SHAPES["small"].context, deadline_s=0.5)
    results = run_system(system, workloads, ctx, repeats=1, sample_rows=None)
    assert [(r.workload, r.status) for r in results] == [(w, "timeout") for w in WORKLOADS]
    assert results[0].reason == "no answer to hangs requests warm-up within 0.5 s"
    assert results[0].warnings == ["close: Hung('no answer to hangs close within 0.5 s')"]
    assert system.calls == 1


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


class FaultingLlamaCpp(LlamaCpp):
    """bench/llamacpp.py's system, its process serving a stand-in that dies of SIGILL on its
    second call, after saying its build has AMX kernels."""

    name = "llama.cpp-q4"
    serve = staticmethod(bench_children.serve_then_fault)

    def prepare(self, ctx) -> None:
        self.start("unused.gguf", ctx.max_tokens)


def test_llama_cpp_process_death_says_the_signal_and_the_build(model_dir, bench_engine, tmp_path):
    """llama.cpp's process dying under a call is noticed while the bench waits (not at the
    deadline), says its signal and what the build has to do with it; the next workload gets a
    fresh process (which dies again), and close() of a dead process raises nothing."""
    workloads = build_workloads(["requests", "generate"], "small", load_tokenizer(model_dir).encode)
    ctx = Context(model_dir, bench_engine, tmp_path, SHAPES["small"].context, deadline_s=600)
    system = FaultingLlamaCpp()
    results = run_system(system, workloads, ctx, repeats=1, sample_rows=None)
    assert [r.status for r in results] == ["died", "died"], results
    for r in results:
        assert r.reason.startswith("llama.cpp process died: SIGILL; its build runs AMX kernels")
        assert "bench/README.md" in r.reason
        assert r.warnings == []
    assert system.exit_code() == -signal.SIGILL
    with pytest.raises(Died, match="SIGILL"):  # and a call after it died says so at once
        system.score([], None)


def test_exit_reasons_and_fault_hints():
    assert exit_reason("llama.cpp", -signal.SIGILL) == "llama.cpp process died: SIGILL"
    assert exit_reason("runner", -signal.SIGKILL) == "runner process died: SIGKILL"
    assert exit_reason("runner", 3) == "runner process exited with status 3"
    amx = bench_children.AMX_BUILD
    assert "AMX" in fault_hint(-signal.SIGILL, amx)
    assert "instruction" in fault_hint(-signal.SIGILL, "CPU : AVX2 = 1 | AMX_INT8 = 0 |")
    assert fault_hint(-signal.SIGKILL, amx) == ""


def test_the_header_has_the_dispatch_level_and_the_llama_cpp_build():
    """Beside the matmul rates: the runner's dispatch level (what its library says, or
    derived from what it exports and the CPU's flags), whether its decode steps take limbs,
    and llama.cpp's system info."""

    class Older:  # exports its version and whether it reads half panels
        def runner_sgemm_dispatch_version(self) -> int:
            return 6

        def runner_half_weights(self) -> int:
            return 1

    class NoHalves(Older):
        def runner_half_weights(self) -> int:
            return 0

    class Newer:  # says its level
        def runner_native_abi_version(self) -> int:
            return 7

        def runner_native_level(self) -> bytes:
            return b"avx2"

    avx512 = {"sse2", "avx", "avx2", "f16c", "avx512f"}
    derived = "runner_sgemm_dispatch_version() 6, level derived from the CPU's flags"
    assert dispatch_level(avx512, Older()) == f"{LEVELS['avx512']}; {derived}"
    assert dispatch_level({"avx", "avx2", "f16c"}, Older()) == f"{LEVELS['avx2']}; {derived}"
    assert dispatch_level({"sse2", "avx"}, NoHalves()).startswith("AVX (256-bit vectors")
    assert dispatch_level(avx512, Newer()) == (
        f"{LEVELS['avx2']}; runner_native_abi_version() 7, level runner_native_level()"
    )
    assert dispatch_level(avx512, object()).startswith("not loaded")

    class Limbs(Newer):  # says whether decode steps take limbs (AVX512-VNNI or AVX2)
        def runner_limb_products(self) -> int:
            return 1

    assert dispatch_level(avx512, Limbs()).endswith("runner_native_level(); decode by limbs")
    info = {
        "cpu": "CPU",
        "cores": 2,
        "platform": "Linux x86_64",
        "python": "3.12",
        "backend": "Device(cpu, 0)",
        "blas": "OpenBLAS",
        "versions": {"mlx": "1"},
        "runner_commit": "abc",
        "dispatch": "AVX2 (256-bit vectors, half panels); ...",
    }
    llama = {"version": "0.3.36", "system_info": bench_children.AMX_BUILD}
    lines = format_machine(info, {"float32 1024^3": 100.0}, llama)
    assert lines[-3].startswith("matmul: float32 1024^3 100.0 GFLOP/s")
    assert lines[-2] == "dispatch: AVX2 (256-bit vectors, half panels); ..."
    assert lines[-1] == f"llama.cpp: llama-cpp-python 0.3.36; {bench_children.AMX_BUILD}"
    assert not format_machine(info, {}, None)[-1].startswith("llama.cpp")
