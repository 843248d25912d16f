"""A fuzz run's record: the checks' names, each failing body (`Failure`), the counts and
latencies (`Report`), and the summary printed at the end."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from bench.fuzz.client import ENDPOINTS, MIB, STATUS_LATENCY_LIMIT_S

CHECKS = (
    "answered",
    "no-5xx",
    "schema",
    "no-error-line",
    "alive",
    "go-status",
    "go-message",
    "status-latency",
)


@dataclass
class Failure:
    index: int
    endpoint: str
    checks: list[str]
    details: list[str]
    body: bytes
    tags: tuple[str, ...]
    status: int
    answer: str
    file: str = ""


@dataclass
class Report:
    seed: int
    bodies: int = 0
    twins: int = 0
    by_status: Counter = field(default_factory=Counter)  # (endpoint, status) -> count
    failures: list[Failure] = field(default_factory=list)
    by_check: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    latencies: list[float] = field(default_factory=list)
    worst_status: tuple[float, str] = (0.0, "")
    slow_status: int = 0
    slow_polls: list[tuple[float, str]] = field(default_factory=list)
    status_errors: list[str] = field(default_factory=list)
    rss_before: int | None = None
    rss_after: int | None = None
    restarts: int = 0
    seconds: float = 0.0
    out_dir: str = ""

    def failed(self, check: str) -> list[Failure]:
        return [f for f in self.failures if check in f.checks]


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:.1f} MiB"


def summary(report: Report) -> str:
    lines = [
        f"fuzz: {report.bodies} bodies (+{report.twins} canonical twins), seed {report.seed}, "
        f"{report.seconds:.0f} s, runner restarts {report.restarts}"
    ]
    lines.append("bodies by endpoint and status:")
    for endpoint in ENDPOINTS:
        counts = {s: n for (e, s), n in report.by_status.items() if e == endpoint}
        total = sum(counts.values())
        parts = "  ".join(f"{s}: {n}" for s, n in sorted(counts.items(), key=lambda x: str(x[0])))
        lines.append(f"  {endpoint:<12} {total:>6}   {parts}")
    lines.append("checks:")
    for check in CHECKS:
        if check == "status-latency":
            continue
        failed = report.failed(check)
        lines.append(f"  {check:<14} {'ok' if not failed else f'FAILED on {len(failed)} bodies'}")
        for failure in failed[:4]:
            lines.append(
                f"      #{failure.index} {failure.endpoint} [{','.join(failure.tags)}] -> "
                f"{failure.status}: {failure.body[:110]!r}"
            )
            for detail in failure.details[:2]:
                lines.append(f"        {detail[:220]}")
            if failure.file:
                lines.append(f"        {failure.file}")
    lat = sorted(report.latencies)
    worst, flight = report.worst_status
    if lat:
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        limit_ms = STATUS_LATENCY_LIMIT_S * 1000
        verdict = f"FAILED: {report.slow_status} polls over {limit_ms:.0f} ms"
        during = f" during {flight[:120]}" if flight else ""
        lines.append(
            f"  status-latency {'ok' if not report.slow_status else verdict} (polls {len(lat)}, "
            f"median {lat[len(lat) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
            f"worst {worst * 1000:.1f} ms{during})"
        )
    for seconds, flight in sorted(report.slow_polls, reverse=True)[:3]:
        lines.append(f"      {seconds * 1000:.0f} ms during {flight[:150]}")
    if report.status_errors:
        errors = report.status_errors
        lines.append(f"  /v1/status errors: {len(errors)}, first: {errors[0][:200]}")
    growth = (
        None
        if report.rss_before is None or report.rss_after is None
        else report.rss_after - report.rss_before
    )
    lines.append(
        f"runner RSS: before {_mib(report.rss_before)}, after {_mib(report.rss_after)}"
        + ("" if growth is None else f" ({growth / MIB:+.1f} MiB)")
    )
    lines.append(f"failing bodies: {len(report.failures)} written to {report.out_dir}")
    return "\n".join(lines)
