"""The named workloads: what is scored or generated, at each size, as seeded text.

Every prompt has an exact token length under the benchmark model's tokenizer (bench/text.py).
Candidates are the listed answers that are one token under that tokenizer (all of them under
the bench tokenizer; a real model's may split one, e.g. SmolLM2's " Unsure"). Sizes are the
parameters below; `--size small` uses the second set, and `--param NAME.KEY=VALUE` replaces
one (e.g. `--param decisions.rows=16`).

- decisions: one request of `rows` rows; each row is a `prefix`-token few-shot block shared by
  all rows plus its own `question`-token question; candidates " Yes" " No" " Maybe" " Unsure".
- choices: one request of `rows` unrelated `prompt`-token prompts; candidates " A" .. " Z".
- families: `requests` requests in a row sharing one `system`-token system prompt, `rows` rows
  each (every question distinct); candidates " Yes" " No".
- generate: a `prompt`-token prompt ending in the start of a count, then `new_tokens` greedy
  tokens (a real model goes on counting instead of stopping early).
- requests ("decision requests"): `rows` requests of one row each, sent in sequence as a
  supervisor asks per decision, sharing one `system`-token system prompt, each with its own
  `question`-token question; candidates " Yes" " No". What counts is each request's latency:
  the first stores the system prompt, the rest reuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bench.text import DECISION_ANSWERS, LETTERS, TextMaker

# Appended in order: a workload's text is seeded by its index here.
NAMES = ("decisions", "choices", "families", "generate", "requests")

SIZES: dict[str, dict[str, dict[str, int]]] = {
    "decisions": {
        "default": {"rows": 64, "prefix": 512, "question": 16},
        "small": {"rows": 8, "prefix": 64, "question": 12},
    },
    "choices": {
        "default": {"rows": 64, "prompt": 256},
        "small": {"rows": 8, "prompt": 64},
    },
    "families": {
        "default": {"requests": 20, "rows": 8, "system": 1024, "question": 16},
        "small": {"requests": 3, "rows": 4, "system": 96, "question": 12},
    },
    "generate": {
        "default": {"prompt": 512, "new_tokens": 128},
        "small": {"prompt": 48, "new_tokens": 8},
    },
    "requests": {
        "default": {"rows": 32, "system": 480, "question": 18, "systems": 1},
        "small": {"rows": 6, "system": 64, "question": 12, "systems": 1},
    },
}

QUESTION_HEAD = "\nQuestion:"
ANSWER_TAIL = "?\nAnswer:"


@dataclass(frozen=True)
class Row:
    prompt: str
    candidates: tuple[str, ...]
    tokens: int  # prompt tokens under the benchmark tokenizer


@dataclass
class ScoreWorkload:
    name: str
    params: dict[str, int]
    requests: list[list[Row]]
    # Each request's latency is the measure (first request apart), not only the total.
    latency: bool = False
    kind: str = field(default="score", init=False)

    @property
    def rows(self) -> list[Row]:
        return [row for request in self.requests for row in request]

    @property
    def prompt_tokens(self) -> int:
        return sum(row.tokens for row in self.rows)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


@dataclass
class GenerateWorkload:
    name: str
    params: dict[str, int]
    prompt: str
    prompt_tokens: int
    new_tokens: int
    kind: str = field(default="generate", init=False)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


Workload = ScoreWorkload | GenerateWorkload


def _few_shot(maker: TextMaker, tokens: int) -> str:
    """Question/answer examples, then filler words, exactly `tokens` tokens."""
    parts = ["Answer each question with Yes, No, Maybe or Unsure.\n"]
    used = len(maker.encode(parts[0]))
    while True:
        example = QUESTION_HEAD + maker.words(8) + ANSWER_TAIL + maker.rng.choice(DECISION_ANSWERS)
        cost = len(maker.encode(example))
        if used + cost > tokens - 1:
            break
        parts.append(example)
        used += cost
    parts.append(maker.words(tokens - used))
    text = "".join(parts)
    assert len(maker.encode(text)) == tokens
    return text


def _question(maker: TextMaker, tokens: int) -> str:
    return maker.exact(tokens, head=QUESTION_HEAD, tail=ANSWER_TAIL)


def decisions(maker: TextMaker, rows: int, prefix: int, question: int) -> ScoreWorkload:
    shared = _few_shot(maker, prefix)
    answers = maker.single_tokens(DECISION_ANSWERS)
    batch = [
        Row(shared + _question(maker, question), answers, prefix + question) for _ in range(rows)
    ]
    params = {"rows": rows, "prefix": prefix, "question": question}
    return ScoreWorkload("decisions", params, [batch])


def choices(maker: TextMaker, rows: int, prompt: int) -> ScoreWorkload:
    tail = "\nOptions:" + "".join(LETTERS) + "\nAnswer:"
    letters = maker.single_tokens(LETTERS)
    batch = [Row(maker.exact(prompt, tail=tail), letters, prompt) for _ in range(rows)]
    return ScoreWorkload("choices", {"rows": rows, "prompt": prompt}, [batch])


def families(
    maker: TextMaker, requests: int, rows: int, system: int, question: int
) -> ScoreWorkload:
    shared = maker.exact(system, head="System:")
    answers = maker.single_tokens(DECISION_ANSWERS[:2])
    batches = [
        [Row(shared + _question(maker, question), answers, system + question) for _ in range(rows)]
        for _ in range(requests)
    ]
    params = {"requests": requests, "rows": rows, "system": system, "question": question}
    return ScoreWorkload("families", params, batches)


# A real model continues a count for hundreds of tokens, so every system decodes the whole
# budget (after "Answer:" SmolLM2 stops after 8 tokens, and decode rates over 8 tokens mean
# little); random-weight models never stop anyway.
COUNT_TAIL = "\nCount to 1000: 1, 2, 3, 4,"


def generate(maker: TextMaker, prompt: int, new_tokens: int) -> GenerateWorkload:
    text = maker.exact(prompt, tail=COUNT_TAIL)
    params = {"prompt": prompt, "new_tokens": new_tokens}
    return GenerateWorkload("generate", params, text, prompt, new_tokens)


def decision_requests(
    maker: TextMaker, rows: int, system: int, question: int, systems: int = 1
) -> ScoreWorkload:
    """Decision rows sent one request at a time, over `systems` system prompts in turn (row i
    under prompt i % systems): with more than one, each request's prompt is paged in from a
    prefix cache rather than continued from the one before."""
    shared = [maker.exact(system, head="System:") for _ in range(systems)]
    answers = maker.single_tokens(DECISION_ANSWERS[:2])
    one_each = [
        [Row(shared[i % systems] + _question(maker, question), answers, system + question)]
        for i in range(rows)
    ]
    params = {"rows": rows, "system": system, "question": question, "systems": systems}
    return ScoreWorkload("requests", params, one_each, latency=True)


BUILDERS: dict[str, Callable[..., Workload]] = {
    "decisions": decisions,
    "choices": choices,
    "families": families,
    "generate": generate,
    "requests": decision_requests,
}


class Variants:
    """One named workload at one size, in seeded variants of the same shape: variant 0 is the
    warm-up, variant k the k-th trial. Fresh text per trial keeps a prefix cache from serving
    a trial with what an earlier trial (or another system) stored; every system gets the same
    text for the same variant, so their answers can be compared."""

    def __init__(
        self,
        name: str,
        size: str,
        encode: Callable[[str], list[int]],
        seed: int,
        overrides: dict[str, int] | None = None,
    ):
        if name not in BUILDERS:
            raise ValueError(f"unknown workload {name!r} (known: {', '.join(NAMES)})")
        unknown = set(overrides or {}) - set(SIZES[name][size])
        if unknown:
            raise ValueError(f"{name} has no parameter {', '.join(sorted(unknown))}")
        self.name = name
        self.params = {**SIZES[name][size], **(overrides or {})}
        self.encode = encode
        self.seed = seed
        self._built: dict[int, Workload] = {}

    def get(self, variant: int) -> Workload:
        if variant not in self._built:
            maker = TextMaker(
                self.encode, (self.seed * 100 + NAMES.index(self.name)) * 1000 + variant
            )
            self._built[variant] = BUILDERS[self.name](maker, **self.params)
        return self._built[variant]

    @property
    def kind(self) -> str:
        return self.get(1).kind


def build_workloads(
    names: list[str],
    size: str,
    encode: Callable[[str], list[int]],
    seed: int = 0,
    overrides: dict[str, dict[str, int]] | None = None,
) -> list[Variants]:
    """The named workloads at `size` (parameters replaced by `overrides[name]`); text
    depends only on (seed, name, parameters, variant)."""
    overrides = overrides or {}
    unknown = set(overrides) - set(names)
    if unknown:
        raise ValueError(f"parameters given for workloads not run: {', '.join(sorted(unknown))}")
    return [Variants(name, size, encode, seed, overrides.get(name)) for name in names]
