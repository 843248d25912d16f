"""The ways people score without us: mlx-lm, transformers, and another runner.

- `mlx-lm`: `mlx_lm.load` on the same directory, then per row a full forward over the whole
  prompt (vocabulary logits at every position) and the candidates picked from the last one;
  generation with `mlx_lm.stream_generate` (greedy). On the CPU backend the weights are cast
  to float32 as our runner does, since MLX's CPU bfloat16/float16 matmul is ~40x slower here:
  the ratio then measures the method, not the dtype.
- `transformers`: CPU PyTorch in float32, the same per-row forward; `model.generate(
  do_sample=False)` for generation.
- `baseline`: any Ollama-compatible runner at `--baseline-url`: its /v1/score when it has
  one, else one /v1/completions per row with num_predict 1 and the top 20 logprobs (what its
  users do today: a candidate outside the top 20 has no value).
"""

from __future__ import annotations

import gc
import os
import time
import urllib.error
from typing import Any

from bench.base import (
    Context,
    GenerateOutcome,
    ScoreOutcome,
    Skipped,
    System,
    Unavailable,
    limited,
    mlx_memory_bytes,
    score_rows,
)
from bench.http import MISSING_ENDPOINT
from bench.ours import completion_body, completion_lines, http_generate, http_score
from bench.workloads import GenerateWorkload, Row
from tools.spawned import HTTPStatus, get_json, post_json

TOP_LOGPROBS = 20


def _single_token(encode, candidate: str) -> int:
    ids = encode(candidate)
    if len(ids) != 1:
        raise ValueError(f"candidate {candidate!r} is {len(ids)} tokens for this tokenizer")
    return ids[0]


class MlxLm(System):
    name = "mlx-lm"
    description = "mlx_lm.load; full forward per row, full-vocabulary logits; stream_generate"
    one_by_one = True
    sampled_ok = True

    def prepare(self, ctx: Context) -> None:
        self.engine = ctx.engine

        def load(_job) -> tuple[Any, Any]:
            import mlx.core as mx
            import mlx_lm

            from runner.backend import Backend

            model, tokenizer = mlx_lm.load(str(ctx.model_dir))
            dtype = Backend.for_device().compute_dtype  # float32 on a CPU, as ours
            if dtype is not None:
                model.set_dtype(dtype)
            mx.eval(model.parameters())
            return model, tokenizer

        self.model, self.tokenizer = self.engine.call(load)

    def close(self) -> None:
        def release(_job) -> None:
            import mlx.core as mx

            self.model = self.tokenizer = None
            gc.collect()
            mx.clear_cache()

        self.engine.call(release)

    def memory_bytes(self) -> int | None:
        return mlx_memory_bytes(self.engine)

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        rows = limited(requests, limit)

        def run(_job) -> ScoreOutcome:
            import mlx.core as mx

            def score_row(row: Row) -> tuple[list[float | None], int]:
                ids = self.tokenizer.encode(row.prompt)
                wanted = [_single_token(self._encode_plain, c) for c in row.candidates]
                logits = self.model(mx.array(ids)[None])
                picked = logits[0, -1, mx.array(wanted)].astype(mx.float32)
                return picked.tolist(), len(ids)

            return score_rows(rows, score_row)

        return self.engine.call(run)

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
        def run(_job) -> GenerateOutcome:
            from mlx_lm import stream_generate

            text = []
            last = None
            for last in stream_generate(
                self.model, self.tokenizer, workload.prompt, max_tokens=new_tokens
            ):
                text.append(last.text)
            assert last is not None
            return GenerateOutcome(
                text="".join(text),
                prompt_tokens=last.prompt_tokens,
                new_tokens=last.generation_tokens,
                prefill_seconds=last.prompt_tokens / last.prompt_tps,
                # mlx-lm's clock starts when the first token is out: the window holds the
                # forwards of tokens 2..n, though it divides all n tokens by it.
                decode_seconds=last.generation_tokens / last.generation_tps,
                decode_tokens=last.generation_tokens - 1,
                notes={"finish_reason": last.finish_reason},
            )

        return self.engine.call(run)


class _Clock:
    """A transformers streamer that only records when each batch of tokens arrives."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class Transformers(System):
    name = "transformers"
    description = "transformers on CPU PyTorch, float32; full forward per row; generate()"
    one_by_one = True
    sampled_ok = True

    def prepare(self, ctx: Context) -> None:
        try:
            import torch
            import transformers
        except ImportError as e:
            raise Skipped(f"not installed: {e.name}") from None
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        path = str(ctx.model_dir)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()

    def close(self) -> None:
        self.model = self.tokenizer = None

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        def score_row(row: Row) -> tuple[list[float | None], int]:
            ids = self.tokenizer(row.prompt, return_tensors="pt").input_ids
            wanted = [_single_token(self._encode_plain, c) for c in row.candidates]
            logits = self.model(ids).logits[0, -1]
            return logits[wanted].float().tolist(), ids.shape[1]

        with self.torch.inference_mode():
            return score_rows(limited(requests, limit), score_row)

    def generate(self, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
        torch = self.torch
        encoded = self.tokenizer(workload.prompt, return_tensors="pt")
        clock = _Clock()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                **encoded,
                max_new_tokens=new_tokens,
                do_sample=False,
                streamer=clock,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        ended = time.perf_counter()
        prompt_tokens = encoded.input_ids.shape[1]
        new = out[0, prompt_tokens:].tolist()
        first = clock.stamps[1] if len(clock.stamps) > 1 else ended  # [0] is the prompt
        return GenerateOutcome(
            text=self.tokenizer.decode(new),
            prompt_tokens=prompt_tokens,
            new_tokens=len(new),
            prefill_seconds=first - started,
            decode_seconds=ended - first,
            decode_tokens=len(new) - 1,  # the first token came before `first`
        )


class Baseline(System):
    name = "baseline"
    description = "an Ollama-compatible runner at --baseline-url: /v1/score, else completions"

    def prepare(self, ctx: Context) -> None:
        if not ctx.baseline_url:
            raise Skipped("no --baseline-url given")
        self.ctx = ctx
        self.url = ctx.baseline_url.rstrip("/")
        try:
            get_json(self.url + "/v1/status")
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as e:
            raise Skipped(f"{self.url}/v1/status did not answer: {e}") from None
        self.mode = ctx.baseline_mode if ctx.baseline_mode != "auto" else self._probe()
        self.one_by_one = self.mode == "completions"
        self.description = f"{self.url} via " + (
            "/v1/score" if self.mode == "score" else "/v1/completions per row, top-20 logprobs"
        )

    def _probe(self) -> str:
        """ "score" when /v1/score exists (a 400 for this body still says it does)."""
        body = {"rows": [{"prompt": "Hello", "candidates": [" Yes"]}], "max_tokens": 1}
        try:
            post_json(self.url + "/v1/score", body, timeout=60)
        except HTTPStatus as e:
            if e.status in MISSING_ENDPOINT:
                return "completions"
            if e.status != 400:
                raise
        return "score"

    def score(self, requests: list[list[Row]], limit: int | None) -> ScoreOutcome:
        if self.mode == "score":
            outcome = http_score(self.url, requests, self.ctx.max_tokens)
            outcome.notes["via"] = "/v1/score"
            return outcome

        def score_row(row: Row) -> tuple[list[float | None], int]:
            lines = completion_lines(self.url, completion_body(row.prompt, 1, TOP_LOGPROBS))
            top = _first_top_logprobs(lines)
            return [top.get(c) for c in row.candidates], lines[-1].get("PromptEvalCount", 0)

        outcome = score_rows(limited(requests, limit), score_row)
        outcome.kind = "logprobs"
        outcome.notes["via"] = f"/v1/completions per row, top {TOP_LOGPROBS} logprobs"
        return outcome

    def generate(self, workload: GenerateWorkload, new_tokens: int) -> GenerateOutcome:
        return http_generate(self.url, workload, new_tokens)

    def memory_bytes(self) -> int | None:
        try:
            return int(get_json(self.url + "/v1/status")["Memory"])
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, KeyError):
            return None


def _first_top_logprobs(lines: list[dict]) -> dict[str, float]:
    """token text -> logprob of the first generated position's top logprobs."""
    for line in lines:
        for entry in line.get("Logprobs") or []:
            top = {t["token"]: t["logprob"] for t in entry.get("top_logprobs") or []}
            top.setdefault(entry["token"], entry["logprob"])
            return top
    raise Unavailable("the completion carried no logprobs")
