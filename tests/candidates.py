"""Candidates for scoring tests, and the reference path their logits are checked against."""

from __future__ import annotations

import mlx.core as mx


def single_token_candidates(tokenizer, prompt: str, count: int) -> list[str]:
    """Candidates that each append exactly one ordinary token to `prompt`."""
    base = tokenizer.encode(prompt)
    found: list[str] = []
    for word in [
        " the",
        " a",
        " is",
        " Yes",
        " No",
        " sky",
        " blue",
        " A",
        " B",
        " C",
        " D",
        " x",
        " y",
        " z",
        " e",
        " o",
        " i",
        " t",
        " s",
        " n",
        " r",
        " h",
        " l",
        " d",
        " c",
        " u",
        " m",
        " f",
        " p",
        " g",
        " w",
        " b",
        " k",
        " v",
    ]:
        joined = tokenizer.encode(prompt + word)
        if len(joined) == len(base) + 1 and joined[: len(base)] == base and word not in found:
            ids = [tokenizer.encode(prompt + f)[-1] for f in found]
            if joined[-1] not in ids:
                found.append(word)
        if len(found) == count:
            return found
    raise AssertionError(f"tiny tokenizer has fewer than {count} single-token candidates")


def full_vocab_logits(engine, runner, tokens, ids):
    """The reference path: one-shot forward, full-vocabulary unembed, then pick the ids."""

    def work(job):
        caches = runner.model.make_caches()
        hidden = runner.model.hidden(mx.array(tokens)[None], caches)
        logits = runner.model.unembed(hidden[0, -1:, :]).astype(mx.float32)
        return logits[0, mx.array(ids)].tolist()

    return engine.call(work)
