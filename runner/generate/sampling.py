"""The Go runner's sampler (docs/PROTOCOL.md §5.2) and its logprobs (§5.4), as lazy MLX graphs.

Per draw, on one row of logits:
1. penalties over the last `repeat_last_n` tokens of the history (prompt tail, then every
   sampled token): repeat (each distinct token: a negative logit times the penalty, another
   divided by it), presence (subtracted once per distinct token), frequency (subtracted once
   per occurrence);
2. temperature <= 0: argmax of the penalised scores;
3. otherwise top_k (0 < k < vocab) keeps the k best, scores are divided by the temperature,
   top_p in (0, 1) keeps the tokens whose *preceding* cumulative probability is < top_p,
   min_p in (0, 1] drops the tokens with p < max_p * min_p, and a categorical draw picks one.

Everything stays lazy (the history included), so the pipeline can dispatch the next forward
before the host has read the current token. Draws are reproducible: seed >= 0 keys draw n with
splitmix64(seed, n); an unseeded request picks a random seed once.

Logprobs are the float32 log-softmax of the raw logits, before penalties and temperature.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

_MASK64 = (1 << 64) - 1


def splitmix64(seed: int, counter: int) -> int:
    """The counter-th output of a splitmix64 stream started at `seed`."""
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class SamplerOptions:
    """The request's sampling options, zero values as Go decodes a missing key."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    repeat_last_n: int = 0
    repeat_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0  # >= 0: seeded (Go's UseSeed); < 0: a fresh random seed per request
    logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def from_options(cls, options: Any, logprobs: bool = False, top_logprobs: int = 0):
        """From wire `Options` (or anything with the same attribute names)."""
        return cls(
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            min_p=options.min_p,
            repeat_last_n=options.repeat_last_n,
            repeat_penalty=options.repeat_penalty,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            seed=options.seed,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )


@dataclass
class Draw:
    """One lazy draw: the token, and (when asked for) its logprob and the top logprobs. The
    token is an int where the host chose it (`Sampler.argmax_alone`)."""

    token: mx.array | int  # int32 scalar
    logprob: mx.array | None = None  # float32 scalar
    top_ids: mx.array | None = None  # int32 [n], unsorted
    top_logprobs: mx.array | None = None  # float32 [n], aligned with top_ids

    def arrays(self) -> list[mx.array]:
        items = (self.token, self.logprob, self.top_ids, self.top_logprobs)
        return [a for a in items if isinstance(a, mx.array)]

    def token_id(self) -> int:
        """The token, waiting for it where it is still being computed."""
        return self.token if isinstance(self.token, int) else int(self.token.item())  # type: ignore[arg-type]


class Sampler:
    """Samples one request's tokens; call on the MLX thread. `history` seeds the penalty
    window (the prompt); every token drawn joins it."""

    def __init__(self, options: SamplerOptions, context_length: int, history: list[int]):
        self.options = options
        self.repeat_penalty = options.repeat_penalty if options.repeat_penalty > 0 else 1.0
        # < 0: the whole context, as Go; more than the context is the context (Go would
        # allocate a ring of that size and fail).
        window = min(options.repeat_last_n, context_length)
        window = window if window >= 0 else context_length
        penalised = (
            self.repeat_penalty != 1
            or options.presence_penalty != 0
            or options.frequency_penalty != 0
        )
        self.window = window if penalised else 0
        self.history: mx.array | None = None
        if self.window > 0 and history:
            self.history = mx.array(history[-self.window :], dtype=mx.int32)
        self.seed = options.seed if options.seed >= 0 else secrets.randbits(63)
        self.draws = 0

    @property
    def argmax_alone(self) -> bool:
        """Whether a draw is the argmax of the raw logits and nothing else: no temperature,
        no penalty, no logprobs (then the first of equal maxima, as MLX's and numpy's argmax
        both choose, NaN counting as the largest)."""
        return self.options.temperature <= 0 and self.window == 0 and not self.options.logprobs

    def penalise(self, logits: mx.array) -> mx.array:
        """Step 1 on a [V] row (returned unchanged when no penalty applies)."""
        if self.history is None:
            return logits
        o = self.options
        counts = mx.zeros(logits.shape, mx.float32).at[self.history].add(1.0)
        present = counts > 0
        if self.repeat_penalty != 1:
            rp = self.repeat_penalty
            penalised = mx.where(logits < 0, logits * rp, logits / rp)
            logits = mx.where(present, penalised, logits)
        if o.presence_penalty != 0:
            logits = logits - o.presence_penalty * present.astype(logits.dtype)
        if o.frequency_penalty != 0:
            logits = logits - o.frequency_penalty * counts.astype(logits.dtype)
        return logits

    def choose(self, scores: mx.array) -> mx.array:
        """Steps 2-3 on penalised [V] scores: the token id (int32 scalar)."""
        if self.options.temperature <= 0:
            return mx.argmax(scores, axis=-1).astype(mx.int32)
        candidates, indices = self.filter(scores)
        key = mx.random.key(splitmix64(self.seed, self.draws))
        self.draws += 1
        choice = mx.random.categorical(candidates, axis=-1, key=key)
        if indices is not None:
            choice = indices[choice]
        return choice.astype(mx.int32)

    def filter(self, scores: mx.array) -> tuple[mx.array, mx.array | None]:
        """Step 3 but the draw: the candidates' tempered scores, -inf where top_p or min_p
        removed one, and the candidates' ids (None: the whole vocabulary, in order)."""
        o = self.options
        indices = None
        if 0 < o.top_k < scores.shape[-1]:
            indices = mx.argpartition(-scores, kth=o.top_k - 1, axis=-1)[: o.top_k]
            scores = scores[indices]
        scores = scores / o.temperature
        top_p, min_p = 0 < o.top_p < 1, 0 < o.min_p <= 1
        if not (top_p or min_p):
            return scores, indices
        order = mx.argsort(-scores, axis=-1)
        probs = mx.softmax(scores, axis=-1, precise=True)[order]
        remove = mx.zeros(probs.shape, mx.bool_)
        if top_p:  # keep while the probability mass *before* a token is under top_p
            remove = remove | (mx.cumsum(probs, axis=-1) - probs >= o.top_p)
        if min_p:
            remove = remove | (probs < probs[0] * o.min_p)
        removed = mx.where(remove, -math.inf, scores[order])
        return mx.put_along_axis(scores, order, removed, axis=-1), indices

    def sample(self, logits: mx.array) -> Draw:
        """Draw from a [V] row of raw logits and append the draw to the history."""
        logits = logits.astype(mx.float32)
        token = self.choose(self.penalise(logits))
        if self.window > 0:
            joined = (
                token[None] if self.history is None else mx.concatenate([self.history, token[None]])
            )
            self.history = joined[-self.window :]
        draw = Draw(token)
        if self.options.logprobs:
            logprobs = log_softmax(logits)
            draw.logprob = logprobs[token]
            n = min(self.options.top_logprobs, logits.shape[-1])
            if n > 0:
                draw.top_ids = mx.argpartition(-logprobs, kth=n - 1, axis=-1)[:n]
                draw.top_logprobs = logprobs[draw.top_ids]
        return draw


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def top_sorted(ids: list[int], logprobs: list[float]) -> list[tuple[int, float]]:
    """Top logprobs arrive unsorted (argpartition); the wire lists them best first."""
    return sorted(zip(ids, logprobs, strict=True), key=lambda p: -p[1])
