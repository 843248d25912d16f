"""`python -m bench.distributed`: one process against two local ranks, over HTTP.

What a group costs on top of computing: the same workloads against
- `one`: the runner alone (`python -m runner`; on a CPU its native decoder step runs the
  layers of short forwards);
- `one-mlx`: the runner alone on MLX's path, the path a group takes (the native step steps
  aside in distributed runs: runner/distributed/start.py), served by the runner's own app
  (`--serve-mlx`, this module in its own process);
- `pipeline`, `tensor`: two ranks on 127.0.0.1 (MLX's ring), `--distributed MODE`.

Every system is started first; then each workload's trials run the systems in turn, trial
by trial (a load that comes and goes on the machine falls on all alike), each system over
one kept connection; the table shows medians of `--trials`:
- `decision`: a score request of one row (~15 new tokens, 2 candidates) after a shared
  ~`--prompt`-token prompt stored once: per request;
- `prefill`: a new prompt of ~`--prompt` tokens (one row, one candidate): per prompt token;
- `decode`: a completion of `--decode` tokens (greedy) after a short prompt: per token, from
  the runner's own EvalDuration / EvalCount.

Two ranks on one 2-core machine split the same cores, so a group cannot be faster here;
`group - one-mlx` is the overhead a multi-machine user pays on top of the network: the
control channel's commands and acknowledgements, the collectives' copies and waits over
loopback, and (tensor) two all_sums a layer. `--json PATH` writes every trial.

    python -m bench.distributed --model default --modes one,one-mlx,pipeline
    python -m bench.distributed --model small --modes one,one-mlx,pipeline,tensor
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.spawned import REPO, KeptConnection, free_port, get_json, post_jsonl

QUESTIONS = [f" Question {i}: is the number {i * 7 % 97} prime?" for i in range(200)]
SHARED_WORDS = (
    "You are a careful judge. Read the passage and answer each question with Yes or No. "
    "The passage: a river runs past a town where the bakers wake before the sun, and the "
    "bridge over it was built of stone in an old year. "
)


def model_dir(name: str, into: Path) -> Path:
    if name == "default":
        from runner.sources.default_model import model_dir as default_dir

        return default_dir()
    if name in ("small", "qwen3-0.6b"):
        from bench.models import SHAPES, write_model_dir

        shape = SHAPES["small" if name == "small" else "default"]
        return write_model_dir(shape, into / name)
    return Path(name)


class Processes:
    """Processes started together (a group's ranks, or one runner); the first serves HTTP
    on `port`. Each in its own session, killed by group if SIGINT does not end it."""

    def __init__(
        self, commands: list[list[str]], envs: list[dict[str, str]], port: int, logs: list[Path]
    ):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.procs = []
        for command, env, path in zip(commands, envs, logs, strict=True):
            with open(path, "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, *command],
                        cwd=REPO,
                        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    @classmethod
    def start(cls, mode: str, model: Path, work: Path) -> Processes:
        port = free_port()
        if mode == "one":
            command = ["-m", "runner", "--model", str(model), "--port", str(port)]
            return cls([command], [{}], port, [work / "one.log"])
        if mode == "one-mlx":
            command = ["-m", "bench.distributed", "--serve-mlx", str(model), str(port)]
            return cls([command], [{}], port, [work / "one-mlx.log"])
        hostfile = work / f"hosts-{mode}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
        base = ["-m", "runner", "--model", str(model), "--distributed", mode]
        commands = [[*base, "--port", str(port)], base]
        envs = [{"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(2)]
        return cls(commands, envs, port, [work / f"{mode}-rank{r}.log" for r in range(2)])

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a process exited during start-up (see its log)")
            with contextlib.suppress(Exception):
                get_json(self.url + "/v1/status", timeout=1)
                return
            time.sleep(0.1)
        raise RuntimeError("no answer")

    def stop(self) -> None:
        if self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


class Client:
    """One system's trials over its kept connection."""

    def __init__(self, url: str, tokenizer: Any, prompt_tokens: int):
        self.url = url
        self.conn = KeptConnection(url)
        self.tokenizer = tokenizer
        words = SHARED_WORDS.split()
        shared = ""
        while len(tokenizer.encode(shared)) < prompt_tokens:
            shared += " ".join(words) + " "
        self.shared = shared

    def score(self, prompt: str, candidates: list[str]) -> float:
        body = {"rows": [{"prompt": prompt, "candidates": candidates}], "max_tokens": 2048}
        started = time.perf_counter()
        self.conn.post_json("/v1/score", body)
        return time.perf_counter() - started

    def complete(self, prompt: str, n: int) -> dict:
        body = {"Prompt": prompt, "Options": {"num_predict": n, "temperature": 0}}
        return list(post_jsonl(self.url + "/v1/completions", body, timeout=600))[-1]

    def warm(self, decode: int) -> None:
        self.score(self.shared + QUESTIONS[0], [" Yes", " No"])  # stores the shared prompt
        self.complete("The cat sat on the mat and", decode)

    def decision(self, i: int) -> float:
        """A new question after the stored prompt: seconds."""
        return self.score(self.shared + QUESTIONS[1 + i % (len(QUESTIONS) - 1)], [" Yes", " No"])

    def prefill(self, i: int) -> float:
        """A prompt seen by no one before: seconds a prompt token."""
        prompt = f"Passage {i}. " + self.shared
        return self.score(prompt, [" Yes"]) / len(self.tokenizer.encode(prompt))

    def decode(self, i: int, n: int) -> float:
        """Seconds a generated token (the runner's own EvalDuration / EvalCount)."""
        final = self.complete(f"Story {i}: the cat sat on the mat and", n)
        return final["EvalDuration"] / 1e9 / max(1, final["EvalCount"])


def measure(clients: dict[str, Client], trials: int, decode: int) -> dict[str, dict]:
    """Every workload's trials, the systems interleaved trial by trial: a load that comes
    and goes on the machine (other processes) falls on every system alike."""
    out: dict[str, dict[str, list[float]]] = {
        mode: {"decision": [], "prefill": [], "decode": []} for mode in clients
    }
    for client in clients.values():
        client.warm(decode)
    for i in range(trials):
        for mode, client in clients.items():
            out[mode]["decision"].append(client.decision(i))
    for i in range(trials):
        for mode, client in clients.items():
            out[mode]["prefill"].append(client.prefill(i))
    for i in range(max(3, trials // 4)):
        for mode, client in clients.items():
            out[mode]["decode"].append(client.decode(i, decode))
    return out


def serve_mlx(model: str, port: int) -> None:
    """The runner alone on MLX's path (the group's), served by its own app, until SIGINT."""
    import asyncio

    from aiohttp import web

    from runner.distributed.start import backend_for_group
    from runner.engine import Engine
    from runner.server.app import build_app
    from runner.service import Runner

    engine = Engine()
    runner = Runner.load(engine, model, backend=backend_for_group())

    async def run() -> None:
        app_runner = web.AppRunner(build_app(runner))
        await app_runner.setup()
        await web.TCPSite(app_runner, "127.0.0.1", port).start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
        await app_runner.cleanup()

    asyncio.run(run())
    engine.stop(timeout=5)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.distributed")
    parser.add_argument("--model", default="default", help="default, small, qwen3-0.6b or a dir")
    parser.add_argument("--modes", default="one,one-mlx,pipeline,tensor")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=480, help="tokens of the shared prompt")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve-mlx", nargs=2, metavar=("MODEL", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_mlx:
        from runner.native import preload

        preload.reexec_preloaded("bench.distributed", sys.argv[1:])
        serve_mlx(args.serve_mlx[0], int(args.serve_mlx[1]))
        return 0

    from bench.models import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    print(f"load before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    model = model_dir(args.model, work)
    tokenizer = load_tokenizer(model)
    results: dict[str, Any] = {}
    running: dict[str, Processes] = {}
    clients: dict[str, Client] = {}
    try:
        for mode in args.modes.split(","):
            started = time.monotonic()
            running[mode] = Processes.start(mode, model, work)
            try:
                running[mode].wait_ready(timeout=600)
            except RuntimeError as e:  # a mode the model cannot run (heads 2 cannot share)
                results[mode] = {"error": str(e)}
                running.pop(mode).stop()
                continue
            clients[mode] = Client(running[mode].url, tokenizer, args.prompt)
            print(f"{mode}: ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
        results.update(measure(clients, args.trials, args.decode))
    finally:
        for processes in running.values():
            processes.stop()
    print(f"load after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    report(results, args)
    if args.json:
        document = {"options": vars(args), "results": results}
        args.json.write_text(json.dumps(document, default=str))
    print(f"logs: {work}", file=sys.stderr)
    return 0


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"model={args.model} trials={args.trials} prompt~{args.prompt} decode={args.decode}")
    print(f"{'mode':10} {'decision ms':>12} {'prefill ms/tok':>15} {'decode ms/tok':>14}")
    medians: dict[str, dict[str, float]] = {}
    for mode, data in results.items():
        if "error" in data:
            print(f"{mode:10} error: {data['error']}")
            continue
        m = {k: statistics.median(v) * 1e3 for k, v in data.items()}
        medians[mode] = m
        print(f"{mode:10} {m['decision']:12.2f} {m['prefill']:15.3f} {m['decode']:14.2f}")
    base = medians.get("one-mlx")
    if base:
        for mode in ("pipeline", "tensor"):
            if mode in medians:
                m = medians[mode]
                print(
                    f"{mode} over one-mlx: +{m['decision'] - base['decision']:.2f} ms a request, "
                    f"+{m['decode'] - base['decode']:.2f} ms a token, "
                    f"+{m['prefill'] - base['prefill']:.3f} ms a prompt token"
                )


if __name__ == "__main__":
    sys.exit(main())
