"""A model over two and three processes: MLX's ring on 127.0.0.1, tiny random models.

Each test starts its ranks as a user would (`MLX_RANK` and `MLX_HOSTFILE` per process, the
same `python -m runner --model M --distributed MODE` everywhere, `--port` on rank 0), each
rank in its own process group, and kills what is left by process group at teardown; every
test has a hard timeout (a hang is the failure mode). Rank 0 compares every rank's
prefix-cache digest after every job (`OLLAMA_MLX_RUNNER_CHECK_RANKS=1`, and would exit with
`Error:` on a difference); the tests also compare each rank's logged digests in order.

Numbers: pipeline ranks give rank 0 the same products one process computes (bit-identical
to one process on MLX's path, the path a group takes); tensor ranks sum reordered partial
products: within `TENSOR_TOLERANCE`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runner.distributed.shard import SUPPORTED, Mode, even_split
from runner.distributed.start import backend_for_group
from runner.native import preload
from runner.protocol.wire import decode_completion_request
from runner.score.validate import Row
from runner.server.endpoints import CompletionEndpoint
from runner.service import Runner
from runner.text.tokenizer import Tokenizer
from tests.tiny import load_tiny_model, tiny_config, tokenizer_json, write_tiny_model
from tools.spawned import _die_with_parent, free_port, get_json, post_json

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TENSOR_TOLERANCE = 1e-5  # float32 logits, absolute (measured: a few 1e-7 on these models)
SHARED = "Is the sky blue? Yes. Is grass red? No. " * 6


def rank_env() -> dict[str, str]:
    """What every process of a test gets: unbuffered logs, and the BLAS this process has
    (the runner re-executes itself with OpenBLAS where this process runs without it)."""
    env = {"PYTHONUNBUFFERED": "1"}
    if not preload.dispatch_active():  # the ranks compute as this process does
        env["OLLAMA_MLX_RUNNER_BLAS"] = "reference"
    return env


class Ranks:
    """`size` ranks of one group; rank 0 serves HTTP on `port`."""

    def __init__(
        self,
        tmp: Path,
        size: int,
        model: Path | None,
        *flags: str,
        env: dict | None = None,
        command: list[str] | None = None,
        late: dict[int, float] | None = None,
    ):
        self.tmp = tmp
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(size)]))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = {
            **rank_env(),
            "MLX_HOSTFILE": str(hostfile),
            "OLLAMA_MLX_RUNNER_CHECK_RANKS": "1",
            **(env or {}),
        }
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for rank in range(size):
            args = [sys.executable, "-m", "runner", "--model", str(model), *flags]
            if command is not None:
                args = [sys.executable, *command]
            elif rank == 0:
                args += ["--port", str(self.port)]
            if late and rank in late:  # the same process, its Python started `late` s later
                args = ["/bin/sh", "-c", f'sleep {late[rank]}; exec "$0" "$@"', *args]
            log = tmp / f"rank{rank}.log"
            self.logs.append(log)
            with open(log, "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        args,
                        cwd=REPO,
                        env={**os.environ, **extra, "MLX_RANK": str(rank)},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group, killed at teardown
                        preexec_fn=_die_with_parent,
                    )
                )

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rank, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise AssertionError(f"rank {rank} exited {p.returncode}: {self.output(rank)}")
            try:
                get_json(self.url + "/v1/status", timeout=1)
                return
            except Exception:
                time.sleep(0.1)
        raise AssertionError(f"not ready: {self.output(0)[-2000:]}")

    def score(self, rows: list[tuple[str, list[str]]]) -> list[list[float]]:
        body = {"rows": [{"prompt": p, "candidates": c} for p, c in rows], "max_tokens": 2048}
        return post_json(self.url + "/v1/score", body, timeout=60)["logits"]

    def complete(self, prompt: str, n: int) -> tuple[str, dict]:
        body = {"Prompt": prompt, "Options": {"num_predict": n, "temperature": 0}}
        with contextlib.closing(
            http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        ) as c:
            c.request("POST", "/v1/completions", json.dumps(body))
            lines = [json.loads(x) for x in c.getresponse().read().splitlines() if x.strip()]
        return "".join(x.get("Content", "") for x in lines), lines[-1]

    def abandon_completion(self, prompt: str, lines: int = 2) -> None:
        """Start a long completion, read a few lines, hang up (rank 0 cancels it)."""
        body = {"Prompt": prompt, "Options": {"num_predict": 1500, "temperature": 0}}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps(body))
        response = c.getresponse()
        for _ in range(lines):
            response.readline()
        c.close()

    def digests(self, rank: int) -> list[str]:
        text = self.output(rank)
        if rank == 0:
            return re.findall(r"ranks in step check=\d+ digest=(\w+)", text)
        return re.findall(r"cache index digest=(\w+)", text)

    def assert_in_step(self) -> int:
        """Every rank logged rank 0's digests, in order; none exited with an error."""
        mine = self.digests(0)
        assert mine, self.output(0)[-2000:]
        for rank in range(1, len(self.procs)):
            assert self.digests(rank)[: len(mine)] == mine, self.output(rank)[-2000:]
        assert "Error:" not in self.output(0), self.output(0)[-2000:]
        return len(mine)

    def alive(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]


def pids_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
            if f.read().split()[2] != "Z":
                return False
    return True


# --- models and one-process references ----------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM"):
        out[arch] = write_tiny_model(arch, tmp_path_factory.mktemp(arch))
    # three ranks of tensor parallelism need heads that three share: 6 heads, 3 KV heads
    six = {**tiny_config("LlamaForCausalLM"), "num_attention_heads": 6, "num_key_value_heads": 3}
    six.update(hidden_size=96, intermediate_size=96)  # 6 heads of 16; MLP columns by 3
    out["six"] = write_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("six"), config=six)
    windowed = {**tiny_config("Qwen3ForCausalLM"), "num_hidden_layers": 3, "sliding_window": 8}
    windowed.update(
        use_sliding_window=True, layer_types=["sliding_attention"] + 2 * ["full_attention"]
    )
    out["windowed"] = write_tiny_model(
        "Qwen3ForCausalLM", tmp_path_factory.mktemp("w"), config=windowed
    )
    return out


@pytest.fixture(scope="module")
def reference(engine, dirs):
    """One process on MLX's path (what a group computes with), per model directory."""
    runners: dict[str, Runner] = {}

    def get(name: str) -> Runner:
        if name not in runners:
            arch = "LlamaForCausalLM" if name == "six" else name
            model = load_tiny_model(arch, dirs[name], backend=backend_for_group())
            runners[name] = engine.call(
                lambda job: Runner(engine, model, Tokenizer(tokenizer_json()), name)
            )
        return runners[name]

    return get


def expected_scores(engine, runner: Runner, rows: list[tuple[str, list[str]]]) -> list[list[float]]:
    tok = runner.tokenizer
    prepared = [
        Row(tok.encode(p), [tok.encode(p + c)[len(tok.encode(p))] for c in cands])
        for p, cands in rows
    ]
    return engine.call(lambda job: runner.scorer.score(prepared, job.check)).logits


SCORE_ROWS = [
    (SHARED + "Is fire hot?", [" Yes", " No"]),
    (SHARED + "Is ice hot?", [" Yes", " No"]),
    (SHARED + "Is it?", [" Yes", " No", " A"]),
]


# --- exactness ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_tensor_two_ranks_within_tolerance_of_one_process(tmp_path, dirs, engine, reference):
    expected = expected_scores(engine, reference("LlamaForCausalLM"), SCORE_ROWS)
    with Ranks(tmp_path, 2, dirs["LlamaForCausalLM"], "--distributed", "tensor") as ranks:
        ranks.wait_ready()
        for _ in range(2):  # computed, then every row from the cache
            got = ranks.score(SCORE_ROWS)
            for g, e in zip(got, expected, strict=True):
                assert g == pytest.approx(e, abs=TENSOR_TOLERANCE)
        single = ranks.score([SCORE_ROWS[0]])
        assert single[0] == pytest.approx(expected[0], abs=TENSOR_TOLERANCE)
        _text, final = ranks.complete("The cat sat on", 12)
        assert final["Done"] and final["EvalCount"] >= 1
        assert ranks.assert_in_step() >= 4
        assert "tensor parallel: rank 1 of 2" in ranks.output(1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("size", "split"), [(2, "1,2"), (3, "1,1,1")])
def test_pipeline_is_bit_identical_to_one_process(tmp_path, dirs, engine, reference, size, split):
    """Qwen2's three layers, one full and two windowed: rank 0 runs the last (one window),
    rank 1 the first two (unevenly), or one each over three ranks."""
    qwen2 = reference("Qwen2ForCausalLM")
    expected = expected_scores(engine, qwen2, SCORE_ROWS)
    flags = ("--distributed", "pipeline", "--pipeline-split", split)
    with Ranks(tmp_path, size, dirs["Qwen2ForCausalLM"], *flags) as ranks:
        ranks.wait_ready()
        assert ranks.score(SCORE_ROWS) == expected  # batched rows over a shared prefix
        assert ranks.score(SCORE_ROWS) == expected  # from the cache
        assert ranks.score(SCORE_ROWS[1:2]) == expected[1:2]
        text, _final = ranks.complete("The cat sat on", 16)
        assert text == complete_alone(qwen2, "The cat sat on", 16)
        assert ranks.assert_in_step() >= 4
        first = int(split.split(",")[-1])  # the last rank runs the first layers
        assert f"rank {size - 1} of {size} runs layers [0, {first})" in ranks.output(size - 1)


def complete_alone(runner: Runner, prompt: str, n: int) -> str:
    body = {"Prompt": prompt, "Options": {"num_predict": n, "temperature": 0}}
    request = decode_completion_request(json.dumps(body).encode())
    return "".join(line.Content for line in CompletionEndpoint(runner)(request))


FAMILIES = [
    (arch, mode.value) for mode in Mode for arch in SUPPORTED[mode] if arch.endswith("ForCausalLM")
]


@pytest.mark.timeout(300)
def test_every_supported_family_matches_one_process(tmp_path):
    """Each family and mode the runner serves, split over two ranks (one process pair for
    all: tests/distributed_families.py), against one process: pipeline bit for bit, tensor
    within float32 rounding."""
    specs = []
    for arch, mode in FAMILIES:
        path = tmp_path / arch
        if not path.exists():
            write_tiny_model(arch, path)
        specs.append(f"{path}:{arch}:{mode}")
    alone, split = tmp_path / "alone", tmp_path / "group"
    alone.mkdir()
    split.mkdir()
    command = ["-m", "tests.distributed_families"]
    run = subprocess.run(
        [sys.executable, *command, str(alone), "--alone", *specs],
        cwd=REPO,
        env={**os.environ, **rank_env()},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    with Ranks(tmp_path, 2, None, command=[*command, str(split), *specs]) as ranks:
        codes = [p.wait(timeout=240) for p in ranks.procs]
        assert codes == [0, 0], ranks.output(0)[-3000:] + ranks.output(1)[-3000:]
    said = ranks.output(0) + ranks.output(1)
    for arch, mode in FAMILIES:
        total = int(re.search(rf"{arch} {mode} rank 0 layers (\d+)", run.stdout).group(1))
        for rank in (0, 1):
            n = int(re.search(rf"{arch} {mode} rank {rank} layers (\d+)", said).group(1))
            assert n == (total if mode == "tensor" else even_split(total, 2)[rank]), (arch, rank)
        one = np.load(alone / f"{arch}-{mode}.npy")
        two = np.load(split / f"{arch}-{mode}.npy")
        if mode == "pipeline":
            assert np.array_equal(one, two), (arch, mode)
        else:
            np.testing.assert_allclose(two, one, rtol=0, atol=TENSOR_TOLERANCE, err_msg=arch)


# --- the cache index in step ----------------------------------------------------------------


@pytest.mark.timeout(240)
def test_hits_evictions_extensions_and_cancellations_keep_every_rank_in_step(tmp_path, dirs):
    """Three pipeline ranks of a Qwen3 whose first layer alone is windowed (window 8: it
    wraps), so rank 2 holds a window and rank 0 none (rank 0 restores through its phantom
    slot, or rank 2 would fail a restore); a budget that evicts; every rank's digest after
    every job."""
    flags = ("--distributed", "pipeline", "--cache-bytes", "40000", "--verbose")
    with Ranks(tmp_path, 3, dirs["windowed"], *flags) as ranks:
        ranks.wait_ready()
        assert "phantom point slot" in ranks.output(0)
        rng = random.Random(5)
        for i in range(12):
            base = SHARED[: rng.randint(10, len(SHARED))]
            rows = [(base + f" Q{i}-{j}?", [" Yes", " No"]) for j in range(rng.randint(1, 4))]
            first = ranks.score(rows)
            assert ranks.score(rows) == first  # full hits
            if i % 3 == 0:
                text, _ = ranks.complete(base, 5)
                ranks.complete(base + text + " And", 3)  # extends the chat
            if i % 4 == 1:
                ranks.abandon_completion(base + " Tell me more.")
        assert ranks.assert_in_step() >= 30
        assert "evicted [" in ranks.output(0)  # rank 0's decisions (--verbose logs them)
        assert "evicted [" in ranks.output(1)  # applied by the others


@pytest.mark.timeout(300)
def test_200_mixed_requests_without_a_hang(tmp_path, dirs):
    flags = ("--distributed", "pipeline", "--pipeline-split", "2,1", "--cache-bytes", "300000")
    with Ranks(tmp_path, 2, dirs["Qwen2ForCausalLM"], *flags) as ranks:
        ranks.wait_ready()
        rng = random.Random(11)
        started = time.monotonic()
        for _i in range(200):
            kind = rng.random()
            base = SHARED[: rng.randint(1, len(SHARED))]
            if kind < 0.55:
                n = rng.randint(1, 5)
                rows = [(base + f" R{rng.randint(0, 30)}?", [" Yes", " No"]) for _ in range(n)]
                assert len(ranks.score(rows)) == n
            elif kind < 0.9:
                _, final = ranks.complete(base, rng.randint(1, 8))
                assert final["Done"]
            else:
                ranks.abandon_completion(base, lines=rng.randint(1, 3))
        elapsed = time.monotonic() - started
        assert ranks.assert_in_step() >= 200
        print(f"200 mixed requests in {elapsed:.1f} s")


# --- faults -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("victim", "busy", "sig"),
    [
        (2, False, signal.SIGKILL),
        (2, True, signal.SIGKILL),
        (0, True, signal.SIGKILL),
        (1, False, signal.SIGINT),
    ],
)
def test_a_killed_rank_ends_the_group(tmp_path, dirs, victim, busy, sig):
    """Rank 2 killed (idle, or while rank 0 decodes) or rank 1 interrupted: rank 0 exits 1
    within 1.5 s with one `Error:` line naming it. Rank 0 killed mid-decode: the others
    stop. No process of the group is left."""
    with Ranks(tmp_path, 3, dirs["Qwen2ForCausalLM"], "--distributed", "pipeline") as ranks:
        ranks.wait_ready()
        ranks.score(SCORE_ROWS)
        pids = ranks.alive()
        if busy:
            body = json.dumps({"Prompt": SHARED, "Options": {"num_predict": 3000}})
            c = http.client.HTTPConnection("127.0.0.1", ranks.port, timeout=30)
            c.request("POST", "/v1/completions", body)
            c.getresponse().readline()  # decoding now
        killed = time.monotonic()
        os.kill(ranks.procs[victim].pid, sig)
        if sig == signal.SIGINT:
            assert ranks.procs[victim].wait(timeout=10) == 0
        others = [p for rank, p in enumerate(ranks.procs) if rank != victim]
        codes = [p.wait(timeout=10) for p in others]
        assert all(code != 0 for code in codes), codes
        if victim != 0:
            assert time.monotonic() - killed < 1.5
            errors = [x for x in ranks.output(0).splitlines() if x.startswith("Error: ")]
            assert len(errors) == 1 and errors[0].startswith(f"Error: rank {victim} of the group")
        else:
            assert time.monotonic() - killed < 5
        assert pids_gone(pids)


@pytest.mark.timeout(180)
def test_a_rank_started_long_after_the_others_still_joins(tmp_path, dirs):
    """MLX's ring gives a connect 15 s of tries: rank 1 started 20 s after ranks 0 and 2
    (rank 0 had accepted rank 2 and was connecting to rank 1) ended the group with
    "[ring] Couldn't connect" before the ranks met first. Now the group forms and serves."""
    model = dirs["Qwen2ForCausalLM"]
    with Ranks(tmp_path, 3, model, "--distributed", "pipeline", late={1: 20}) as ranks:
        ranks.wait_ready(timeout=150)
        assert len(ranks.score(SCORE_ROWS)) == len(SCORE_ROWS)
        assert len(ranks.alive()) == 3


@pytest.mark.timeout(60)
def test_a_rank_that_never_starts_ends_rank_0_at_the_deadline(tmp_path, dirs):
    """MLX's ring accepts with no deadline and holds the interpreter lock meanwhile, so
    rank 0 waited forever for a rank never started; now it exits 1 at the group's deadline
    naming the rank."""
    env = {"OLLAMA_MLX_RUNNER_GROUP_SECONDS": "4"}
    model = dirs["Qwen2ForCausalLM"]
    with Ranks(tmp_path, 2, model, "--distributed", "pipeline", env=env, late={1: 600}) as ranks:
        assert ranks.procs[0].wait(timeout=40) == 1
        errors = [x for x in ranks.output(0).splitlines() if x.startswith("Error: ")]
        assert errors == [
            "Error: the process group did not form within 4 s (ranks [1] did not start; "
            "OLLAMA_MLX_RUNNER_GROUP_SECONDS sets the deadline)"
        ], ranks.output(0)


@pytest.mark.timeout(120)
def test_sigint_to_rank_0_stops_every_rank(tmp_path, dirs):
    with Ranks(tmp_path, 3, dirs["six"], "--distributed", "tensor") as ranks:
        ranks.wait_ready()
        ranks.score(SCORE_ROWS)
        pids = ranks.alive()
        assert len(pids) == 3
        ranks.procs[0].send_signal(signal.SIGINT)
        assert [p.wait(timeout=10) for p in ranks.procs] == [0, 0, 0]
        assert pids_gone(pids)
        for rank in (1, 2):
            assert f"rank {rank}: stopping (rank 0 stops)" in ranks.output(rank)


@pytest.mark.timeout(120)
def test_a_stuck_rank_is_caught_by_the_watchdog(tmp_path, dirs):
    env = {"OLLAMA_MLX_RUNNER_RANK_TIMEOUT": "2"}
    with Ranks(tmp_path, 2, dirs["LlamaForCausalLM"], "--distributed", "tensor", env=env) as ranks:
        ranks.wait_ready()
        ranks.score(SCORE_ROWS)
        stopped = time.monotonic()
        os.kill(ranks.procs[1].pid, signal.SIGSTOP)  # idle: caught by its unanswered ping
        assert ranks.procs[0].wait(timeout=15) == 1
        assert time.monotonic() - stopped < 5
        (error,) = [x for x in ranks.output(0).splitlines() if x.startswith("Error: ")]
        assert error.startswith("Error: rank 1 of the group is stuck"), error


# --- start-up -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "size", "flags", "message"),
    [
        ("LlamaForCausalLM", 3, ("--distributed", "tensor"), "cannot share evenly"),
        ("Phi3ForCausalLM", 2, ("--distributed", "pipeline"), "is not supported"),
        ("Qwen2ForCausalLM", 2, ("--distributed", "pipeline", "--pipeline-split", "2,2"), "split"),
    ],
)
def test_start_up_refusals_are_one_error_line(tmp_path, dirs, name, size, flags, message):
    with Ranks(tmp_path, size, dirs[name], *flags) as ranks:
        codes = [p.wait(timeout=60) for p in ranks.procs]
        assert codes[0] == 1
        (error,) = [x for x in ranks.output(0).splitlines() if x.startswith("Error: ")]
        assert message in error, error


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("tensor", "Error: --distributed needs a process group"),
        ("sideways", "Error: unknown distributed mode 'sideways': tensor or pipeline"),
    ],
)
def test_distributed_without_a_group_or_a_mode_is_an_error(dirs, mode, message):
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "-model",
            str(dirs["LlamaForCausalLM"]),
            f"-distributed={mode}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    (error,) = [x for x in run.stderr.splitlines() if x.startswith("Error: ")]
    assert error.startswith(message), run.stderr
