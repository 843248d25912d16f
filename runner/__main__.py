"""`python -m runner --model NAME --port PORT`, as the Go supervisor spawns its runner.

The process promises (docs/PROTOCOL.md §1): flags as Go's `flag` package reads them
(runner/flags.py); the port opens only once the model is loaded, on 127.0.0.1; any start-up
failure is one `Error: ...` line on stderr and exit 1; SIGINT/SIGTERM at any moment (while
loading, idle, mid-request) stop new work, cancel what runs, and exit 0 within 5 seconds;
never an abort.

How exits stay clean: signals are caught from the first line on, so a signal during the
load is a request to stop, not a KeyboardInterrupt. Once MLX has run, the process ends with
`os._exit` after flushing its output: interpreter finalization would race the MLX thread's
native thread-local cleanup (it aborted 7 times in 20 with `terminate called without an active
exception`), and nothing the runner holds needs finalizing. The Go runner likewise exits on
SIGINT without cleanup.
"""

from __future__ import annotations

import os
import signal
import threading

# Caught from the first line on: a signal while Python starts the runner is a request to stop.
_REQUESTED = threading.Event()
# ... and written by the C-level handler, on whichever thread the kernel hands the signal to, as
# a byte into this pipe (the serving loop reads it: `serve`). The Python-level handler runs in
# the main thread only, once that thread notices it: a signal landing on another thread just
# before the loop's own handler replaced this one was never handled (seen in CI: alive 10 s
# after a SIGINT at "listening", the main thread idle in select()). The pipe is written from
# the first line on and read by the loop, so no moment is left uncovered.
_WAKE_READ, _WAKE_WRITE = os.pipe()
os.set_blocking(_WAKE_READ, False)
os.set_blocking(_WAKE_WRITE, False)
signal.set_wakeup_fd(_WAKE_WRITE, warn_on_full_buffer=False)


def _on_signal(signum: int, frame: object) -> None:
    _REQUESTED.set()


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _on_signal)
# A signal that came while the previous image re-executed this one was blocked, and is still
# pending: it is delivered (to the handler above) now.
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from runner import flags as cli  # noqa: E402

HOST = "127.0.0.1"
STOP_SECONDS = 3.0  # of the 5 s a supervisor allows, the rest is for the process to end
POLL_SECONDS = 0.05

log = logging.getLogger("runner")


def _wake_bytes() -> bytes:
    """What the wakeup pipe holds (a byte a signal number), drained; b"" when empty."""
    chunks = []
    while True:
        try:
            chunk = os.read(_WAKE_READ, 512)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


class Stop:
    """A SIGINT or SIGTERM, from the first line on: a flag the start-up polls; while the
    server runs, serve() also wakes on the signal's byte in the wakeup pipe (the top of the
    module), whichever thread took the signal."""

    def __init__(self) -> None:
        self.requested = _REQUESTED  # set by any signal since the module was imported
        self.install()

    def install(self) -> None:
        """This object's handler for SIGINT and SIGTERM, in from start-up to exit."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.requested.set()


def finish(code: int) -> None:
    """End the process now, output flushed (see the module docstring for why not `exit`)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to flush to
            stream.flush()
    os._exit(code)


def fail(message: str) -> None:
    """A start-up failure: one `Error:` line, exit 1."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"Error: {line}", file=sys.stderr, flush=True)
    finish(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stop = Stop()
    flags = cli.parse_or_exit(argv)
    from runner import environment

    env = environment.start_env(dict(os.environ))
    if env is not None:  # before MLX is imported: the loader reads these at process start
        # A signal from here on stays pending across the exec (see the top of the module).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        if stop.requested.is_set():
            finish(0)
        os.execve(sys.executable, [sys.executable, "-m", "runner", *argv], env)
    verbose = flags.verbose or os.environ.get("OLLAMA_DEBUG", "") not in ("", "0", "false")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="time=%(asctime)s level=%(levelname)s source=%(name)s msg=%(message)s",
        stream=sys.stderr,
    )
    environment.log_removed()
    if not flags.model:
        fail("no model given: pass --model NAME (an Ollama model name or a directory)")
    if stop.requested.is_set():
        finish(0)
    runner = load(flags, stop)
    # What loading made lives as long as the process: keep it out of the cyclic collector's
    # scans, which took ~5% of a batched score request's CPU time.
    gc.collect()
    gc.freeze()
    try:
        asyncio.run(serve(runner, flags.port, stop, flags.host, flags.serve))
    except ListenError as e:
        fail(str(e))
    stopped = runner.engine.stop(timeout=STOP_SECONDS)
    if not stopped:  # a forward is still inside MLX; the supervisor's deadline comes first
        log.warning("MLX job still running at exit; exiting now")
    if distributed_mode(flags):
        from runner.distributed.start import stop_group

        stop_group()  # the other ranks exit too
    finish(0)
    return 0


def load(flags: cli.Flags, stop: Stop):
    """The model, loaded off the main thread (importing MLX, mlx-lm and transformers alone
    takes seconds of C code that no signal interrupts), so that the main thread sees a stop
    within 50 ms and ends the process (exit 0) without waiting for the load; a failure is
    `Error:` and exit 1."""
    outcome: dict[str, object] = {}

    def loading() -> None:
        try:
            from runner.cache.budget import ByteBudget, budget_from_env
            from runner.engine import Engine
            from runner.native import preload
            from runner.service import Runner
        except Exception as e:  # a broken installation: MLX or a dependency cannot load
            outcome["error"] = f"cannot start the runner: {type(e).__name__}: {e}"
            return
        try:
            log.info("CPU BLAS: %s", preload.describe())
            limit = flags.cache_bytes if flags.cache_bytes is not None else budget_from_env()
            if distributed_mode(flags):  # one rank of a process group: runner/distributed/
                from runner.distributed.start import start

                mode = distributed_mode(flags)
                outcome.update(start(mode, flags.pipeline_split, flags.model, limit, fail))
                return
            engine = Engine()
            outcome["runner"] = Runner.load(engine, flags.model, cache_budget=ByteBudget(limit))
        except Exception as e:  # reported by the main thread
            outcome["error"] = str(e) or type(e).__name__

    thread = threading.Thread(target=loading, name="load", daemon=True)
    thread.start()
    while thread.is_alive():
        if stop.requested.wait(POLL_SECONDS):
            log.info("stopping during the load")
            finish(0)
    if "error" in outcome:
        fail(str(outcome["error"]))
    if "exit" in outcome:  # a rank other than 0 served its group and is done
        finish(int(outcome["exit"]))  # type: ignore[call-overload]
    return outcome["runner"]


def distributed_mode(flags: cli.Flags) -> str:
    """--distributed, else OLLAMA_MLX_RUNNER_DISTRIBUTED (runner/distributed/start.py)."""
    return flags.distributed or os.environ.get("OLLAMA_MLX_RUNNER_DISTRIBUTED", "").strip()


class ListenError(Exception):
    """The port cannot be listened on; the message is Go's net.Listen error text."""


async def serve(
    runner, port: int, stop: Stop, host: str = HOST, public_faces: bool = False
) -> None:
    """Serve until stopped; `public_faces` (`serve`): the OpenAI and Ollama faces too, on
    `host` (runner/server/serve.py)."""
    from aiohttp import web

    from runner.server.app import build_app

    if not 0 <= port <= 65535:
        raise ListenError(f"listen tcp: address {port}: invalid port")
    if public_faces:
        from runner.server.serve import build_serve_app

        app = build_serve_app(runner)
    else:
        app = build_app(runner)
    app_runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await app_runner.setup()
    site = web.TCPSite(app_runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await app_runner.cleanup()
        reason = e.strerror.lower() if e.strerror else str(e)
        raise ListenError(f"listen tcp {host}:{port}: bind: {reason}") from None
    log.info("listening on %s:%d", host, port)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Through the wakeup pipe (see the top of the module): a signal lands on whichever thread
    # the kernel picks (the engine's, MLX's, the BLAS's, the native pool's), and Python runs
    # its handler in the main thread only when that thread runs; an idle server's sleeps in
    # select() until the pipe's byte wakes it (with a plain handler: seen alive 10 s after a
    # SIGINT, tests/test_subprocess.py). Stop's handler stays in: a second signal is caught.
    stop_signals = {signal.SIGINT, signal.SIGTERM}

    def woken() -> None:
        if stop_signals & set(_wake_bytes()) or stop.requested.is_set():
            stopping.set()

    loop.add_reader(_WAKE_READ, woken)
    woken()  # a signal before the reader: its byte waits in the pipe (or Stop saw it)
    try:
        await stopping.wait()
    finally:
        loop.remove_reader(_WAKE_READ)
    log.info("stopping: cancelling work")
    runner.engine.stop(timeout=0)  # cancel flags now; the worker ends after its chunk
    await app_runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
