"""The MLX worker: one thread, FIFO, errors delivered, cancellation honoured."""

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from runner.engine import Engine, EngineStopped
from runner.protocol.errors import Cancelled


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.stop(timeout=5)


def test_jobs_run_in_order_on_one_thread(engine):
    seen = []
    jobs = [
        engine.submit(lambda job, i=i: seen.append((i, threading.get_ident()))) for i in range(20)
    ]
    for job in jobs:
        assert job.done.wait(5)
    assert [i for i, _ in seen] == list(range(20))
    assert len({t for _, t in seen}) == 1
    assert seen[0][1] != threading.get_ident()


def test_call_returns_value_and_raises_errors(engine):
    assert engine.call(lambda job: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda job: 1 / 0)
    assert engine.call(lambda job: "still serving") == "still serving"


def test_job_cancelled_while_queued_never_runs(engine):
    gate = threading.Event()
    ran = []
    blocker = engine.submit(lambda job: gate.wait(5))
    queued = engine.submit(lambda job: ran.append(True))
    queued.cancel()
    gate.set()
    assert blocker.done.wait(5) and queued.done.wait(5)
    assert ran == []
    assert isinstance(queued.error, Cancelled)


def test_running_job_sees_cancellation_between_chunks(engine):
    started = threading.Event()
    chunks = []

    def work(job):
        started.set()
        for i in range(1000):
            job.check()
            chunks.append(i)
            threading.Event().wait(0.001)

    job = engine.submit(work)
    assert started.wait(5)
    job.cancel()
    assert job.done.wait(5)
    assert isinstance(job.error, Cancelled)
    assert len(chunks) < 1000


async def test_a_job_settles_its_future_on_the_loop(engine):
    """The loop awaits a job's future: its result, or its error (a cancellation included)."""
    loop = asyncio.get_running_loop()
    assert await engine.submit(lambda job: "done", loop).future == "done"
    started = threading.Event()

    def work(job):
        started.set()
        while True:
            job.check()
            threading.Event().wait(0.001)

    job = engine.submit(work, loop)
    await loop.run_in_executor(None, started.wait, 5)
    job.cancel()
    with pytest.raises(Cancelled):
        await job.future


def test_stop_cancels_running_work_and_rejects_new(engine):
    started = threading.Event()

    def work(job):
        started.set()
        while True:
            job.check()
            threading.Event().wait(0.001)

    job = engine.submit(work)
    assert started.wait(5)
    assert engine.stop(timeout=5)
    assert isinstance(job.error, Cancelled)
    with pytest.raises(EngineStopped):
        engine.submit(lambda job: None)


def test_hooks_run_after_each_job_is_delivered(engine):
    """`after_each_job`: the job's outcome is delivered before its hooks run (an awaiter may
    answer while the runner stores), the next job waits for them, a failing hook is logged
    and the worker goes on, and a hook whose object is gone is dropped."""

    class Bookkeeper:
        def __init__(self):
            self.seen = []
            self.release = threading.Event()

        def after(self):
            self.seen.append(("hook", jobs[-1].done.is_set()))
            self.release.wait(5)

    class Failing:
        def after(self):
            raise RuntimeError("hook failed")

    keeper, failing = Bookkeeper(), Failing()
    engine.after_each_job(keeper.after)
    engine.after_each_job(failing.after)
    seen, release = keeper.seen, keeper.release
    jobs = [engine.submit(lambda job: seen.append("first"))]
    assert jobs[0].done.wait(5)  # delivered while the hook still waits
    jobs.append(engine.submit(lambda job: seen.append("second")))
    assert not jobs[1].done.wait(0.2)  # the next job waits for the hooks
    release.set()
    assert jobs[1].done.wait(5) and jobs[1].error is None
    for _ in range(500):  # the hook runs after "second" too (released: no wait)
        if len(seen) == 4:
            break
        time.sleep(0.01)
    assert seen == ["first", ("hook", True), "second", ("hook", True)]
    release.clear()
    del keeper  # its hook goes with it: the next job would wait 5 s on `release`
    started = time.monotonic()
    assert engine.call(lambda job: "no hook left") == "no hook left"
    assert time.monotonic() - started < 2 and len(seen) == 4


EXITS_WHILE_A_HOOK_RUNS = """
import mlx.core as mx
from runner.engine import Engine

class Store:
    def after(self):
        for _ in range(40):
            mx.eval(mx.matmul(mx.ones((256, 256)), mx.ones((256, 256))))

engine = Engine()
store = Store()
engine.after_each_job(store.after)
assert engine.call(lambda job: 42) == 42
print("answered")  # and exit at once, the hook still in MLX on the worker
"""


def test_a_process_exiting_while_a_hook_runs_exits_cleanly():
    """An engine its owner never stopped is stopped at exit before MLX tears down: a worker
    still inside MLX then aborted the process ("terminate called without an active
    exception"), which the after-job hooks made likely (they run right after an answer)."""
    done = subprocess.run(
        [sys.executable, "-c", EXITS_WHILE_A_HOOK_RUNS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "answered" and "terminate" not in done.stderr
