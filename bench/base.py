"""What a benchmarked system is, what it returns, and what the run shares with it.

A `System` is prepared once (load a model, spawn a process), then asked to `score` a list of
requests (each a list of rows) or to `generate`, once per trial, then closed. Systems that
handle rows one at a time set `one_by_one` (their warm-up is one row). Those whose rows
each cost the same whatever ran before (no prefix cache: mlx-lm, transformers) also set
`sampled_ok`: they honour a row limit (`--sample-rows`) and the harness scales their time
up to the whole workload, which is then exact up to noise.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.workloads import GenerateWorkload, Row, Workload

if TYPE_CHECKING:
    from runner.engine import Engine
    from runner.service import Runner


class Skipped(Exception):
    """The system cannot run here at all (a package is missing, no URL was given)."""


class Unavailable(Exception):
    """The system runs, but not this workload (e.g. its endpoint answers 501)."""


class Died(Exception):
    """The system's own process ended under a call (a signal, an exit): its message says how,
    e.g. "llama.cpp process died: SIGILL" (`exit_reason`)."""


def exit_reason(process: str, returncode: int) -> str:
    """How a process ended, from its return code as subprocess and multiprocessing give it
    (negative: the signal that killed it)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{process} process died: {name}"
    return f"{process} process exited with status {returncode}"


@dataclass
class ScoreOutcome:
    # One list per computed row (the first `rows_done` rows in workload order), in candidate
    # order; None where the system could not give a value (not in its top-k).
    values: list[list[float | None]]
    rows_done: int
    computed_tokens: int  # prompt tokens run through the model (shared prefixes once)
    kind: str = "logits"  # or "logprobs": comparable only up to a per-row constant
    notes: dict[str, Any] = field(default_factory=dict)
    # Wall time and computed tokens of each request sent, in order (a one-by-one system sends
    # one request per row): per-request latency and the runner's own cost (bench/report.py).
    request_seconds: list[float] = field(default_factory=list)
    request_computed: list[int] = field(default_factory=list)
    # Where the harness probed the matmul rate between requests (`System.rate_probe`): the
    # better of the rates just before and just after each request, in GFLOP/s.
    request_rates: list[float] = field(default_factory=list)


@dataclass
class GenerateOutcome:
    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float | None = None
    decode_seconds: float | None = None
    # Tokens whose forward passes `decode_seconds` spans. Systems time decode differently:
    # the Go wire format's EvalDuration spans every generated token's forward (the first
    # included), while mlx-lm and transformers start their decode clock once the first token
    # is out, so their window holds one token fewer than they generated. Decode tokens/s is
    # decode_tokens / decode_seconds, the same steady-state rate for all.
    decode_tokens: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)


# Our runner's systems: their cost beyond the arithmetic is the runner's own (Python, HTTP,
# cache bookkeeping), since their arithmetic runs at MLX's float32 matmul rate measured here.
RUNNER_SYSTEMS = ("ours", "ours-rows", "ours-http")

# The default per-call deadline (`Context.deadline_s`, `--deadline`): longer than any trial of
# the default workloads on the 2-core VM (transformers' 64-row decisions take minutes).
DEADLINE_S = 1800.0


@dataclass
class Context:
    model_dir: Path
    engine: Engine
    work_dir: Path  # logs of spawned processes
    max_tokens: int  # the max_tokens of every /v1/score request
    baseline_url: str | None = None
    baseline_mode: str = "auto"  # auto | score | completions
    llama_cpp_src: Path | None = None  # holds convert_hf_to_gguf.py (bench/llamacpp.py)
    # the best float32 matmul rate now (bench/machine.py), measured beside our runner's
    # latency trials: their own cost is reckoned at the rate of the machine's phase then
    measure_peak: Callable[[], float | None] | None = None
    # the float32 matmul rate at this moment, in a few tens of milliseconds (bench/machine.py
    # `RateProbe`): taken between our runner's requests of a latency workload
    probe_rate: Callable[[], float | None] | None = None
    # how long the harness waits for any one call to a system (prepare, a warm-up, a trial,
    # close) before it records the system as stopped answering; None: no limit
    deadline_s: float | None = DEADLINE_S

    def load_runner(self) -> Runner:
        """A fresh Runner over the benchmark model: each in-process system has its own, so
        no system is served from a prefix cache another one filled."""
        from runner.service import Runner

        return Runner.load(self.engine, str(self.model_dir))


class System:
    name = ""
    description = ""
    one_by_one = False
    sampled_ok = False
    fresh_per_workload = False
    # What runs in a process of its own, for messages ("llama.cpp process died: SIGILL");
    # empty when the system runs in the bench's process.
    process_name = ""
    # Set by the harness on our runner's systems for a latency workload's timed trials: the
    # float32 matmul rate now (GFLOP/s), to be taken before the first request and after each
    # one, outside its timed span (`RateProbes`).
    rate_probe: Callable[[], float | None] | None = None

    def prepare(self, ctx: Context) -> None:
        """Load or start; raise Skipped when the system cannot run on this machine."""

    def close(self) -> None:
        """Release what `prepare` took (also after a failed or partial `prepare`, or after
        its process died; the harness catches what it raises)."""

    def exit_code(self, wait: float = 0.0) -> int | None:
        """The return code of the system's own process once it has ended (negative: the
        signal), waiting at most `wait` seconds for it to end; None while it runs, or for a
        system without a process of its own."""
        return None

    def memory_bytes(self) -> int | None:
        """Memory the system holds now (model, caches), where it can say; None otherwise."""
        return None

    def supports(self, workload: Workload) -> str | None:
        """Why this system does not run `workload`, or None when it does."""
        return None

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        raise NotImplementedError

    def generate(self, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
        raise NotImplementedError


class RateProbes:
    """The matmul rate probed around each request of a trial, when `probe` is set: this VM's
    rate moves by a third between phases that last from seconds to minutes, so a request's
    own cost is reckoned at the rate of its own moment (bench/report.py)."""

    def __init__(self, probe: Callable[[], float | None] | None) -> None:
        self.probe = probe
        self.rates: list[float | None] = [probe()] if probe else []

    def after_request(self) -> None:
        if self.probe:
            self.rates.append(self.probe())

    def around(self) -> list[float]:
        """The better of the rates before and after each request; empty unless every probe
        gave one."""
        rates = [r for r in self.rates if r is not None]
        if len(rates) < 2 or len(rates) < len(self.rates):
            return []
        return [max(a, b) for a, b in itertools.pairwise(rates)]


def limited(requests: list[list[Row]], limit: int | None) -> list[Row]:
    """The first `limit` rows of `requests` in order (all of them when limit is None)."""
    rows = [row for request in requests for row in request]
    return rows if limit is None else rows[:limit]


def score_rows(
    rows: list[Row], score_row: Callable[[Row], tuple[list[float | None], int]]
) -> ScoreOutcome:
    """Score `rows` one at a time, each a request of its own: `score_row(row)` gives the
    candidates' values and the prompt tokens it computed; each call is timed."""
    values: list[list[float | None]] = []
    request_seconds, request_computed = [], []
    for row in rows:
        started = time.perf_counter()
        row_values, computed = score_row(row)
        request_seconds.append(time.perf_counter() - started)
        request_computed.append(computed)
        values.append(row_values)
    return ScoreOutcome(
        values,
        len(values),
        sum(request_computed),
        request_seconds=request_seconds,
        request_computed=request_computed,
    )


def mlx_memory_bytes(engine: Engine) -> int:
    """MLX active + cached bytes of this process, read on the MLX thread."""

    def read(_job) -> int:
        import mlx.core as mx

        return int(mx.get_active_memory() + mx.get_cache_memory())

    return engine.call(read)
