"""`python -m runner --model NAME --port PORT`, as the Go supervisor spawns its runner.

Accepted spellings (docs/PROTOCOL.md §1): leading `runner --mlx-engine` words are ignored;
`-model X`, `--model X`, `--model=X`; `--verbose`. The port opens only once the model is
loaded, on 127.0.0.1. A fatal start-up error is one `Error: ...` line on stderr and exit 1.
SIGINT/SIGTERM stop new work, cancel what runs, and exit 0 within 5 seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

HOST = "127.0.0.1"
STOP_SECONDS = 3.0  # of the 5 s a supervisor allows, the rest is for interpreter exit


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = list(argv)
    # The Go supervisor writes `<exe> runner --mlx-engine --model ...`.
    if args[:1] == ["runner"]:
        args = args[1:]
    args = [a for a in args if a not in ("--mlx-engine", "-mlx-engine")]
    parser = argparse.ArgumentParser(prog="ollama-mlx-runner", allow_abbrev=False)
    parser.add_argument("-model", "--model", required=True, help="Ollama model name or a directory")
    parser.add_argument("-port", "--port", type=int, default=0, help="TCP port on 127.0.0.1")
    parser.add_argument("-verbose", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "-cache-bytes",
        "--cache-bytes",
        type=int,
        default=None,
        help="byte budget of the prefix caches (default: $OLLAMA_MLX_RUNNER_CACHE_BYTES or 8 GiB)",
    )
    return parser.parse_args(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from . import blas

    env = blas.preload_env(dict(os.environ))
    if env is not None:  # before MLX is imported: LD_PRELOAD only acts at process start
        os.execve(sys.executable, [sys.executable, "-m", "runner", *argv], env)
    verbose = args.verbose or os.environ.get("OLLAMA_DEBUG", "") not in ("", "0", "false")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="time=%(asctime)s level=%(levelname)s source=%(name)s msg=%(message)s",
        stream=sys.stderr,
    )
    # Imported late so that `--help` and flag errors do not pay for MLX start-up.
    from .cache.budget import ByteBudget, budget_from_env
    from .engine import Engine
    from .service import Runner

    logging.getLogger(__name__).info("CPU BLAS: %s", blas.describe())
    engine = Engine()
    try:
        budget = ByteBudget(args.cache_bytes if args.cache_bytes is not None else budget_from_env())
        runner = Runner.load(engine, args.model, cache_budget=budget)
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"Error: {message}", file=sys.stderr, flush=True)
        engine.stop(timeout=1)
        return 1
    # What loading made lives as long as the process: keep it out of the cyclic collector's
    # scans, which took ~5% of a batched score request's CPU time.
    gc.collect()
    gc.freeze()
    try:
        asyncio.run(serve(runner, args.port))
    finally:
        stopped = engine.stop(timeout=STOP_SECONDS)
    if not stopped:
        # A forward is still inside MLX; it cannot be interrupted, and the supervisor's
        # deadline matters more than a tidy interpreter shutdown.
        logging.getLogger(__name__).warning("MLX job still running at exit; exiting now")
        sys.stderr.flush()
        os._exit(0)
    return 0


async def serve(runner, port: int) -> None:
    from aiohttp import web

    from .app import build_app

    app = build_app(runner)
    app_runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await app_runner.setup()
    site = web.TCPSite(app_runner, HOST, port)
    await site.start()
    log = logging.getLogger(__name__)
    log.info("listening on %s:%d", HOST, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: cancelling work")
    runner.engine.stop(timeout=0)  # cancel flags now; the worker ends after its chunk
    await app_runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
