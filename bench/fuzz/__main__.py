"""The command line: `python -m bench.fuzz --bodies N --seed S [--out DIR] [--json FILE] ...`;
prints the summary, exits 1 when any check failed."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.fuzz.client import MIB
from bench.fuzz.fuzzer import run_fuzz
from bench.fuzz.report import CHECKS, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fuzz", description="Fuzz a spawned tiny runner's HTTP surface."
    )
    parser.add_argument("--bodies", type=int, default=2000, help="bodies to send (2000)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (0)")
    parser.add_argument("--out", type=Path, help="where failing bodies go (a new temp dir)")
    parser.add_argument("--model-dir", type=Path, help="fuzz this model directory instead")
    parser.add_argument("--cache-bytes", type=int, default=64 * MIB, help="runner cache budget")
    parser.add_argument("--no-oversize", action="store_true", help="no bodies over 64 MiB")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="runner-fuzz-"))
    report = run_fuzz(
        args.bodies,
        args.seed,
        out,
        args.model_dir,
        cache_bytes=args.cache_bytes,
        allow_oversize=not args.no_oversize,
        progress=True,
    )
    print(summary(report))
    if args.json:
        data = {
            "seed": report.seed,
            "bodies": report.bodies,
            "twins": report.twins,
            "by_status": {f"{e} {s}": n for (e, s), n in report.by_status.items()},
            "failures": {check: [f.index for f in report.failed(check)] for check in CHECKS},
            "worst_status_s": report.worst_status[0],
            "slow_status_polls": report.slow_status,
            "rss_before": report.rss_before,
            "rss_after": report.rss_after,
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 1 if report.failures or report.slow_status else 0


if __name__ == "__main__":
    sys.exit(main())
