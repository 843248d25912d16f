"""Smoke test of `python -m bench` (bench/README.md) on the small model, so it does not rot.

Every workload runs once per system; the assertions are about the results' structure and
about every system agreeing with ours (candidate logits, generated text), never timing.
The in-process systems run through the CLI's own `run` (without the BLAS re-exec); the HTTP
systems spawn runners and are marked slow. A stand-in Ollama runner without /v1/score
(stdlib HTTP server, answers computed by our model) covers the baseline's completions path.
The llama.cpp systems are skipped cleanly without llama-cpp-python (as in CI); with it, the
`llama` test converts the small model to GGUF and checks llama.cpp-f32 against ours.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.__main__ import parse_args, run
from bench.base import Context, ScoreOutcome
from bench.harness import run_system
from bench.http import HTTPStatus, KeptConnection, SpawnedRunner
from bench.llamacpp import LlamaCpp, LlamaCppF16, LlamaCppQ4, LlamaCppQ80
from bench.models import SHAPES, load_tokenizer, write_model_dir
from bench.ours import Ours, OursHTTP, OursQ4, OursQ40
from bench.peers import Baseline
from bench.report import compute_metrics, format_workload
from bench.workloads import NAMES, build_workloads
from runner.engine import Engine
from runner.generate.detokenize import go_string

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
LOGIT_TOLERANCE = 1e-3
SCORE_WORKLOADS = ("decisions", "choices", "families", "requests")
# Per-request figures of the requests workload (bench/report.py `request_metrics`).
LATENCY = ("first_request_s", "later_request_median_s", "later_request_p95_s")
OWN_COST = ("arithmetic_median_s", "own_median_s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(SHAPES["small"], tmp_path_factory.mktemp("bench-model"))


@pytest.fixture(scope="module")
def bench_engine():
    engine = Engine(name="bench-mlx")
    yield engine
    engine.stop(timeout=10)


def _by_system(section: dict) -> dict[str, dict]:
    return {r["system"]: r for r in section["results"]}


def _assert_agrees(result: dict, kind: str) -> None:
    assert result["status"] == "ok", result
    assert result["seconds"] > 0 and len(result["trials"]) == 1
    if kind == "score":
        assert result["max_abs_diff"] < LOGIT_TOLERANCE, result
        assert result["argmax_agree"] == 1.0, result
        assert result["rows_per_s"] > 0 and result["tokens_per_s"] > 0
    else:
        assert result["text_match"] == 1.0, result
        assert result["new_tokens"] > 0


def _assert_latency(section: dict, result: dict, own_cost: bool) -> None:
    """The requests workload's per-request figures: one timing per request sent (the first
    rows only, when sampled), the first request apart; the runner's own cost for ours."""
    timed = result["rows_timed"]
    assert timed <= section["params"]["rows"]
    assert len(result["request_seconds"]) == len(result["request_computed_tokens"]) == timed
    assert all(result[k] > 0 for k in LATENCY), result
    assert result["later_request_p95_s"] >= result["later_request_median_s"]
    if own_cost:
        assert result["arithmetic_median_s"] > 0
        # own cost: the time minus the arithmetic at a measured rate; on a busy machine the
        # rate measured may be below the rate the request ran at, so it may be below zero
        assert math.isfinite(result["own_median_s"])
        # reckoned at the matmul rate probed around each request; the rate beside its
        # trials and the run's rate kept too
        rates = result["request_gflops"]
        assert len(rates) == timed and all(rate > 0 for rate in rates)
        assert result["peak_gflops"] > 0 and math.isfinite(result["own_at_run_peak_s"])
        assert "own_beside_trials_s" in result
        # later requests reuse the stored system prompt: only their question is computed
        assert max(result["request_computed_tokens"][1:]) <= section["params"]["question"]
    else:
        assert not any(k in result for k in OWN_COST)


def test_cli_in_process_systems(model_dir, tmp_path, capsys):
    systems = ["ours", "ours-rows", "mlx-lm"] + (["transformers"] if HAS_TORCH else [])
    out = tmp_path / "results.json"
    args = parse_args(
        [
            *("--size", "small", "--repeats", "1", "--sample-rows", "3"),
            *("--systems", ",".join(systems), "--json", str(out), "--model-dir", str(model_dir)),
        ]
    )
    assert run(args, tmp_path) == 0

    document = json.loads(out.read_text())
    assert document["machine"]["cores"] >= 1 and document["machine"]["blas"]
    assert all(rate > 0 for rate in document["matmul_gflops"].values())
    assert [w["name"] for w in document["workloads"]] == list(NAMES)
    for section in document["workloads"]:
        results = _by_system(section)
        assert list(results) == systems
        if section["kind"] == "score":
            ours = results["ours"]
            assert ours["status"] == "ok" and ours["ratio"] == 1.0
            assert ours["computed_tokens"] > 0
            latency = section["name"] == "requests"
            if latency:  # one row per request already: ours-rows would repeat ours
                assert results["ours-rows"]["status"] == "n/a"
            for name in systems[1:]:
                if not (latency and name == "ours-rows"):
                    _assert_agrees(results[name], "score")
                    assert results[name]["checked_against"] == "ours"
            # one-by-one systems timed 3 rows and scaled; ours-rows too
            assert results["mlx-lm"]["sampled"] and results["mlx-lm"]["rows_timed"] == 3
            if latency:
                _assert_latency(section, ours, own_cost=True)
                _assert_latency(section, results["mlx-lm"], own_cost=False)
        else:
            assert results["ours"]["status"] == "n/a"
            for name in systems[2:]:
                assert results[name]["status"] == "ok"
            if "transformers" in results:
                _assert_agrees(results["transformers"], "generate")
    printed = capsys.readouterr().out
    for name in (*NAMES, *systems):
        assert name in printed


class _StandIn(BaseHTTPRequestHandler):
    """An Ollama runner of the old kind: no /v1/score, and completions only for one token with
    logprobs (anything else answers 501). It returns every token's logprob, not just the top
    20 asked for: a random model rarely ranks the candidates that high, and the test compares
    values."""

    runner = None  # set per test: our Runner, used to compute the answers

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/status":
            self._send(200, b'{"Status":0,"Progress":100,"ContextLength":4096,"Memory":0}\n')
        else:
            self._send(404, b"404 page not found\n", "text/plain")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self._send(404, b"404 page not found\n", "text/plain")
            return
        if not body.get("Logprobs") or body["Options"].get("num_predict") != 1:
            self._send(501, b"completions are not implemented yet\n", "text/plain")
            return
        runner = self.runner
        tokens = runner.tokenizer.encode(body["Prompt"])
        top = runner.engine.call(lambda _job: _top_logprobs(runner, tokens))
        entries = [
            {"token": go_string(runner.tokenizer.token_bytes(i)), "logprob": lp} for i, lp in top
        ]
        first = {**entries[0], "top_logprobs": entries}
        lines = [
            {"Content": first["token"], "Done": False, "Logprobs": [first], "Error": None},
            {
                "Content": "",
                "Done": True,
                "DoneReason": 1,
                "PromptEvalCount": len(tokens),
                "EvalCount": 1,
                "Logprobs": None,
                "Error": None,
            },
        ]
        payload = "".join(json.dumps(line) + "\n" for line in lines).encode()
        self._send(200, payload, "application/jsonl")


def _top_logprobs(runner, tokens: list[int]) -> list[tuple[int, float]]:
    import mlx.core as mx

    model = runner.model
    hidden = model.hidden(mx.array(tokens)[None], model.make_caches())[0, -1:]
    logits = model.unembed(hidden).astype(mx.float32)[0]
    logprobs = logits - mx.logsumexp(logits)
    order = mx.argsort(-logprobs).tolist()
    values = logprobs.tolist()
    return [(i, values[i]) for i in order]


def _run(systems, model_dir, engine, tmp_path, baseline_url=None):
    tokenizer = load_tokenizer(model_dir)
    workloads = build_workloads(list(NAMES), "small", tokenizer.encode)
    ctx = Context(model_dir, engine, tmp_path, SHAPES["small"].context, baseline_url)
    results: dict[str, list] = {w.name: [] for w in workloads}
    for system in systems:
        for r in run_system(system, workloads, ctx, repeats=1, sample_rows=None):
            results[r.workload].append(r)
    for variants in workloads:
        compute_metrics(variants.get(1), results[variants.name], SHAPES["small"], 100.0)
        assert format_workload(variants.get(1), results[variants.name])
    return results


def test_baseline_without_score_endpoint(model_dir, bench_engine, tmp_path):
    """The baseline falls back to one completion per row with the top 20 logprobs."""
    from runner.service import Runner

    handler = type("StandIn", (_StandIn,), {"runner": Runner.load(bench_engine, str(model_dir))})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        results = _run([Ours(), Baseline()], model_dir, bench_engine, tmp_path, url)
    finally:
        server.shutdown()
    for name in SCORE_WORKLOADS:
        ours, baseline = results[name]
        assert baseline.status == "ok", baseline.reason
        assert baseline.outcome.kind == "logprobs"
        assert "completions" in baseline.metrics["notes"]["via"]
        m = baseline.metrics
        assert m["centered"] and m["max_abs_diff"] < LOGIT_TOLERANCE, m
        assert m["coverage"] == 1
        # log-softmax differs from logits by one constant per row
        for got, want in zip(baseline.outcome.values, ours.outcome.values, strict=True):
            pairs = [(g, w) for g, w in zip(got, want, strict=True) if g is not None]
            shift = pairs[0][1] - pairs[0][0]
            assert all(math.isclose(w - g, shift, abs_tol=LOGIT_TOLERANCE) for g, w in pairs)
    assert results["generate"][1].status == "unavailable"  # the stand-in answered 501


@pytest.mark.slow
def test_http_systems(model_dir, bench_engine, tmp_path):
    """ours-http spawns `python -m runner`; the baseline is a second runner of ours, which
    has /v1/score, so it must take that path."""
    other = SpawnedRunner("--model", str(model_dir), log_path=tmp_path / "baseline.log")
    ours_http = OursHTTP()
    ours_http.fresh_per_workload = False  # one spawn is enough here
    try:
        other.wait_ready()
        results = _run(
            [Ours(), ours_http, Baseline()], model_dir, bench_engine, tmp_path, other.url
        )
    finally:
        other.stop()
    for name in SCORE_WORKLOADS:
        _, http, baseline = results[name]
        for r in (http, baseline):
            assert r.status == "ok", r.reason
            assert r.metrics["max_abs_diff"] < LOGIT_TOLERANCE
            assert r.metrics["argmax_agree"] == 1.0
        assert baseline.outcome.notes["via"] == "/v1/score"
    # one POST /v1/score per decision: latency, and the runner's own cost beyond arithmetic
    _, http, baseline = results["requests"]
    assert len(http.outcome.request_seconds) == len(http.outcome.values)
    assert all(http.metrics[k] > 0 for k in (*LATENCY, *OWN_COST)), http.metrics
    assert not any(k in baseline.metrics for k in OWN_COST)  # not our runner's figure
    _, http, baseline = results["generate"]
    if http.status == "unavailable":  # /v1/completions still answers 501
        assert "501" in http.reason
    else:
        assert http.status == "ok", http.reason
        assert http.metrics["new_tokens"] > 0 and http.metrics["ratio"] == 1.0
        assert baseline.status == "ok" and baseline.metrics["text_match"] == 1.0


def test_llama_cpp_skipped_without_package(model_dir, bench_engine, tmp_path, monkeypatch):
    """Without llama-cpp-python (CI never installs it) the llama.cpp systems, and ours on
    llama.cpp's Q4_K_M file, are skipped with a reason, on every workload, before anything
    is converted."""
    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    workloads = build_workloads(list(NAMES), "small", load_tokenizer(model_dir).encode)
    ctx = Context(model_dir, bench_engine, tmp_path, SHAPES["small"].context)
    for system in (LlamaCpp(), LlamaCppF16(), LlamaCppQ4(), LlamaCppQ80(), OursQ4(), OursQ40()):
        results = run_system(system, workloads, ctx, repeats=1, sample_rows=None)
        assert [r.workload for r in results] == list(NAMES)
        for r in results:
            assert r.status == "skipped", r
            assert "llama-cpp-python is not installed" in r.reason
    assert not (model_dir.parent / f"{model_dir.name}.gguf").exists()


@pytest.mark.llama
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
@pytest.mark.skipif(not HAS_TORCH, reason="converting to GGUF needs torch and transformers")
def test_llama_cpp_agrees_with_ours(model_dir, bench_engine, tmp_path):
    """The small model converted to GGUF (its bench tokenizer named "gpt-2" for the
    converter): llama.cpp-f32 scores like ours and tokenizes like ours; llama.cpp-f16 and
    -q4 run, and ours on -q4's file scores nearer -q4 than ours on the float model does. The
    converter comes from $LLAMA_CPP_SRC or the cached llama-cpp-python sdist."""
    systems = [Ours(), OursQ4(), LlamaCpp(), LlamaCppF16(), LlamaCppQ4()]
    results = _run(systems, model_dir, bench_engine, tmp_path)
    for name in SCORE_WORKLOADS:
        ours, ours_q4, f32, f16, q4 = results[name]
        assert ours_q4.status == "ok", ours_q4.reason
        same_file = _mean_abs_diff(ours_q4.outcome.values, q4.outcome.values)
        float_vs_q4 = _mean_abs_diff(ours.outcome.values, q4.outcome.values)
        # llama.cpp's 8-bit activations and float16 KV cache are the rest (0.57 measured)
        assert same_file < 0.75 * float_vs_q4, (name, same_file, float_vs_q4)
        assert f32.status == "ok", f32.reason
        assert f32.metrics["max_abs_diff"] < 1e-2, f32.metrics
        assert f32.metrics["argmax_agree"] == 1.0
        for r in (f16, q4):
            assert r.status == "ok", r.reason
            assert r.metrics["compared_rows"] == len(r.outcome.values) > 0
    # llama.cpp reuses its KV cache across rows: a row after the first computes its question
    requests = results["requests"][2].outcome.request_computed
    assert max(requests[1:]) < requests[0]
    _, _, f32, f16, q4 = results["generate"]
    for r in (f32, f16, q4):
        assert r.status == "ok", r.reason
        assert r.metrics["new_tokens"] > 0 and r.metrics["decode_tokens_per_s"] > 0
    cache = model_dir.parent / f"{model_dir.name}.gguf"
    assert all((cache / name).exists() for name in ("f32.gguf", "f16.gguf", "q4_k_m.gguf"))


def _mean_abs_diff(a: list, b: list) -> float:
    pairs = [
        (x, y)
        for row_a, row_b in zip(a, b, strict=True)
        for x, y in zip(row_a, row_b, strict=True)
        if x is not None and y is not None
    ]
    assert pairs
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="the vision baseline is transformers")
def test_vision_decisions_agree_with_transformers(capsys):
    from bench import vision

    assert vision.main(["--rows", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "vision decisions: 3 rows, one image" in out
    diff = float(out.split("max|Δlogit|")[1].split()[0])
    assert diff <= 1e-4


def test_requests_over_several_system_prompts(model_dir):
    """`requests.systems=N`: rows under N different system prompts in turn, the same shape
    otherwise (one row a request, exact token counts); one system prompt by default."""
    from bench.workloads import QUESTION_HEAD

    encode = load_tokenizer(model_dir).encode
    overrides = {"requests": {"systems": 3}}
    (turns,) = build_workloads(["requests"], "small", encode, overrides=overrides)
    (one,) = build_workloads(["requests"], "small", encode)
    for variants, n in ((turns, 3), (one, 1)):
        workload = variants.get(1)
        systems = [request[0].prompt.split(QUESTION_HEAD)[0] for request in workload.requests]
        assert len(set(systems)) == n
        assert all(system == systems[i % n] for i, system in enumerate(systems))
        size = workload.params["system"] + workload.params["question"]
        assert all(len(r) == 1 and r[0].tokens == size for r in workload.requests)


def test_sgemm_bench_times_the_dispatch_and_the_panels():
    """`python -m bench.sgemm`'s measurement, in this process (the tests run with the dispatch
    preloaded): cblas_sgemm, the panel products and the GGML block products (a forward's, and
    a decode step's: by limbs where the library has them) time every row count."""
    from bench import sgemm
    from runner.native import preload

    if not preload.dispatch_active():
        pytest.skip("needs the runner's dispatch library preloaded")
    for kind in ("sgemm", "panels"):
        rates = sgemm.child("tiny", [1, 3, 15], kind)
        assert set(rates) == {"1", "3", "15"}
        assert all(rate > 0 for rate in rates.values())
    for kind in ("q4k", "q5k", "q6k", "q4k-decode", "q6k-decode", "q5", "q5-decode"):  # k % 256
        rates = sgemm.child("tiny-blocks", [1, 2, 15], kind)
        assert set(rates) == {"1", "2", "15"}
        assert all(rate > 0 for rate in rates.values())
    with pytest.raises(SystemExit, match="not whole blocks"):
        sgemm.child("tiny", [1], "q4k")


def test_sgemm_bench_runs_the_library_it_is_given(tmp_path):
    """`--library FILE`: each setting's child preloads that file instead of this CPU's build
    (a file that is no library leaves the child without one: it fails), and a path with no
    file is refused before any child runs."""
    import subprocess

    from bench import sgemm
    from runner.native import build, preload

    if not preload.dispatch_active() or preload.optimised_blas() is None:
        pytest.skip("needs the runner's dispatch library preloaded and Debian's OpenBLAS")
    rates = sgemm.run_setting("q4k-1t", "tiny-blocks", [1, 2], build.library())
    assert set(rates) == {"1", "2"} and all(rate > 0 for rate in rates.values())
    not_a_library = tmp_path / "not-a-library.so"
    not_a_library.write_bytes(b"\0" * 64)
    with pytest.raises(subprocess.CalledProcessError):
        sgemm.run_setting("q4k-1t", "tiny-blocks", [1], str(not_a_library))
    with pytest.raises(SystemExit, match="no library at"):
        sgemm.main(["--shape", "tiny-blocks", "--library", str(tmp_path / "absent.so")])


def test_mxfp4_experts_bench_times_both_ways(capsys):
    """`python -m bench.mxfp4_experts` on a narrow gpt-oss: each round times MLX's gather_qmm
    and then the library's products on the same experts."""
    from bench import mxfp4_experts
    from runner.native import preload

    if not preload.dispatch_active():
        pytest.skip("needs the runner's dispatch library preloaded")
    assert (
        mxfp4_experts.main(["--layers", "2", "--experts", "4", "--rounds", "1", "--hidden", "64"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].split()[-1] for line in lines] == ["gather_qmm", "library"]
    assert all("prompt" in line and "a token" in line for line in lines)


def _decode_builds_model(tmp_path):
    """A tiny Q4_K_M-like GGUF for bench.decode_builds' runners; skips where the runner's
    dispatch library is not preloaded or there is no C compiler."""
    from runner.native import build, preload
    from tests.gguf_models import k_mixed, write_gguf
    from tests.test_gguf_models import K_QUANT_LLAMA
    from tests.tiny import edit_text_config, tiny_config, write_tiny_model

    if not preload.dispatch_active() or build.compiler() is None:
        pytest.skip("needs the runner's dispatch library preloaded and a C compiler")
    config = edit_text_config(tiny_config("LlamaForCausalLM"), K_QUANT_LLAMA)
    checkpoint = write_tiny_model("LlamaForCausalLM", tmp_path / "hf", config=config)
    return write_gguf(checkpoint, tmp_path / "model.gguf", k_mixed)


def test_decode_builds_bench_times_each_build_on_the_same_text(tmp_path):
    """`python -m bench.decode_builds`' measurement: a runner spawned per build of the native
    library (this CPU's, and an x86-64-v3 one: what AVX2-only CPUs build) on a tiny
    Q4_K_M-like GGUF, each timing its decode tokens, and all generating the same greedy text
    (measure raises otherwise)."""
    import platform

    from bench import decode_builds

    model = _decode_builds_model(tmp_path)
    builds = ["native", "x86-64-v3"] if platform.machine() == "x86_64" else ["native"]
    libraries = [decode_builds.library_for(b, tmp_path) for b in builds]
    libraries.append(libraries[0])  # the same build twice: an A/A control, timed apart
    times = decode_builds.measure(model, libraries, 2, 4, decode_builds.prompt(20))
    assert len(times) == len(libraries)
    assert all(len(t) == 2 and min(t) > 0 for t in times)
    # --workload prefill: ms a prompt token, each round's prompt new to every prefix cache
    prefill = decode_builds.measure(model, libraries[:1], 2, 1, decode_builds.prompt(20), True)
    assert len(prefill) == 1 and len(prefill[0]) == 2 and min(prefill[0]) > 0


def test_decode_builds_bench_times_decision_requests(tmp_path):
    """`python -m bench.decode_builds --workload decisions`: one-decision requests over a
    cached system prompt, each runner's median ms a round, the picks checked alike (a build
    listed twice: an A/A control); the questions of a round are the same for every runner
    and differ between rounds."""
    from bench import decode_builds

    assert decode_builds.questions(3, 4) == decode_builds.questions(3, 4)
    assert decode_builds.questions(3, 4) != decode_builds.questions(4, 4)
    model = _decode_builds_model(tmp_path)
    library = decode_builds.library_for("native", tmp_path)
    times = decode_builds.measure_decisions(
        model, [library, library], 2, 3, decode_builds.prompt(20), max_tokens=2048
    )
    assert len(times) == 2
    assert all(len(t) == 2 and min(t) > 0 for t in times)
    # --rows: several decisions a request (one row each)
    batched = decode_builds.measure_decisions(
        model, [library], 1, 2, decode_builds.prompt(20), max_tokens=2048, rows=3
    )
    assert len(batched) == 1 and len(batched[0]) == 1 and batched[0][0] > 0


def test_decode_builds_bench_runs_another_checkout(tmp_path):
    """A build named by a checkout's directory (this one's here, as another commit's worktree
    would be): the library that checkout builds for this CPU, and a runner spawned from it
    (its Python), timed beside this checkout's; a directory without the runner's package is
    no checkout."""
    from bench import decode_builds

    model = _decode_builds_model(tmp_path)
    repo = Path(decode_builds.__file__).resolve().parents[1]
    assert decode_builds.checkout_of(str(repo)) == repo
    assert decode_builds.checkout_of(str(tmp_path)) is None
    library = decode_builds.library_for(str(repo), tmp_path)
    assert library == decode_builds.library_for("native", tmp_path)  # the same sources
    with decode_builds.spawned(model, [library], [repo]) as runners:
        assert Path(f"/proc/{runners[0].process.pid}/cwd").resolve() == repo
    times = decode_builds.measure(
        model, [library, library], 1, 2, decode_builds.prompt(20), checkouts=[repo, None]
    )
    assert len(times) == 2 and all(len(t) == 1 and t[0] > 0 for t in times)


def test_block_codes_harness_times_a_format_and_its_codes(tmp_path):
    """bench/block_codes.c builds as its comment says (one unit with runner/native/quantized.c)
    and times a grid i-quant's one-row product and its codes alone, a K-quant without
    16-weight codes its product only, and refuses a format that is no GGML block format."""
    import re
    import subprocess

    from runner.native import build

    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    repo = Path(__file__).resolve().parents[1]
    binary = tmp_path / "block_codes"
    subprocess.run(
        [cc, "-O2", "-ffp-contract=fast", "-pthread", f"-I{repo / 'runner' / 'native'}",
         "-o", str(binary), str(repo / "bench" / "block_codes.c"), "-ldl", "-lm"],
        check=True,
    )  # fmt: skip
    number = r"([0-9.]+)"
    iq3s = subprocess.run([binary, "15", "8"], capture_output=True, text=True, check=True).stdout
    found = re.search(rf"product {number} ns .* alone {number} ns", iq3s)
    assert found and 0 < float(found.group(2)) < float(found.group(1)), iq3s
    q4k = subprocess.run([binary, "5", "8"], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"product {number} ns", q4k) and "alone" not in q4k, q4k
    assert subprocess.run([binary, "3"], capture_output=True).returncode == 2  # W_AFFINE


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_decode_builds_rotate_their_turns(count):
    """Each round of `python -m bench.decode_builds` asks every runner once, and over `count`
    rounds each runner is asked at each place once: a runner asked later in a round measured
    ~4-5% faster than the same library asked first, which a fixed order credits to one build."""
    from bench.decode_builds import turns

    orders = [turns(r, count) for r in range(count)]
    assert all(sorted(order) == list(range(count)) for order in orders)
    for runner in range(count):
        assert sorted(order.index(runner) for order in orders) == list(range(count))
    if count > 1:
        assert turns(0, count) != turns(1, count)


def test_families_bench_says_which_families_take_the_native_step():
    """`python -m bench.families`' measurement, in this process: a Llama and a Phi3 (fused
    projections), a Qwen3-MoE (experts) and a GPT-OSS (attention sinks, biased experts) take
    the native step where the dispatch is preloaded, a Cohere2-MoE stays on MLX's path; every
    figure a time."""
    from bench import families
    from runner.native import preload

    archs = ["LlamaForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"]
    archs.append("Cohere2MoeForCausalLM")
    measured = {f.arch: f for f in families.measure(archs, steps=2)}
    step = preload.dispatch_active()
    assert [measured[a].native for a in archs] == [step, step, step, step, False]
    for f in measured.values():
        times = (f.decode_ms, f.decode_mlx_ms, f.forward_ms, f.forward_mlx_ms)
        assert f.layers > 0 and all(ms > 0 for ms in times)


def test_kept_connection_posts_over_one_connection():
    """The bench's HTTP client for score requests keeps one connection for all of them (as a
    supervisor's client does: a new TCP connection a request cost ~1-3 ms of a decision
    request), answers a non-2xx with HTTPStatus, and opens a new connection once when the
    server has dropped the kept one."""
    connections = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            connections.append(self.client_address)

        def do_POST(self):
            data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = json.dumps({"echo": data}).encode()
            self.send_response(data.get("status", 200))
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            # "drop": close without saying so, as a server's idle timeout does
            self.close_connection = bool(data.get("drop"))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    connection = KeptConnection(f"http://127.0.0.1:{server.server_port}")
    try:
        for i in range(5):
            assert connection.post_json("/v1/score", {"i": i}) == {"echo": {"i": i}}
        assert len(connections) == 1
        with pytest.raises(HTTPStatus) as refused:
            connection.post_json("/v1/score", {"status": 404})
        assert refused.value.status == 404
        assert connection.post_json("/v1/score", {"drop": True}) == {"echo": {"drop": True}}
        assert connection.post_json("/v1/score", {"i": 9}) == {"echo": {"i": 9}}
        assert len(connections) == 2
    finally:
        connection.close()
        server.shutdown()


def test_own_cost_is_reckoned_at_the_rate_measured_beside_the_trials():
    """With a matmul rate measured beside the trials, a request's arithmetic is its FLOPs at
    that rate; the own cost at the run's start rate is kept beside it."""
    from bench.harness import Result
    from bench.report import request_flops, request_metrics
    from bench.workloads import Row, ScoreWorkload

    shape = SHAPES["small"]
    rows = [[Row("p", (" Yes", " No"), 100)] for _ in range(3)]
    workload = ScoreWorkload("requests", {}, rows, latency=True)
    outcome = ScoreOutcome([[0.0, 0.0]] * 3, 3, 130, request_seconds=[0.5, 0.03, 0.05])
    outcome.request_computed = [100, 15, 15]
    flops = request_flops(shape, 15, 85, 2)
    for beside in (None, 20.0):
        result = Result("requests", "ours", "ok", outcome=outcome, peak_beside=beside)
        m = request_metrics(workload, result, shape, 40.0)
        rate = beside or 40.0
        assert m["peak_gflops"] == rate
        assert math.isclose(m["arithmetic_median_s"], flops / (rate * 1e9))
        assert math.isclose(m["own_median_s"], 0.04 - flops / (rate * 1e9))
        assert ("own_at_run_peak_s" in m) == (beside is not None)
        if beside:
            assert math.isclose(m["own_at_run_peak_s"], 0.04 - flops / 40e9)


def test_own_cost_is_reckoned_at_the_rate_probed_around_each_request():
    """Probed rates around each request replace the rate beside the trials: a request's
    arithmetic is its FLOPs at the better of the probes just before and after it."""
    from bench.base import RateProbes
    from bench.harness import Result
    from bench.report import request_flops, request_metrics
    from bench.workloads import Row, ScoreWorkload

    shape = SHAPES["small"]
    rows = [[Row("p", (" Yes", " No"), 100)] for _ in range(4)]
    workload = ScoreWorkload("requests", {}, rows, latency=True)
    probes = iter([5.0, 10.0, 40.0, 20.0, 30.0])

    around = RateProbes(lambda: next(probes))
    for _ in range(4):
        around.after_request()
    assert around.around() == [10.0, 40.0, 40.0, 30.0]
    seconds = [0.5, 0.03, 0.05, 0.04]
    outcome = ScoreOutcome([[0.0, 0.0]] * 4, 4, 145, request_seconds=seconds)
    outcome.request_computed = [100, 15, 15, 15]
    outcome.request_rates = around.around()
    flops = request_flops(shape, 15, 85, 2)
    m = request_metrics(workload, Result("requests", "ours", "ok", outcome=outcome), shape, 50.0)
    own = sorted(
        t - flops / (rate * 1e9) for t, rate in zip(seconds[1:], [40.0, 40.0, 30.0], strict=True)
    )
    assert math.isclose(m["own_median_s"], own[1])
    assert math.isclose(m["arithmetic_median_s"], flops / 40e9)
    assert m["request_gflops_range"] == (30.0, 40.0, 40.0)
    assert math.isclose(m["own_beside_trials_s"], 0.04 - flops / 50e9)  # at the run's rate


def test_rate_probes_give_nothing_unless_every_probe_measured():
    from bench.base import RateProbes

    assert RateProbes(None).around() == []
    values = iter([10.0, None, 12.0])
    probes = RateProbes(lambda: next(values))
    probes.after_request()
    probes.after_request()
    assert probes.around() == []


def test_harness_probes_only_our_latency_trials(model_dir, bench_engine, tmp_path):
    """The harness hands the rate probe to our runner's systems for a latency workload's
    timed trials only (not the warm-up, not other workloads, not other systems), and takes
    it back even when a trial fails."""
    from bench.base import System
    from bench.harness import _run_one

    tokenizer = load_tokenizer(model_dir)
    workloads = {
        v.name: v for v in build_workloads(["requests", "decisions"], "small", tokenizer.encode)
    }
    ctx = Context(model_dir, bench_engine, tmp_path, SHAPES["small"].context)
    ctx.probe_rate = lambda: 1.0
    ctx.measure_peak = lambda: 2.0
    seen: list[tuple[str, bool]] = []

    class Probed(System):
        name = "ours"
        fail = False

        def score(self, requests, limit):
            seen.append((len(requests), self.rate_probe is not None))
            if self.fail and len(requests) > 1:
                raise RuntimeError("boom")
            return ScoreOutcome([[0.0, 0.0]], 1, 1, request_seconds=[0.1])

    system = Probed()
    _run_one(system, workloads["requests"], 2, None, None, ctx)
    assert [probed for _, probed in seen] == [False, True, True]  # warm-up unprobed
    seen.clear()
    _run_one(system, workloads["decisions"], 1, None, None, ctx)
    assert [probed for _, probed in seen] == [False, False]  # not a latency workload
    seen.clear()
    other = Probed()
    other.name = "llama.cpp-f32"
    _run_one(other, workloads["requests"], 1, None, None, ctx)
    assert [probed for _, probed in seen] == [False, False]
    system.fail = True
    result = _run_one(system, workloads["requests"], 1, None, None, ctx)
    assert result.status == "error" and system.rate_probe is None


def test_gguf_load_bench_writes_a_gpt_oss_the_runner_loads(tmp_path, monkeypatch, capsys):
    """bench.gguf_load's gpt-oss writer (gpt-oss-20b's layout at a tiny size: a shape added for
    the test): MXFP4 experts, Q8_0 matrices, F32 norms and biases, the experts it is asked
    for; the runner loads it (its experts computed by the library where it is preloaded) and
    `--forwards` times it."""
    import re

    import gguf
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from bench import gguf_load
    from runner.backend import Backend, library_products
    from runner.models import build_model, quantized
    from runner.sources.gguf.model import load_gguf

    monkeypatch.setitem(gguf_load.SHAPES, "tiny-oss", (64, 4, 4, 2, 64, 340))
    monkeypatch.setitem(gguf_load.GPT_OSS, "tiny-oss", (16, 8, 2))
    path = gguf_load.write_gpt_oss("tiny-oss", tmp_path / "oss.gguf", cut=2, experts=4)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_down_exps.weight"] == "MXFP4" and "blk.2.attn_q.weight" not in types
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_q.bias"] == "F32"
    assert int(reader.fields["gpt-oss.expert_count"].contents()) == 4
    model = build_model(load_gguf(path))
    switch = [m for _, m in model.module.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(switch) == 3 * 2 and all(m.mode == "mxfp4" for m in switch)  # gate, up, down
    if library_products.for_backend(Backend.for_device()) is not None:
        assert all(type(m) is quantized.AffineSwitchLinear for m in switch)
    gguf_load.measure(path, forwards=True, steps=2, prompt=8)
    decode = re.search(r"decode ([\d.]+) ms a token", capsys.readouterr().out)
    assert decode is not None and float(decode.group(1)) > 0


def test_gguf_load_bench_writes_a_mixture_of_experts_and_counts_the_model(
    tmp_path, monkeypatch, capsys
):
    """bench.gguf_load's Qwen3-MoE writer (the 30b-a3b shape's layout at a tiny size: a shape
    added for the test) gives a file the runner loads, Q6_K where llama.cpp's use_more_bits
    says; the resident size it reports is the built model's (every block kept on the CPU:
    at the file's size, where converting the experts had taken ~2x); `--forwards` times decode
    steps, a prompt and rows batched over a prefix."""
    import re

    import gguf

    from bench import gguf_load

    monkeypatch.setitem(gguf_load.SHAPES, "tiny-moe", (256, 8, 4, 2, 512, 512))
    monkeypatch.setitem(gguf_load.EXPERTS, "tiny-moe", (64, 4, 2, 256))
    path = gguf_load.write_gguf("tiny-moe", tmp_path / "moe.gguf", cut=8)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    downs = [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(8)]
    assert downs == ["Q6_K" if gguf_load.more_bits(i, 8) else "Q4_K" for i in range(8)]
    assert set(downs) == {"Q4_K", "Q6_K"} and types["output.weight"] == "Q6_K"
    gguf_load.measure(path, forwards=True, steps=2, prompt=8)
    out = capsys.readouterr().out
    ratio = re.search(r"resident [\d.]+ MB \(([\d.]+)x the file\)", out)
    assert ratio is not None and float(ratio.group(1)) <= 1.02
    decode = re.search(r"decode ([\d.]+) ms a token", out)
    prompt = re.search(r"prompt ([\d.]+) ms a token", out)
    assert decode is not None and float(decode.group(1)) > 0
    assert prompt is not None and float(prompt.group(1)) > 0
    rows = re.search(r"rows ([\d.]+) ms", out)
    assert rows is not None and float(rows.group(1)) > 0
    # the same by llama.cpp where llama-cpp-python is installed, else said so
    gguf_load.measure(path, forwards=True, steps=2, prompt=8, llama_cpp=True)
    out = capsys.readouterr().out
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama.cpp skipped: llama-cpp-python is not installed" in out
    else:
        for name in ("decode", "prompt", "rows"):
            said = re.search(rf"llama.cpp {name} ([\d.]+) ms: ours ([\d.]+)x", out)
            assert said is not None and float(said.group(1)) > 0 and float(said.group(2)) > 0
