"""The command line: `python -m bench.fuzz --bodies N --seed S [--out DIR] [--json FILE] ...`
[--media small|full] (the hostile-media section, `media`; with `--bodies 0`, alone); prints
the summaries, exits 1 when any check failed."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.fuzz.client import MIB
from bench.fuzz.fuzzer import run_fuzz
from bench.fuzz.media import (
    SIZES,
    format_peaks,
    media_json,
    media_summary,
    peaks_summary,
    run_media,
)
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
    parser.add_argument(
        "--media", choices=sorted(SIZES), help="also run the hostile-media cases at this size"
    )
    args = parser.parse_args(argv)
    failed = False
    data: dict = {}
    if args.media:
        sizes = SIZES[args.media]
        results = run_media(sizes, progress=True)
        print(media_summary(results, sizes))
        peaks = format_peaks(sizes.peak_side)
        print(peaks_summary(peaks, sizes.peak_side))
        data["media"] = media_json(results)
        data["media_peaks"] = peaks
        failed = not all(r.ok for r in results)
    if args.bodies <= 0 and args.media:
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 1 if failed else 0
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
        data |= {
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
    return 1 if failed or report.failures or report.slow_status else 0


if __name__ == "__main__":
    sys.exit(main())
