"""`python -m bench`: named workloads against several systems, with ratios to ours.

    python -m bench --size small
    python -m bench --workloads decisions,choices --systems ours,ours-rows,mlx-lm --repeats 3
    python -m bench --sample-rows 8 --repeats-for transformers=1 --json results.json
    python -m bench --model default --workloads requests --systems ours,ours-http,llama.cpp-q4

Like the runner, the process re-executes itself once with OpenBLAS preloaded when the
machine has it (runner/native/preload.py), before MLX is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from runner.native import preload

if TYPE_CHECKING:
    from bench.base import Context, System
    from bench.harness import Result
    from bench.models import Shape
    from bench.workloads import Variants

DEFAULT_REPEATS = 3


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _repeats_for(text: str) -> dict[str, int]:
    out = {}
    for item in _names(text):
        name, _, count = item.partition("=")
        if not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected SYSTEM=N, got {item!r}")
        out[name] = int(count)
    return out


def _param(text: str) -> tuple[str, str, int]:
    name, dot, rest = text.partition(".")
    key, eq, value = rest.partition("=")
    if not (dot and eq and name and key and value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"expected WORKLOAD.KEY=N, got {text!r}")
    return name, key, int(value)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from bench.systems import NAMES as SYSTEM_NAMES
    from bench.workloads import NAMES as WORKLOAD_NAMES
    from bench.workloads import SIZES

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--workloads",
        type=_names,
        default=list(WORKLOAD_NAMES),
        help=f"comma list of {', '.join(WORKLOAD_NAMES)} (default: all)",
    )
    p.add_argument(
        "--systems",
        type=_names,
        default=list(SYSTEM_NAMES),
        help=f"comma list of {', '.join(SYSTEM_NAMES)} (default: all)",
    )
    p.add_argument(
        "--size",
        choices=("small", "default"),
        default="default",
        help="model and workload size: small (quick) or default (Qwen3-0.6B shape)",
    )
    p.add_argument(
        "--param",
        type=_param,
        action="append",
        default=[],
        metavar="WORKLOAD.KEY=N",
        help="replace one workload parameter, e.g. decisions.rows=16 (see bench/workloads.py)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="timed trials per system and workload, after a warm-up (median)",
    )
    p.add_argument(
        "--repeats-for",
        type=_repeats_for,
        default={},
        metavar="SYS=N,...",
        help="per-system trial counts, e.g. transformers=1,mlx-lm=1",
    )
    p.add_argument(
        "--sample-rows",
        type=int,
        default=None,
        metavar="N",
        help="mlx-lm and transformers time only the first N rows; scaled to the total",
    )
    p.add_argument("--baseline-url", default=None, help="an Ollama-compatible runner's URL")
    p.add_argument(
        "--baseline-mode",
        choices=("auto", "score", "completions"),
        default="auto",
        help="how to score with the baseline (auto: /v1/score when it answers)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR|default",
        help="benchmark this existing model directory (default: the prepared default model) "
        "instead of a random one; --size then sizes the workloads only",
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="build the random model here and reuse it on later runs (default: a temp dir)",
    )
    p.add_argument(
        "--llama-cpp-src",
        type=Path,
        default=None,
        metavar="DIR",
        help="a directory holding llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_SRC, "
        "else the installed llama-cpp-python's sdist, downloaded once)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long any one call to a system (prepare, warm-up, trial, close) may take "
        "before it is recorded as stopped answering (default 1800; 0: no limit)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results here")
    args = p.parse_args(argv)
    for given, known, what in (
        (args.workloads, WORKLOAD_NAMES, "workload"),
        (args.systems, SYSTEM_NAMES, "system"),
        (list(args.repeats_for), SYSTEM_NAMES, "system"),
    ):
        unknown = [n for n in given if n not in known]
        if unknown:
            p.error(f"unknown {what} {', '.join(unknown)} (known: {', '.join(known)})")
    for name, key, _ in args.param:
        if name not in args.workloads or key not in SIZES[name][args.size]:
            p.error(f"--param {name}.{key}: not a parameter of a workload being run")
    if args.model is not None:
        if args.model_dir is not None:
            p.error("--model and --model-dir exclude each other (--model-dir builds a random one)")
        args.model = _model_dir(p, args.model)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.deadline is not None and args.deadline < 0:
        p.error("--deadline must be at least 0")
    if args.sample_rows is not None and args.sample_rows < 1:
        p.error("--sample-rows must be at least 1")
    return args


def _model_dir(p: argparse.ArgumentParser, given: str) -> Path:
    """The directory `--model` names: `default` is the prepared default model."""
    if given == "default":
        from runner.sources.default_model import resolve_default_model
        from runner.sources.source import ModelLoadError

        try:
            return resolve_default_model()
        except ModelLoadError as e:
            p.error(str(e))
    path = Path(given).expanduser()
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        p.error(f"--model {given}: no {', '.join(missing)} there")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preload.reexec_preloaded("bench", argv)  # LD_PRELOAD acts only at process start
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        return run(args, Path(tmp))


def run_systems(
    systems: list[System],
    workloads: list[Variants],
    ctx: Context,
    args: argparse.Namespace,
    results: dict[str, list[Result]],
) -> bool:
    """Every system on every workload, each row into `results` as it finishes; a failure of
    the bench itself while running a system becomes that system's rows. True when the run
    was interrupted (Ctrl-C): the systems not run yet then have rows that say so."""
    from bench.harness import Result, log, run_system

    for index, system in enumerate(systems):
        rows: list[Result] = []
        try:
            repeats = args.repeats_for.get(system.name, args.repeats)
            run_system(system, workloads, ctx, repeats, args.sample_rows, into=rows)
        except KeyboardInterrupt:
            log("interrupted: the report has what finished")
            for later in systems[index:]:
                done = {r.workload for r in rows} if later is system else set()
                rows += [
                    Result(v.name, later.name, "skipped", "not run: the run was interrupted")
                    for v in workloads
                    if v.name not in done
                ]
            return True
        except Exception as e:  # the bench's own failure, not the system's
            traceback.print_exc()
            done = {r.workload for r in rows}
            rows += [
                Result(v.name, system.name, "error", f"bench: {e!r}")
                for v in workloads
                if v.name not in done
            ]
        finally:
            for r in rows:
                results[r.workload].append(r)
    return False


def run(args: argparse.Namespace, tmp: Path, systems: list[System] | None = None) -> int:
    """The run `args` describes (on `systems` instead of `args.systems` when given): the
    report is printed, and written to `--json`, whatever happened to the systems; 130 when
    it was interrupted, else 0."""
    from bench import machine, report
    from bench.base import DEADLINE_S, Context
    from bench.harness import log
    from bench.models import load_tokenizer
    from bench.systems import make_systems
    from bench.workloads import build_workloads
    from runner.engine import Engine

    started = time.perf_counter()
    systems = make_systems(args.systems) if systems is None else systems
    deadline = getattr(args, "deadline", None)
    shape, model_dir, described = _model(args, tmp)
    engine = Engine()
    try:
        ctx = Context(
            model_dir=model_dir,
            engine=engine,
            work_dir=tmp,
            max_tokens=shape.context,
            baseline_url=args.baseline_url,
            baseline_mode=args.baseline_mode,
            llama_cpp_src=args.llama_cpp_src,
            deadline_s=DEADLINE_S if deadline is None else (deadline or None),
        )
        tokenizer = load_tokenizer(model_dir)
        overrides: dict[str, dict[str, int]] = {}
        for name, key, value in args.param:
            overrides.setdefault(name, {})[key] = value
        workloads = build_workloads(
            args.workloads, args.size, tokenizer.encode, args.seed, overrides
        )
        info = machine.describe()
        rates = machine.matmul_rates(engine, args.size)
        ctx.measure_peak = lambda: machine.peak_gflops(machine.matmul_rates(engine, args.size))
        ctx.probe_rate = machine.RateProbe(engine, args.size)
        params = shape.params(embedding=False)
        llama_cpp = None
        if any(system.process_name == "llama.cpp" for system in systems):
            llama_cpp = machine.llama_cpp_info()
        header = [*machine.format_machine(info, rates, llama_cpp), described]
        print("\n".join(header), flush=True)
        results: dict[str, list[Result]] = {w.name: [] for w in workloads}
        interrupted = run_systems(systems, workloads, ctx, args, results)
        peak = machine.peak_gflops(rates)
        sections = []
        for variants in workloads:
            w = variants.get(1)
            try:
                report.compute_metrics(w, results[w.name], shape, peak)
            except Exception:  # the table still lists every row, without figures
                traceback.print_exc()
                for r in results[w.name]:
                    r.metrics.clear()
            print("\n" + "\n".join(report.format_workload(w, results[w.name])), flush=True)
            sections.append((w, results[w.name]))
        setups: dict[str, float] = {}
        for rs in results.values():
            for r in rs:
                if r.setup_seconds is not None:
                    setups[r.system] = max(setups.get(r.system, 0.0), r.setup_seconds)
        elapsed = time.perf_counter() - started
        print(
            "\nsetup (load or spawn to ready, longest): "
            + ", ".join(f"{k} {v:.1f} s" for k, v in setups.items())
            + f"; whole run {elapsed:.0f} s",
            flush=True,
        )
        if args.json:
            options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            report.write_json(
                args.json,
                {
                    "machine": info,
                    "matmul_gflops": rates,
                    "llama_cpp": llama_cpp,
                    "model": {
                        "dir": str(model_dir) if args.model else None,
                        "random": args.model is None,
                        "shape": shape.__dict__,
                        "params": shape.params(),
                        "params_without_embedding": params,
                    },
                    "options": options,
                    "elapsed_seconds": elapsed,
                    "interrupted": interrupted,
                },
                sections,
            )
            log(f"wrote {args.json}")
    finally:
        engine.stop(timeout=10)
    return 130 if interrupted else 0


def _model(args: argparse.Namespace, tmp: Path) -> tuple[Shape, Path, str]:
    """The model to run: the `--model` directory, or a random one of `--size`'s shape built
    in `--model-dir` (or `tmp`); with the header line that says which."""
    from bench.harness import log
    from bench.models import SHAPES, Shape, write_model_dir

    if args.model is not None:
        model_dir = args.model
        config = json.loads((model_dir / "config.json").read_text())
        shape = Shape.from_config(model_dir.name, config)
        kind = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
        origin = f"{shape.name} at {model_dir} ({kind}; "
        on_disk = config.get("torch_dtype") or config.get("dtype") or "?"
    else:
        shape = SHAPES[args.size]
        log(f"building {shape.name} model directory")
        model_dir = write_model_dir(shape, args.model_dir or tmp / "model", args.seed)
        origin = f"{shape.name} random weights ("
        on_disk = "float16"
    described = (
        f"model: {origin}hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab}; "
        f"{shape.params() / 1e6:.0f}M params, {shape.params(embedding=False) / 1e6:.0f}M "
        f"without the embedding); {on_disk} on disk, float32 compute"
    )
    return shape, model_dir, described


if __name__ == "__main__":
    sys.exit(main())
