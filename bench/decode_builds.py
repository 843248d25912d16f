"""`python -m bench.decode_builds`: whole generations (or prompts, or decision requests)
alternating between builds of the native library on one model, ms a decode token each: one
instruction-set path (an x86-64 level's build), or one library's change, against another on
the same machine, in the same minutes.

A build is the library compiled from this checkout's sources for a `-march` (`x86-64-v3`:
what an AVX2-only CPU builds; `native`: this CPU's, as the runner builds it), a library
file given by its path (another checkout's build), or another checkout's directory: its own
Python and its library as it builds it for this CPU (a change that moves Python as well as C,
e.g. a weight format, against the commit before it: `git worktree add /tmp/before HEAD~1`).
One runner is spawned per build with that
library preloaded (runner/native/preload.py leaves a preset LD_PRELOAD as it is), and each
round asks every runner in turn for the same greedy completion, after one untimed; the turn
order rotates a place each round (`turns`), as the runner asked later in a round measured
~4-5% faster than the same library asked first (an A/A run: `--builds native,native`). The model:
`--model` (a directory or a GGUF file), by default a Qwen3-0.6B-shaped Q4_K_M-like GGUF
(random weights, bench/models.py; Q4_K and Q6_K blocks in llama.cpp's layout from
tests/gguf_models.py's quantizers) written once into the cache.

`--workload prefill` times the prompt instead (ms a prompt token; each round's prompt starts
with its round, so no runner finds it in its prefix cache). `--workload decisions` times
scoring: each round, `--requests` one-decision requests (POST /v1/score, one row, " Yes" /
" No") whose prompts share the text as a system prompt the runner keeps in its prefix cache
(stored by an untimed request first), so each computes a short question's tokens over the
cached text (`--rows N`: N such questions a request, each a row): median ms a request per
round, and every build must pick the same candidate for every row.

    python -m bench.decode_builds --builds x86-64-v3,native --rounds 4 --tokens 64
    python -m bench.decode_builds --builds /tmp/head-v3.so,x86-64-v3
    python -m bench.decode_builds --builds /tmp/before.so,native,/tmp/before.so --workload decisions
    python -m bench.decode_builds --builds /tmp/before,native,/tmp/before --model F.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PROMPT_WORDS = 300
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def prompt(words: int = PROMPT_WORDS) -> str:
    return " ".join(f"{WORDS[i % len(WORDS)]}{i % 7}" for i in range(words))


def checkout_of(build: str) -> Path | None:
    """The checkout a build names (a directory holding the runner's package), else None."""
    path = Path(build)
    return path.resolve() if (path / "runner" / "native" / "build.py").is_file() else None


def library_for(build: str, into: Path) -> str:
    """The library file of `build`: a checkout's as it builds it for this CPU, a path as it is,
    `native` as the runner builds it, else this checkout's sources compiled with
    -march=`build`."""
    from runner.native import build as native

    checkout = checkout_of(build)
    if checkout is not None:
        asked = "from runner.native import build; print(build.library() or '')"
        done = subprocess.run(
            [sys.executable, "-c", asked], cwd=checkout, capture_output=True, text=True
        )
        built = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        if done.returncode or not Path(built).is_file():
            raise SystemExit(f"{checkout}: its library did not build: {done.stderr[-500:]}")
        return built
    if "/" in build:
        if not Path(build).is_file():
            raise SystemExit(f"no library at {build}")
        return build
    if build == "native":
        built = native.library()
        if built is None:
            raise SystemExit("the native library did not build (no C compiler?)")
        return built
    flags = [f"-march={build}" if f == native.MARCH else f for f in native.DISPATCH_FLAGS]
    target = into / f"runner_native-{build}.so"
    native.compile_library(target, flags)
    return str(target)


def default_model() -> Path:
    """The Qwen3-0.6B-shaped Q4_K_M-like GGUF, written on first use (~30 s, 409 MB)."""
    from bench.models import SHAPES, write_model_dir
    from runner.sources.default_model import cache_root
    from tests.gguf_models import k_mixed, write_gguf

    path = cache_root() / "bench-models" / "qwen3-0.6b-q4_k_m-like.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            model_dir = write_model_dir(SHAPES["default"], Path(tmp) / "model")
            written = write_gguf(model_dir, Path(tmp) / path.name, k_mixed)
            written.replace(path)
    return path


def turns(round_: int, count: int) -> list[int]:
    """The order round `round_` asks `count` runners in: rotated a place each round, so over
    any `count` rounds in a row each runner is asked at each place once."""
    return [(round_ + i) % count for i in range(count)]


@contextlib.contextmanager
def spawned(
    model: Path, libraries: list[str], checkouts: list[Path | None] | None = None
) -> Iterator[list]:
    """One runner per library (which may repeat), each with it preloaded, ready, run from its
    checkout (`checkouts[i]`; None: this one); stopped on exit."""
    from runner.native import preload
    from tools.spawned import SpawnedRunner

    blas = preload.optimised_blas()
    if blas is None:
        raise SystemExit("needs Linux with Debian's libopenblas0-pthread")
    runners = []
    try:
        for i, library in enumerate(libraries):
            env = {"LD_PRELOAD": f"{library}:{blas}", preload.MARKER: blas}
            runner = SpawnedRunner(
                "--model",
                str(model),
                env={**env, "OPENBLAS_THREAD_TIMEOUT": "4"},
                checkout=checkouts[i] if checkouts else None,
            )
            runners.append(runner)
            runner.wait_ready()
        yield runners
    finally:
        for runner in runners:
            runner.stop()


def measure(
    model: Path,
    libraries: list[str],
    rounds: int,
    tokens: int,
    text: str,
    prefill: bool = False,
    checkouts: list[Path | None] | None = None,
) -> list[list[float]]:
    """ms a decode token of each library's runner (in the order of `libraries`, which may
    repeat one; each run from its checkout, `spawned`), one completion a round each, in
    `turns` order; SystemExit when the runners' texts differ (the same greedy tokens are
    expected of every build). `prefill`: ms a prompt token instead, each round's prompt new to
    the runners' prefix caches (its round first)."""
    from bench.ours import completion_body, completion_lines

    times: list[list[float]] = [[] for _ in libraries]
    texts: list[set[str]] = [set() for _ in range(rounds)]
    with spawned(model, libraries, checkouts) as runners:
        for runner in runners:  # untimed: the first generation maps the weights in
            completion_lines(runner.url, completion_body(text, tokens))
        for round_ in range(rounds):
            asked = f"Round {round_}. {text}" if prefill else text
            for i in turns(round_, len(runners)):
                lines = completion_lines(runners[i].url, completion_body(asked, tokens))
                done = lines[-1]
                if prefill:
                    took = done["PromptEvalDuration"] / max(1, done["PromptEvalCount"])
                else:
                    took = done["EvalDuration"] / max(1, done["EvalCount"])
                times[i].append(took / 1e6)
                texts[round_].add("".join(line.get("Content", "") for line in lines))
    for round_, generated in enumerate(texts):
        if len(generated) != 1:
            raise SystemExit(f"the builds generated {len(generated)} texts in round {round_}")
    return times


CANDIDATES = (" Yes", " No")


def questions(round_: int, count: int) -> list[str]:
    """Round `round_`'s `count` questions (the same for every runner in the round)."""
    rng = random.Random(round_)
    return [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(count)]


def decision_prompt(text: str, question: str) -> str:
    return f"Answer Yes or No.\n{text}\nQuestion: {question}?\nAnswer:"


def measure_decisions(
    model: Path,
    libraries: list[str],
    rounds: int,
    requests: int,
    text: str,
    max_tokens: int = 4096,
    rows: int = 1,
    checkouts: list[Path | None] | None = None,
) -> list[list[float]]:
    """Median ms of a decision request of each library's runner (each run from its checkout,
    `spawned`), a round each: `requests` requests of `rows` rows (one decision each) over
    `text` as their cached system prompt, the runners in `turns` order; SystemExit when a
    runner's best candidate for a row differs from the first's. `max_tokens`: the requests'
    (at most the model's context)."""
    from bench.http import KeptConnection

    times: list[list[float]] = [[] for _ in libraries]
    with spawned(model, libraries, checkouts) as runners:
        connections = [KeptConnection(runner.url) for runner in runners]
        try:

            def best(i: int, asked: list[str]) -> tuple[list[int], float]:
                candidates = list(CANDIDATES)
                body = {
                    "rows": [
                        {"prompt": decision_prompt(text, q), "candidates": candidates}
                        for q in asked
                    ],
                    "max_tokens": max_tokens,
                }
                started = time.perf_counter()
                logits = connections[i].post_json("/v1/score", body)["logits"]
                took = (time.perf_counter() - started) * 1e3
                picks = [max(range(len(CANDIDATES)), key=lambda c: row[c]) for row in logits]
                return picks, took

            for i in range(len(runners)):  # untimed: maps the weights in, stores the prefix
                best(i, ["untimed"])
            for round_ in range(rounds):
                asked = questions(round_, requests * rows)
                batches = [asked[r * rows : (r + 1) * rows] for r in range(requests)]
                picks: list[list[int]] = []
                for i in turns(round_, len(runners)):
                    answers = [best(i, batch) for batch in batches]
                    times[i].append(statistics.median(took for _, took in answers))
                    picks.append([pick for each, _ in answers for pick in each])
                if any(p != picks[0] for p in picks):
                    raise SystemExit(f"the builds picked different candidates in round {round_}")
        finally:
            for connection in connections:
                connection.close()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_builds", description=__doc__)
    p.add_argument(
        "--builds",
        default="x86-64-v3,native",
        help="-march names, library paths or other checkouts' directories",
    )
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--workload", choices=("decode", "prefill", "decisions"), default="decode")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="decode: tokens a completion")
    p.add_argument("--requests", type=int, default=8, help="decisions: requests a round")
    p.add_argument("--rows", type=int, default=1, help="decisions: rows (decisions) a request")
    p.add_argument("--prompt-words", type=int, default=PROMPT_WORDS)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="decode-builds-") as tmp:
        builds = args.builds.split(",")
        libraries = [library_for(build, Path(tmp)) for build in builds]
        checkouts = [checkout_of(build) for build in builds]
        model = args.model or default_model()
        text = prompt(args.prompt_words)
        if args.workload in ("decode", "prefill"):
            prefill = args.workload == "prefill"
            times = measure(model, libraries, args.rounds, args.tokens, text, prefill, checkouts)
            what = "prompts" if prefill else f"{args.tokens} greedy tokens"
            unit = "ms a prompt token" if prefill else "ms a token"
        else:
            times = measure_decisions(
                model, libraries, args.rounds, args.requests, text, rows=args.rows,
                checkouts=checkouts,
            )  # fmt: skip
            what, unit = f"{args.requests} requests of {args.rows} decisions", "ms a request"
    first = statistics.median(times[0])
    agreed = {"decode": "the same text", "prefill": "new prompts", "decisions": "the same picks"}[
        args.workload
    ]
    print(f"model {model}; {args.rounds} rounds of {what}, the order rotating; {agreed}")
    for build, each_time in zip(builds, times, strict=True):
        median = statistics.median(each_time)
        each = " ".join(f"{t:.2f}" for t in each_time)
        print(f"{build:>24}  {median:7.2f} {unit}  ({first / median:.2f}x the first)  [{each}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
