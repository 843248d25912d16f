"""The Go sampler's semantics (docs/PROTOCOL.md §5.2) on hand-made logits, and its logprobs."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from runner.generate.sampling import Sampler, SamplerOptions, log_softmax, splitmix64, top_sorted

CONTEXT = 4096


def sampler(history=(), context=CONTEXT, **options) -> Sampler:
    return Sampler(SamplerOptions(**options), context, list(history))


def values(a: mx.array) -> list[float]:
    return np.array(a.astype(mx.float32)).tolist()


def kept(s: Sampler, logits: list[float]) -> list[float]:
    """The filtered distribution over the whole vocabulary: tempered scores, -inf if removed."""
    scores, indices = s.filter(mx.array(logits))
    if indices is None:
        return values(scores)
    full = mx.full((len(logits),), -math.inf)
    return values(mx.put_along_axis(full, indices, scores, axis=-1))


def draws(s: Sampler, logits: list[float], n: int) -> list[int]:
    return [s.sample(mx.array(logits)).token.item() for _ in range(n)]


# --- penalties ------------------------------------------------------------------------------


def test_all_three_penalties_as_go_computes_them():
    """Go's TestPenaltySample: repeat 2 then presence 1.5 on each distinct token of [2, 1, 2],
    frequency 0.25 per occurrence: -2*2-1.5-0.25 = -5.75; 3/2-1.5-0.5 = -0.5."""
    s = sampler(
        [2, 1, 2], repeat_last_n=3, repeat_penalty=2, presence_penalty=1.5, frequency_penalty=0.25
    )
    assert values(s.penalise(mx.array([1.0, -2.0, 3.0, 4.0]))) == [1.0, -5.75, -0.5, 4.0]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"repeat_penalty": 2}, [1.0, -4.0, 1.5, 4.0]),  # negative times, positive divided
        ({"presence_penalty": 1}, [1.0, -3.0, 2.0, 4.0]),  # once per distinct token
        ({"frequency_penalty": 0.5}, [1.0, -2.5, 2.0, 4.0]),  # once per occurrence
        ({"repeat_penalty": 0}, [1.0, -2.0, 3.0, 4.0]),  # <= 0 means 1: nothing
        ({"repeat_penalty": -3}, [1.0, -2.0, 3.0, 4.0]),
    ],
)
def test_each_penalty_alone(options, expected):
    s = sampler([1, 2, 2], repeat_last_n=64, **options)
    assert values(s.penalise(mx.array([1.0, -2.0, 3.0, 4.0]))) == expected


def test_window_keeps_only_the_last_repeat_last_n_tokens():
    """Go's TestPenaltySampleHonorsRepeatWindow: only token 1 of [0, 1] is in a window of 1."""
    s = sampler([0, 1], repeat_last_n=1, presence_penalty=1)
    assert values(s.penalise(mx.array([1.0, 2.0, 3.0]))) == [1.0, 1.0, 3.0]


def test_repeat_last_n_zero_turns_penalties_off():
    s = sampler([0, 1], repeat_last_n=0, presence_penalty=1, repeat_penalty=2)
    assert values(s.penalise(mx.array([1.0, 2.0, 3.0]))) == [1.0, 2.0, 3.0]


def test_negative_repeat_last_n_means_the_context_length():
    s = sampler([0, 1, 2, 2], context=3, repeat_last_n=-1, frequency_penalty=1)
    assert values(s.penalise(mx.array([0.0, 0.0, 0.0]))) == [0.0, -1.0, -2.0]


def test_sampled_tokens_join_the_history_ring():
    s = sampler([0, 1, 2], repeat_last_n=3, presence_penalty=100)
    logits = [5.0, 4.0, 3.0, 2.0, 1.0]
    # greedy: 3 (0-2 are penalised); then 0, which left the ring as 3 came in; then 1
    assert draws(s, logits, 3) == [3, 0, 1]
    assert s.history.tolist() == [3, 0, 1]


def test_history_starts_with_the_first_draw_when_there_is_no_prompt():
    s = sampler([], repeat_last_n=2, presence_penalty=100)
    assert draws(s, [5.0, 4.0, 3.0], 4) == [0, 1, 2, 0]


# --- choosing -------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_of_the_penalised_scores():
    assert draws(sampler(), [1.0, 5.0, 3.0], 1) == [1]
    assert draws(sampler([1], repeat_last_n=8, repeat_penalty=10), [1.0, 5.0, 3.0], 1) == [2]
    assert draws(sampler(temperature=-1), [1.0, 5.0, 3.0], 1) == [1]


def test_temperature_divides_the_scores():
    assert kept(sampler(temperature=0.5), [1.0, -2.0, 0.5]) == [2.0, -4.0, 1.0]


def test_top_k_keeps_the_k_best():
    assert kept(sampler(temperature=1, top_k=2), [1.0, 4.0, 3.0, 2.0]) == [
        -math.inf,
        4.0,
        3.0,
        -math.inf,
    ]
    # k >= vocab or k <= 0: everything stays
    assert kept(sampler(temperature=1, top_k=4), [1.0, 4.0]) == [1.0, 4.0]
    assert draws(sampler(temperature=1, top_k=1, seed=5), [1.0, 4.0, 3.0], 20) == [1] * 20


def test_top_p_keeps_tokens_whose_preceding_mass_is_below_top_p():
    logits = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    # preceding mass: 0, 0.5, 0.8, 0.95
    assert np.isfinite(kept(sampler(temperature=1, top_p=0.7), logits)).tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert np.isfinite(kept(sampler(temperature=1, top_p=0.4), logits)).tolist() == [
        True,
        False,
        False,
        False,
    ]
    # top_p >= 1 or <= 0 is off
    assert np.isfinite(kept(sampler(temperature=1, top_p=1.0), logits)).all()


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    # 0.2 * 0.5 = 0.1: only 0.05 goes
    assert np.isfinite(kept(sampler(temperature=1, min_p=0.2), logits)).tolist() == [
        True,
        True,
        True,
        False,
    ]
    assert np.isfinite(kept(sampler(temperature=1, min_p=1.0), logits)).tolist() == [
        True,
        False,
        False,
        False,
    ]


def test_top_k_applies_before_top_p():
    """p = 0.4, 0.3 and 0.3 spread over the rest. top_p 0.5 alone keeps two tokens; after
    top_k 2 renormalises them to 0.57 and 0.43, the second one's preceding mass is 0.57."""
    logits = np.log([0.4, 0.3] + [0.3 / 8] * 8).tolist()
    assert np.isfinite(kept(sampler(temperature=1, top_p=0.5), logits)).sum() == 2
    both = kept(sampler(temperature=1, top_k=2, top_p=0.5), logits)
    assert np.isfinite(both).tolist() == [True] + [False] * 9
    assert draws(sampler(temperature=1, top_k=2, top_p=0.5, seed=1), logits, 30) == [0] * 30


def test_draws_follow_the_distribution():
    logits = np.log([0.6, 0.3, 0.1]).tolist()
    counts = np.bincount(draws(sampler(temperature=1, seed=7), logits, 3000), minlength=3)
    assert np.abs(counts / 3000 - [0.6, 0.3, 0.1]).max() < 0.04


# --- seeds ----------------------------------------------------------------------------------


def test_splitmix64_is_the_reference_generator():
    assert splitmix64(0, 0) == 0xE220A8397B1DCDAF  # splitmix64's first output from state 0
    assert splitmix64(0, 1) == 0x6E789E6AA1B965F4


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = [0.0] * 64

    def run(seed):
        return draws(sampler(temperature=1, seed=seed), logits, 20)

    assert run(0) == run(0)
    assert run(42) == run(42)
    assert run(0) != run(1)
    assert len(set(run(3))) > 1  # the key advances per draw


def test_negative_seed_is_unseeded():
    logits = [0.0] * 64
    assert draws(sampler(temperature=1, seed=-1), logits, 20) != draws(
        sampler(temperature=1, seed=-1), logits, 20
    )


# --- logprobs -------------------------------------------------------------------------------


def float64_log_softmax(logits: list[float]) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_log_softmax_matches_float64_and_is_stable():
    rng = np.random.default_rng(0)
    for scale in (1.0, 30.0, 1000.0):
        logits = (rng.normal(size=500) * scale).astype(np.float32).tolist()
        got = np.array(log_softmax(mx.array(logits)))
        want = float64_log_softmax(logits)
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, scale)
        assert abs(np.exp(want).sum() - 1) < 1e-9


def test_draw_logprobs_are_of_the_raw_logits_with_sorted_tops():
    """Penalties and temperature change the choice, never the reported logprobs."""
    logits = [2.0, 1.0, 0.5, 3.0, -1.0]
    s = sampler([3], repeat_last_n=4, repeat_penalty=100, logprobs=True, top_logprobs=3)
    draw = s.sample(mx.array(logits))
    mx.eval(*draw.arrays())
    want = float64_log_softmax(logits)
    assert draw.token.item() == 0  # 3 is penalised to 0.03
    assert draw.logprob.item() == pytest.approx(want[0], abs=1e-6)
    top = top_sorted(draw.top_ids.tolist(), draw.top_logprobs.tolist())
    assert [t for t, _ in top] == [3, 0, 1]
    assert [lp for _, lp in top] == pytest.approx(want[[3, 0, 1]].tolist(), abs=1e-6)


def test_top_logprobs_only_with_logprobs_and_capped_at_the_vocabulary():
    draw = sampler(top_logprobs=3).sample(mx.array([1.0, 2.0]))
    assert draw.logprob is None and draw.top_ids is None
    draw = sampler(logprobs=True, top_logprobs=10).sample(mx.array([1.0, 2.0]))
    assert sorted(draw.top_ids.tolist()) == [0, 1]
    draw = sampler(logprobs=True).sample(mx.array([1.0, 2.0]))
    assert draw.logprob is not None and draw.top_ids is None
