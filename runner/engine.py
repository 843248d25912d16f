"""The one thread that owns MLX.

MLX keeps per-thread execution state (default streams, caches, error capture), so every MLX
call (loading, forwards, eval, memory readings, clear_cache) runs on this worker. The event
loop submits jobs and awaits them; it never touches MLX itself.

Invariants:
- Jobs run one at a time, in submission order, on the same OS thread.
- A job is a plain callable that receives its `Job` (to read `cancelled`); it must check
  `job.cancelled` between units of work (prefill chunks, decode steps). A job cancelled
  while still queued never runs.
- An exception in a job is delivered to its awaiter; it never ends the worker.
- `stop()` cancels the queued and running jobs, then lets the worker exit after the running
  job returns; new submissions fail with `EngineStopped`.
- After each job's outcome is delivered (its awaiter may already be answering), the hooks
  (`after_each_job`) run on the worker before the next job: bookkeeping no answer waits for
  (the prefix caches' stores). A hook's exception is logged and never ends the worker.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

# imported before any engine starts: its exit handlers are then registered before ours
# (`_stop_at_exit`), so ours run first
import mlx.core  # noqa: F401

from runner.protocol.errors import Cancelled

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineStopped(RuntimeError):
    pass


class Job:
    """One unit of MLX work and its cancellation flag (set from any thread)."""

    def __init__(self, fn: Callable[[Job], Any], loop: asyncio.AbstractEventLoop | None):
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future[Any] | None = loop.create_future() if loop else None
        self._cancel = threading.Event()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def check(self) -> None:
        """Raise `Cancelled` if the job was cancelled: the hook between chunks."""
        if self._cancel.is_set():
            raise Cancelled()


class Engine:
    def __init__(self, name: str = "mlx"):
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._active: set[Job] = set()
        self._after: list[weakref.WeakMethod] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _stop_at_exit(self)

    # --- submission -------------------------------------------------------------------
    def submit(self, fn: Callable[[Job], T], loop: asyncio.AbstractEventLoop | None = None) -> Job:
        job = Job(fn, loop)
        with self._lock:
            if self._stopping.is_set():
                raise EngineStopped("runner is stopping")
            self._active.add(job)
        self._queue.put(job)
        return job

    def after_each_job(self, hook: Callable[[], None]) -> None:
        """Run `hook` (a bound method) on the worker after every job, once its outcome is
        delivered, for as long as its object lives: the engine does not keep a runner's
        caches alive after the runner is gone (tests load many on one engine)."""
        self._after.append(weakref.WeakMethod(hook))

    def call(self, fn: Callable[[Job], T], timeout: float | None = None) -> T:
        """Run `fn` on the worker and wait for it from a non-loop thread (start-up, tests)."""
        job = self.submit(fn)
        if not job.done.wait(timeout):
            job.cancel()
            raise TimeoutError("MLX job did not finish in time")
        if job.error is not None:
            raise job.error
        return job.result

    # --- lifecycle --------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """Whether `stop` was called: a job cancelled now was cancelled by the shutdown."""
        return self._stopping.is_set()

    def stop(self, timeout: float | None = None) -> bool:
        """Cancel everything and end the worker; True when it ended within `timeout`."""
        with self._lock:
            self._stopping.set()
            for job in self._active:
                job.cancel()
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.cancelled:
                    raise Cancelled()
                job.result = job.fn(job)
            except BaseException as e:  # delivered to the awaiter, never kills the worker
                job.error = e
                if not isinstance(e, Cancelled | Exception):
                    log.exception("MLX job raised %s", type(e).__name__)
            finally:
                with self._lock:
                    self._active.discard(job)
                job.done.set()
                if job.loop is not None and job.future is not None:
                    with contextlib.suppress(RuntimeError):  # the loop may be closed
                        job.loop.call_soon_threadsafe(_settle, job)
            self._run_hooks()

    def _run_hooks(self) -> None:
        # a function of its own: no local outlives it to keep a hook's object alive
        self._after = [ref for ref in self._after if ref() is not None]
        for ref in self._after:
            hook = ref()
            if hook is None:
                continue
            try:
                hook()
            except Exception:
                log.exception("after-job hook %s failed", getattr(hook, "__qualname__", hook))


_running: weakref.WeakSet[Engine] = weakref.WeakSet()


def _stop_at_exit(engine: Engine) -> None:
    """Stop `engine` at exit if its owner has not: a worker still inside MLX (a job, or the
    after-job hooks that run right after an answer) while MLX tears down aborts the process
    ("terminate called without an active exception"). Registered when an engine starts,
    after MLX's own exit handlers (they run last to first), so it runs before them."""
    if not _running:
        atexit.register(_stop_engines)
    _running.add(engine)


def _stop_engines() -> None:
    for engine in list(_running):
        engine.stop(timeout=10)
    atexit.unregister(_stop_engines)  # a later engine registers again, after MLX's


def _settle(job: Job) -> None:
    future = job.future
    if future is None or future.done():
        return
    if job.error is not None:
        future.set_exception(job.error)
    else:
        future.set_result(job.result)
