"""Prompt logprobs (runner/score/loglikelihood.py): equal to /v1/score's logits through a
log-softmax, cached = uncached, batched = one by one, top-k the full row's best."""

from __future__ import annotations

import numpy as np
import pytest

from runner.score.loglikelihood import Loglikelihoods, digests
from runner.score.validate import Row

ARCHS = ["LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3_5ForCausalLM", "Glm4MoeLiteForCausalLM"]
TOL = 2e-5


def _never() -> None:
    pass


def _compute(runner, prompts, starts=None, top=1, want_next=False):
    ll = getattr(runner, "_test_ll", None)
    if ll is None:
        ll = runner._test_ll = Loglikelihoods(runner.model, runner.score_cache)
    starts = starts or [1] * len(prompts)
    return runner.engine.call(lambda job: ll.compute(prompts, starts, top, want_next, job.check))


def _reference(runner, tokens):
    """Every position's log-softmax over the whole vocabulary, from /v1/score's scorer:
    each prefix scored with every id as a candidate, then a float64 log-softmax."""
    vocab = runner.model.vocab_size
    rows = [Row(tokens[:j], list(range(vocab))) for j in range(1, len(tokens) + 1)]
    result = runner.engine.call(lambda job: runner.scorer.score(rows, job.check))
    logits = np.array(result.logits, dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    return logits - (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))


def _prompts(runner):
    """Choices after one context, then two questions' choices after it (groups that share
    more than the context: each batched over its own question)."""
    enc = runner.tokenizer.encode
    context = enc("The quick brown fox jumps over the lazy dog. Is the sky blue?")
    choices = [context + enc(c) for c in (" Yes.", " No, it is green.", " A", " the cat sat")]
    questions = [context + enc(q) for q in (" Is grass red? Answer:", " Who sat? Answer:")]
    return choices + [q + enc(c) for q in questions for c in (" the cat", " a dog, No.")]


@pytest.mark.parametrize("arch", ARCHS)
def test_equal_to_score_through_log_softmax(fresh_runner, arch):
    runner = fresh_runner(arch)
    tokens = _prompts(runner)[1]
    reference = _reference(fresh_runner(arch), tokens)
    (answer,) = _compute(runner, [tokens], top=5, want_next=True)
    assert answer.positions[0] is None
    for j in range(1, len(tokens)):
        position = answer.positions[j]
        assert position is not None
        assert position.logprob == pytest.approx(reference[j - 1, tokens[j]], abs=TOL)
        best = np.argsort(-reference[j - 1], kind="stable")[:5]
        assert [t for t, _ in position.top] == best.tolist()
        for t, lp in position.top:
            assert lp == pytest.approx(reference[j - 1, t], abs=TOL)
    assert answer.next_logits is not None
    next_row = np.array(answer.next_logits.tolist(), dtype=np.float64)
    next_row -= next_row.max() + np.log(np.exp(next_row - next_row.max()).sum())
    np.testing.assert_allclose(next_row, reference[-1], atol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_equals_uncached_and_batched_equals_alone(fresh_runner, arch, monkeypatch):
    from runner.cache.session import PrefixSession

    batches = []
    original = PrefixSession.forward_rows

    def counted(self, suffixes, *args, **kwargs):
        batches.append(len(suffixes))
        return original(self, suffixes, *args, **kwargs)

    monkeypatch.setattr(PrefixSession, "forward_rows", counted)
    runner = fresh_runner(arch)
    prompts = _prompts(runner)
    batched = _compute(runner, prompts, top=3)  # one call: each question's choices batched
    assert batches == ([2, 2] if runner._test_ll.batches else [])
    again = _compute(runner, prompts, top=3)  # every position from the cache
    alone = [_compute(fresh_runner(arch), [p], top=3)[0] for p in prompts]
    for b, a, one in zip(batched, again, alone, strict=True):
        assert a.positions == b.positions  # the cache returns what was computed
        for x, y in zip(b.positions[1:], one.positions[1:], strict=True):
            assert x is not None and y is not None
            assert x.logprob == pytest.approx(y.logprob, abs=TOL)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_positions_seen_are_not_recomputed(fresh_runner):
    runner = fresh_runner()
    prompts = _prompts(runner)
    _compute(runner, prompts[:1])
    ll = runner._test_ll
    cached = len(ll.positions)
    assert cached == len(prompts[0]) - 1
    _compute(runner, prompts[1:2])  # the context's positions come from the cache
    context = 0
    while prompts[0][context] == prompts[1][context]:
        context += 1
    assert len(ll.positions) == cached + len(prompts[1]) - context
    # a larger top-k than stored recomputes, and keeps the larger
    (answer,) = _compute(runner, prompts[:1], top=4)
    assert all(len(p.top) == 4 for p in answer.positions[1:] if p is not None)


def test_start_skips_the_head_before_it(fresh_runner):
    runner = fresh_runner()
    tokens = _prompts(runner)[0]
    (answer,) = _compute(runner, [tokens], starts=[len(tokens) - 2])
    assert all(p is None for p in answer.positions[: len(tokens) - 2])
    assert all(p is not None for p in answer.positions[len(tokens) - 2 :])
    assert len(runner._test_ll.positions) == 2


def test_digests_name_prefixes():
    a, b = digests([1, 2, 3]), digests([1, 2, 4])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert len(set(digests(list(range(1000))))) == 1000
