"""Check every system against ours, compute rates and ratios, print tables, write JSON.

Per workload the reference is `ours` (scoring) or `ours-http` (generation: ours generates
only over HTTP). ratio = system seconds / reference seconds, so > 1 means ours is faster;
seconds are the requests' own times (bench/harness.py `work_seconds`), so nothing the bench
does between requests is in a ratio. A system that failed is a row with its status and
reason (error, died, timeout) in the table and the JSON.
Answers are checked against the reference where it ran, else against the first system that
did: candidate logits (max |Δ| and the share of rows whose best candidate agrees), logprobs
after removing each row's mean over the candidates both have (a constant per row separates
them from logits), and generated text (the share of the reference text that is a common
prefix, leading spaces aside). GFLOP/s counts 2 x non-embedding parameters x prompt tokens
actually run through the model; %matmul divides it by the best float32 MLX matmul rate
measured in this run (bench/machine.py).

Where a workload is made of requests sent one after another, each request is timed: the
families workload notes the first (cold) request against the median of the later ones, and
the requests workload (`latency`) reports the first request, the median and p95 of the rest,
and for our runner its own cost per request: the median request time less the request's
arithmetic (`request_flops`) at that matmul rate.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench.base import RUNNER_SYSTEMS, GenerateOutcome, ScoreOutcome
from bench.harness import Result
from bench.models import Shape
from bench.workloads import ScoreWorkload, Workload

REFERENCE = {"score": "ours", "generate": "ours-http"}


def compare_scores(a: ScoreOutcome, ref: ScoreOutcome) -> dict[str, Any]:
    centered = a.kind != "logits" or ref.kind != "logits"
    worst, agree, compared, present, total = 0.0, 0, 0, 0, 0
    for x, y in zip(a.values, ref.values, strict=False):
        keep = [j for j, v in enumerate(x) if v is not None and y[j] is not None]
        total += len(x)
        present += len(keep)
        if not keep:
            continue
        xs = [float(x[j]) for j in keep]  # type: ignore[arg-type]
        ys = [float(y[j]) for j in keep]  # type: ignore[arg-type]
        if centered:
            mx_, my_ = sum(xs) / len(xs), sum(ys) / len(ys)
            xs, ys = [v - mx_ for v in xs], [v - my_ for v in ys]
        worst = max(worst, *(abs(p - q) for p, q in zip(xs, ys, strict=True)))
        agree += xs.index(max(xs)) == ys.index(max(ys))
        compared += 1
    return {
        "max_abs_diff": worst if compared else None,
        "argmax_agree": agree / compared if compared else None,
        "coverage": present / total if total else None,
        "compared_rows": compared,
        "centered": centered,
    }


def compare_text(a: GenerateOutcome, ref: GenerateOutcome) -> dict[str, Any]:
    """Share of the reference text that `a` starts with; leading spaces are ignored, as
    mlx-lm's streaming detokenizer drops the first token's."""
    x, y = a.text.lstrip(), ref.text.lstrip()
    common = 0
    for p, q in zip(x, y, strict=False):
        if p != q:
            break
        common += 1
    return {"text_match": common / len(y) if y else float(x == y)}


def request_flops(shape: Shape, computed: int, prefix: int, candidates: int) -> float:
    """Floating-point operations one scoring row needs, at least: `computed` new tokens after
    `prefix` cached ones, and the output head for its `candidates` only.

    - every weight matrix of every layer, once per computed token: 2 x non-embedding
      parameters x computed;
    - attention over the cache: computed token i (0-based) attends to prefix + i + 1 keys,
      with a query-key product and a weighted sum of values of 2 x head_dim FLOPs each per
      key and head: 2 x 2 x layers x heads x head_dim x computed x (prefix + computed / 2);
    - the candidates' rows of the output head, at the last position: 2 x hidden x candidates.
    """
    weights = 2 * shape.params(embedding=False) * computed
    attention = 4 * shape.layers * shape.heads * shape.head_dim * computed * (prefix + computed / 2)
    return weights + attention + 2 * shape.hidden * candidates


def _percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _sent_as_given(workload: ScoreWorkload, out: ScoreOutcome) -> bool:
    """Whether the outcome's timed requests are the workload's own (its first ones, when
    sampled), not the rows of multi-row requests sent one by one."""
    if all(len(request) == 1 for request in workload.requests):
        return True
    return len(out.request_seconds) == len(workload.requests) and out.rows_done == len(
        workload.rows
    )


def request_metrics(
    workload: ScoreWorkload, r: Result, shape: Shape, peak_gflops: float | None
) -> dict[str, Any]:
    """Per-request figures of a system that sent the workload's requests one by one (or
    its first rows, when sampled): the first request apart (it stores the shared prompt).

    For a latency workload: the median and p95 of the later requests, and for our runner
    its own cost, the median over later requests of (time - arithmetic at the matmul rate):
    the rate probed just around each request where the harness probed it
    (`ScoreOutcome.request_rates`; this VM's rate moves by a third between phases that last
    from seconds to minutes), else the best rate measured just before and after its trials
    (`Result.peak_beside`), else `peak_gflops`, the run's; the own cost at the rates the
    finer measure replaced is kept too.
    Otherwise (families): the first request's time over the later ones' median."""
    out = r.outcome
    assert isinstance(out, ScoreOutcome)
    seconds = out.request_seconds
    if len(seconds) < 2:
        return {}
    later = seconds[1:]
    m: dict[str, Any] = {
        "first_request_s": seconds[0],
        "later_request_median_s": statistics.median(later),
    }
    if not workload.latency:
        m["cold_over_warm"] = seconds[0] / m["later_request_median_s"]
        return m
    m["later_request_p95_s"] = _percentile(later, 95)
    if r.system in RUNNER_SYSTEMS and peak_gflops:
        flops = [
            request_flops(shape, computed, request[0].tokens - computed, len(request[0].candidates))
            for request, computed in zip(
                workload.requests[1 : len(seconds)], out.request_computed[1:], strict=True
            )
        ]

        def own(rates: list[float]) -> tuple[float, float]:
            arithmetic = [f / (rate * 1e9) for f, rate in zip(flops, rates, strict=True)]
            times = [t - a for t, a in zip(later, arithmetic, strict=True)]
            return statistics.median(arithmetic), statistics.median(times)

        m["peak_gflops"] = r.peak_beside or peak_gflops
        m["arithmetic_median_s"], m["own_median_s"] = own([m["peak_gflops"]] * len(flops))
        if r.peak_beside:
            m["own_at_run_peak_s"] = own([peak_gflops] * len(flops))[1]
        if len(out.request_rates) == len(seconds):
            rates = out.request_rates[1:]
            m["own_beside_trials_s"] = m["own_median_s"]
            m["arithmetic_median_s"], m["own_median_s"] = own(rates)
            m["request_gflops_range"] = (min(rates), statistics.median(rates), max(rates))
    return m


def compute_metrics(
    workload: Workload, results: list[Result], shape: Shape, peak_gflops: float | None
) -> None:
    params = shape.params(embedding=False)
    ok = [r for r in results if r.status == "ok" and r.outcome is not None]
    ref = next((r for r in ok if r.system == REFERENCE[workload.kind]), None)
    for r in ok:
        m = r.metrics
        assert r.seconds is not None and r.measured_seconds is not None
        m["ratio"] = r.seconds / ref.seconds if ref is not None and ref.seconds else None
        check = ref if ref is not None else next((o for o in ok if o is not r), None)
        if check is r:
            check = None
        if isinstance(r.outcome, ScoreOutcome):
            assert isinstance(workload, ScoreWorkload)
            out = r.outcome
            m["rows_per_s"] = len(workload.rows) / r.seconds
            m["tokens_per_s"] = workload.prompt_tokens / r.seconds
            m["rows_timed"] = out.rows_done
            m["computed_tokens"] = out.computed_tokens
            gflops = 2 * params * out.computed_tokens / r.measured_seconds / 1e9
            if check is not None and isinstance(check.outcome, ScoreOutcome):
                m |= compare_scores(out, check.outcome)
            if len(workload.requests) > 1 and _sent_as_given(workload, out):
                m |= request_metrics(workload, r, shape, peak_gflops)
        else:
            assert isinstance(r.outcome, GenerateOutcome)
            out = r.outcome
            m["prompt_tokens"], m["new_tokens"] = out.prompt_tokens, out.new_tokens
            decode_tokens = out.new_tokens if out.decode_tokens is None else out.decode_tokens
            m["decode_tokens_per_s"] = (
                decode_tokens / out.decode_seconds if out.decode_seconds and decode_tokens else None
            )
            m["prefill_tokens_per_s"] = (
                out.prompt_tokens / out.prefill_seconds if out.prefill_seconds else None
            )
            gflops = (
                2 * params * out.prompt_tokens / out.prefill_seconds / 1e9
                if out.prefill_seconds
                else None
            )
            if check is not None and isinstance(check.outcome, GenerateOutcome):
                m |= compare_text(out, check.outcome)
        m["gflops"] = gflops
        m["matmul_fraction"] = gflops / peak_gflops if gflops and peak_gflops else None
        m["checked_against"] = check.system if check is not None else None
        m["notes"] = r.outcome.notes


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


SCORE_COLUMNS = ("rows/s", "tok/s", "ratio", "max|Δ|", "argmax")
LATENCY_COLUMNS = ("first s", "median ms", "p95 ms", "arith ms", "own ms", "ratio", "max|Δ|")
GENERATE_COLUMNS = ("prefill/s", "decode/s", "ratio", "text=")
COMMON_COLUMNS = ("GFLOP/s", "%matmul", "mem GiB")


def _latency(workload: Workload) -> bool:
    return isinstance(workload, ScoreWorkload) and workload.latency


def _columns(workload: Workload) -> tuple[str, ...]:
    if workload.kind == "generate":
        return GENERATE_COLUMNS
    return LATENCY_COLUMNS if _latency(workload) else SCORE_COLUMNS


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.1f}"


def _cells(workload: Workload, r: Result) -> tuple[str, ...]:
    m = r.metrics
    columns = _columns(workload)
    values: tuple[str, ...]
    if columns is SCORE_COLUMNS:
        values = (
            _f(m["rows_per_s"], ".2f"),
            _f(m["tokens_per_s"], ".0f"),
            _f(m["ratio"], ".2f"),
            _f(m.get("max_abs_diff"), ".1e"),
            _pct(m.get("argmax_agree")),
        )
    elif columns is LATENCY_COLUMNS:
        values = (
            _f(m.get("first_request_s"), ".2f"),
            _ms(m.get("later_request_median_s")),
            _ms(m.get("later_request_p95_s")),
            _ms(m.get("arithmetic_median_s")),
            _ms(m.get("own_median_s")),
            _f(m["ratio"], ".2f"),
            _f(m.get("max_abs_diff"), ".1e"),
        )
    else:
        values = (
            _f(m["prefill_tokens_per_s"], ".1f"),
            _f(m["decode_tokens_per_s"], ".2f"),
            _f(m["ratio"], ".2f"),
            _pct(m.get("text_match")),
        )
    memory = r.memory_bytes / 2**30 if r.memory_bytes is not None else None
    return (*values, _f(m["gflops"], ".1f"), _pct(m["matmul_fraction"]), _f(memory, ".1f"))


def _notes(workload: Workload, r: Result) -> str:
    m = r.metrics
    notes = []
    if r.sampled:
        notes.append(f"{m['rows_timed']}/{len(workload.rows)} rows timed, scaled")  # type: ignore[union-attr]
    wall = r.wall_seconds
    if wall is not None and r.measured_seconds is not None:
        between = wall - r.measured_seconds
        if between > max(0.01, 0.02 * r.measured_seconds):
            probed = (
                "rate probes and the bench's own work"
                if m.get("request_gflops_range")
                else ("the bench's own work")
            )
            notes.append(
                f"wall {wall:.2f} s: {between:.2f} s between requests ({probed}, not counted)"
            )
    if m.get("checked_against") and m["checked_against"] != REFERENCE[workload.kind]:
        notes.append(f"checked vs {m['checked_against']}")
    if m.get("centered"):
        notes.append(f"logprobs, centred; coverage {_pct(m.get('coverage'))}")
    if _latency(workload) and m.get("argmax_agree") is not None:
        notes.append(f"argmax {_pct(m['argmax_agree'])}")
    if "request_gflops_range" in m:
        low, median, high = m["request_gflops_range"]
        notes.append(
            f"own ms at the matmul rate around each request: {median:.0f} GFLOP/s"
            f" ({low:.0f}-{high:.0f}); at the best beside its trials ({m['peak_gflops']:.0f}):"
            f" own {_ms(m['own_beside_trials_s'])} ms"
        )
    if "own_at_run_peak_s" in m:
        notes.append(
            f"matmul beside its trials {m['peak_gflops']:.0f} GFLOP/s"
            f" (at the run's: own {_ms(m['own_at_run_peak_s'])} ms)"
        )
    if "cold_over_warm" in m:
        notes.append(
            f"first request {m['first_request_s']:.3f} s, later {m['later_request_median_s']:.3f}"
            f" s (median): cold/warm {m['cold_over_warm']:.1f}"
        )
    notes += [f"{k} {v}" for k, v in (m.get("notes") or {}).items()]
    notes += r.warnings
    return "; ".join(notes)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def format_workload(workload: Workload, results: list[Result]) -> list[str]:
    """One table: a row per system, `~` marking seconds scaled up from sampled rows."""
    ref = REFERENCE[workload.kind]
    head = f"== {workload.name} ({workload.describe()})"
    if workload.kind == "score":
        head += f": {len(workload.rows)} rows, {workload.prompt_tokens} prompt tokens"
    cols = ("system", "seconds", *_columns(workload), *COMMON_COLUMNS, "notes")
    table = [cols]
    for r in results:
        if r.status != "ok" or "ratio" not in r.metrics:
            reason = "; ".join(_one_line(t) for t in (r.reason, *r.warnings) if t)
            status = r.status if r.status != "ok" else "ok (no metrics)"
            table.append((r.system, status, *["-"] * (len(cols) - 3), reason))
            continue
        seconds = ("~" if r.sampled else "") + _f(r.seconds, ".2f")
        table.append((r.system, seconds, *_cells(workload, r), _notes(workload, r)))
    widths = [max(len(row[i]) for row in table) for i in range(len(cols) - 1)]
    lines = [head + f"; ratio = seconds / {ref} seconds (> 1: ours faster)"]
    if _latency(workload):
        lines.append(
            "   first s: the first request (stores the shared prompt); median, p95: the later "
            "requests; arith: their arithmetic at the best float32 matmul rate (measured beside "
            "the system's trials where noted); own: median of (request - arith), the runner's "
            "own cost"
        )
    for row in table:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:-1], widths[1:], strict=True)]
        lines.append("  ".join(cells) + "  " + row[-1])
    return lines


def result_json(r: Result) -> dict[str, Any]:
    out = {
        "system": r.system,
        "status": r.status,
        "reason": r.reason or None,
        "description": r.description,
        "setup_seconds": r.setup_seconds,
        "seconds": r.seconds,
        "measured_seconds": r.measured_seconds,
        "trials": r.trials,
        "wall_trials": r.wall_trials,
        "sampled": r.sampled,
        "warnings": r.warnings,
        "memory_bytes": r.memory_bytes,
        **r.metrics,
    }
    if isinstance(r.outcome, GenerateOutcome):
        out["text"] = r.outcome.text
    elif isinstance(r.outcome, ScoreOutcome):
        out["request_seconds"] = r.outcome.request_seconds
        out["request_computed_tokens"] = r.outcome.request_computed
        if r.outcome.request_rates:
            out["request_gflops"] = r.outcome.request_rates
    return out


def write_json(path: Path, header: dict[str, Any], sections: list[tuple[Workload, list[Result]]]):
    document = {
        **header,
        "workloads": [
            {
                "name": w.name,
                "kind": w.kind,
                "params": w.params,
                "reference": REFERENCE[w.kind],
                "results": [result_json(r) for r in results],
            }
            for w, results in sections
        ],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
