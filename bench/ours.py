"""Our runner, three ways: in process, rows one by one in process, and over HTTP.

- `ours`: each workload request goes through the /v1/score façade
  (runner/server/endpoints.py `ScoreEndpoint`: prepare here, execute on the engine thread), exactly
  what the HTTP handler does, without HTTP.
- `ours-rows`: the same path with one request per row, the "one-by-one" baseline for
  batched scoring (the runner's prefix cache still serves later rows the shared prefix); not
  run where every request is one row already (the `requests` workload), as it equals `ours`.
- `ours-http`: `python -m runner --model DIR --port P` spawned as a supervisor would, one
  POST /v1/score per workload request; generation through POST /v1/completions (Go wire
  format, application/jsonl).
- `ours-q4`: the same spawned runner on the Q4_K_M GGUF that `llama.cpp-q4` runs (llama.cpp's
  own quantizer's file, made by bench/llamacpp.py; the runner loads it as it loads a store's
  blob): the two engines on the same quantized bits. Its answers differ from `ours`' by the
  quantization, as llama.cpp-q4's do; needs llama-cpp-python to make the file.
- `ours-q4_0`, `ours-q8_0`, `ours-q5`, `ours-q3`, `ours-q2`, `ours-iq4`: the same on
  `llama.cpp-q4_0`'s, `llama.cpp-q8_0`'s, `llama.cpp-q5`'s, `llama.cpp-q3`'s,
  `llama.cpp-q2`'s and `llama.cpp-iq4`'s files.
"""

from __future__ import annotations

import gc
import subprocess
import time
from collections.abc import Callable

from bench.base import (
    Context,
    GenerateOutcome,
    RateProbes,
    ScoreOutcome,
    System,
    Unavailable,
    limited,
    mlx_memory_bytes,
)
from bench.http import MISSING_ENDPOINT, HTTPStatus, KeptConnection, SpawnedRunner, post_jsonl
from bench.llamacpp import IQ4, Q2, Q3, Q4, Q4_0, Q5, Q8_0
from bench.workloads import GenerateWorkload, Row, ScoreWorkload, Workload

NANOSECONDS = 1e9


# Every workload starts on a freshly loaded runner, so no workload is served from what
# another one stored in the prefix cache.
FRESH_PER_WORKLOAD = True


class Ours(System):
    name = "ours"
    description = "runner in process: the /v1/score façade, one call per request"
    fresh_per_workload = FRESH_PER_WORKLOAD

    def prepare(self, ctx: Context) -> None:
        self.ctx = ctx
        self.runner = ctx.load_runner()

    def close(self) -> None:
        def release(_job) -> None:
            import mlx.core as mx

            self.runner = None
            gc.collect()  # the runner's caches reference each other
            mx.clear_cache()

        self.ctx.engine.call(release)

    def memory_bytes(self) -> int | None:
        return mlx_memory_bytes(self.ctx.engine)

    def supports(self, workload: Workload) -> str | None:
        if workload.kind == "generate":
            return "generation is measured over HTTP (ours-http)"
        return None

    def _score_one(self, rows: list[Row]) -> tuple[list[list[float]], int, float]:
        from runner.protocol.wire import ScoreRequest, ScoreRow
        from runner.server.endpoints import ScoreEndpoint

        endpoint = ScoreEndpoint(self.runner)
        started = time.perf_counter()
        request = ScoreRequest(
            rows=[ScoreRow(prompt=r.prompt, candidates=list(r.candidates)) for r in rows],
            maxtokens=self.ctx.max_tokens,
        )
        plan = endpoint.prepare(request)
        prepare_seconds = time.perf_counter() - started
        answer = self.runner.engine.call(lambda job: endpoint.execute(plan, job))
        return answer.logits, answer.input_tokens - answer.cached_tokens, prepare_seconds

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        values: list[list[float | None]] = []
        request_seconds, request_computed = [], []
        prepare_seconds = 0.0
        probes = RateProbes(self.rate_probe)
        for rows in requests:
            started = time.perf_counter()
            logits, tokens, seconds = self._score_one(rows)
            request_seconds.append(time.perf_counter() - started)
            probes.after_request()
            request_computed.append(tokens)
            values += logits
            prepare_seconds += seconds
        return ScoreOutcome(
            values,
            len(values),
            sum(request_computed),
            notes={"prepare_s": round(prepare_seconds, 4)},
            request_seconds=request_seconds,
            request_computed=request_computed,
            request_rates=probes.around(),
        )


class OursRows(Ours):
    name = "ours-rows"
    description = "runner in process, one request per row (its prefix cache still applies)"
    one_by_one = True

    def supports(self, workload: Workload) -> str | None:
        if isinstance(workload, ScoreWorkload) and all(len(r) == 1 for r in workload.requests):
            return "every request is one row already: the same as ours"
        return super().supports(workload)

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        rows = limited(requests, limit)
        return super().score([[row] for row in rows], None)


def http_score(
    url: str,
    requests: list[list[Row]],
    max_tokens: int,
    rate_probe: Callable[[], float | None] | None = None,
) -> ScoreOutcome:
    """One POST /v1/score per request, over one kept connection (as a supervisor's client
    keeps it); raises Unavailable when the endpoint is missing. `rate_probe`: see
    `RateProbes`."""
    values: list[list[float | None]] = []
    request_seconds, request_computed = [], []
    connection = KeptConnection(url)
    probes = RateProbes(rate_probe)
    try:
        for rows in requests:
            body = {
                "rows": [{"prompt": r.prompt, "candidates": list(r.candidates)} for r in rows],
                "max_tokens": max_tokens,
            }
            started = time.perf_counter()
            try:
                answer = connection.post_json("/v1/score", body)
            except HTTPStatus as e:
                if e.status in MISSING_ENDPOINT:
                    raise Unavailable(str(e)) from None
                raise
            request_seconds.append(time.perf_counter() - started)
            probes.after_request()
            request_computed.append(answer["input_tokens"] - answer.get("cached_tokens", 0))
            values += answer["logits"]
    finally:
        connection.close()
    return ScoreOutcome(
        values,
        len(values),
        sum(request_computed),
        request_seconds=request_seconds,
        request_computed=request_computed,
        request_rates=probes.around(),
    )


def completion_body(prompt: str, num_predict: int, top_logprobs: int = 0) -> dict:
    """The Go supervisor's CompletionRequest (docs/PROTOCOL.md §3): greedy, `num_predict`."""
    return {
        "Prompt": prompt,
        "Media": None,
        "Options": {"temperature": 0, "num_predict": num_predict},
        "Logprobs": top_logprobs > 0,
        "TopLogprobs": top_logprobs,
    }


def completion_lines(url: str, body: dict) -> list[dict]:
    """The JSONL lines of one POST /v1/completions, up to the `Done` line."""
    try:
        lines = []
        for line in post_jsonl(url + "/v1/completions", body):
            if line.get("Error"):
                raise RuntimeError(f"completion failed: {line['Error']}")
            lines.append(line)
            if line.get("Done"):
                return lines
    except HTTPStatus as e:
        if e.status in MISSING_ENDPOINT:
            raise Unavailable(str(e)) from None
        raise
    raise RuntimeError("completion stream ended without a Done line")


def http_generate(url: str, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
    lines = completion_lines(url, completion_body(workload.prompt, new_tokens))
    done = lines[-1]
    return GenerateOutcome(
        text="".join(line.get("Content", "") for line in lines),
        prompt_tokens=done.get("PromptEvalCount", 0),
        new_tokens=done.get("EvalCount", 0),
        prefill_seconds=done.get("PromptEvalDuration", 0) / NANOSECONDS or None,
        decode_seconds=done.get("EvalDuration", 0) / NANOSECONDS or None,
        decode_tokens=done.get("EvalCount", 0),
        notes={"done_reason": done.get("DoneReason")},
    )


class OursHTTP(System):
    name = "ours-http"
    description = "python -m runner spawned as a supervisor would; /v1/score, /v1/completions"
    fresh_per_workload = FRESH_PER_WORKLOAD
    process_name = "runner"

    def model(self, ctx: Context) -> str:
        """What the spawned runner's --model names."""
        return str(ctx.model_dir)

    def prepare(self, ctx: Context) -> None:
        self.ctx = ctx
        self.process = SpawnedRunner(
            "--model", self.model(ctx), log_path=ctx.work_dir / f"{self.name}.log"
        )
        try:
            self.process.wait_ready()
        except BaseException:
            self.process.stop()
            raise

    def close(self) -> None:
        self.process.stop()

    def exit_code(self, wait: float = 0.0) -> int | None:
        process = getattr(self, "process", None)
        if process is None:
            return None
        try:
            return process.wait(timeout=wait) if wait > 0 else process.process.poll()
        except subprocess.TimeoutExpired:
            return None

    def memory_bytes(self) -> int | None:
        return self.process.memory_bytes()

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        return http_score(self.process.url, requests, self.ctx.max_tokens, self.rate_probe)

    def generate(self, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
        return http_generate(self.process.url, workload, new_tokens)


class OursQ4(OursHTTP):
    name = "ours-q4"
    description = "runner spawned on llama.cpp-q4's Q4_K_M GGUF (the same file)"
    gguf = Q4

    def model(self, ctx: Context) -> str:
        from bench.llamacpp import cached_gguf, import_llama_cpp

        return str(cached_gguf(import_llama_cpp(), ctx, self.gguf))


class OursQ40(OursQ4):
    name = "ours-q4_0"
    description = "runner spawned on llama.cpp-q4_0's Q4_0 GGUF (the same file)"
    gguf = Q4_0


class OursQ80(OursQ4):
    name = "ours-q8_0"
    description = "runner spawned on llama.cpp-q8_0's Q8_0 GGUF (the same file)"
    gguf = Q8_0


class OursQ5(OursQ4):
    name = "ours-q5"
    description = "runner spawned on llama.cpp-q5's Q5_K_M GGUF (the same file)"
    gguf = Q5


class OursQ3(OursQ4):
    name = "ours-q3"
    description = "runner spawned on llama.cpp-q3's Q3_K_M GGUF (the same file)"
    gguf = Q3


class OursQ2(OursQ4):
    name = "ours-q2"
    description = "runner spawned on llama.cpp-q2's Q2_K GGUF (the same file)"
    gguf = Q2


class OursIQ4(OursQ4):
    name = "ours-iq4"
    description = "runner spawned on llama.cpp-iq4's IQ4_XS GGUF (the same file)"
    gguf = IQ4
