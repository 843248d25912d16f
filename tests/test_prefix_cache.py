"""The prefix cache over fake caches that carry real token lists (the Go runner's prefix-cache
tests in spirit).

Each test names the invariant of runner/cache/prefix_cache.py it checks. `generate` runs a
request the way the completions pipeline does (prefill all but the last prompt token, then
feed the seed and the generated tokens one by one); `score` the way scoring does (feed every
prompt token, keep hidden rows).
"""

from __future__ import annotations

import itertools
import random

import pytest

from runner.cache import trie
from runner.cache.prefix_cache import ByteBudget, PrefixCache
from runner.protocol.errors import Cancelled
from tests.fakes import LAYOUTS, FakeModel, Tracker
from tests.tiny import prefix_cache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make(layout: str, *, hidden=False, limit=1 << 40, interval=8192, chunk=3, defer=False):
    tracker = Tracker()
    model = FakeModel(layout, tracker)
    pc = prefix_cache(
        model,
        name="test",
        budget=ByteBudget(limit),
        keep_hidden=hidden,
        interval=interval,
        chunk_tokens=chunk,
        defer_stores=defer,
        clock=Clock(),
    )
    return pc, tracker


def check(pc: PrefixCache, tracker: Tracker) -> None:
    trie.check_invariants(pc.root)
    edge_slots = [i for i, k in enumerate(pc.kinds) if not k.point]
    point_slots = [i for i, k in enumerate(pc.kinds) if k.point]
    stored = []
    total = 0
    for node in trie.walk(pc.root):
        for i in edge_slots:  # invariant 2: edge kinds span exactly the node's edge
            snap = node.snapshots[i]
            assert snap is not None and (snap.start, snap.end) == (node.start, node.end)
        for i in point_slots:  # ...point kinds describe the state at the node's end
            snap = node.snapshots[i]
            assert snap is None or snap.end == node.end
        stored += [
            s for i, s in enumerate(node.snapshots) if s is not None and i < len(pc.live.caches)
        ]
        total += sum(s.nbytes for s in node.snapshots if s is not None)
    assert total == pc.nbytes  # invariant 6
    tracker.check(stored)
    for cache in pc.live.caches:  # invariant 1: live caches hold exactly live_tokens
        assert cache.tokens == pc.live.tokens


def generate(pc, inputs, generated=(), schedule=()):
    session = pc.begin(list(inputs), schedule)
    for cache in pc.live.caches:
        assert cache.tokens == list(inputs[: session.offset])
    assert session.offset <= len(inputs) - 1  # invariant 3
    if session.offset < len(inputs) - 1:
        session.prefill(len(inputs) - 1, lambda: None)
    fed = [inputs[-1], *generated[:-1]]
    for token in fed:
        session.decode(token)
    session.close()
    return session


def score(pc, inputs, schedule=()):
    session = pc.begin(list(inputs), schedule)
    try:
        if session.hidden_row is not None:
            row = session.hidden_row
        else:
            for cache in pc.live.caches:
                assert cache.tokens == list(inputs[: session.offset])
            row = session.prefill(len(inputs), lambda: None)
        assert row.reshape(-1).tolist() == [float(inputs[-1])]  # the last position's row
    finally:
        session.close()
    return session


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


def test_branch_creation_and_reuse(layout):
    pc, tracker = make(layout)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert generate(pc, a, [20, 21]).offset == 0
    assert pc.live.tokens == [*a, 20]
    check(pc, tracker)
    b = [1, 2, 3, 4, 5, 10, 11, 12]
    s = generate(pc, b, [30])
    if layout == "kv":
        assert s.offset == 5  # any offset is restorable
    else:
        assert s.offset == 0  # no whole-state snapshot at 5 yet: recompute, capture there
    check(pc, tracker)
    # Both branches are stored, and the branch point now has every state.
    assert trie.match(pc.root, a)[1] == 8 and trie.match(pc.root, b)[1] == 8
    c = [1, 2, 3, 4, 5, 40]
    assert generate(pc, c).offset == 5
    check(pc, tracker)
    # Extending a: the stored path a + gen resumes where a's request ended.
    assert generate(pc, [*a, 20, 21, 22]).offset == 9
    check(pc, tracker)


def test_exact_repeat_recomputes_only_the_seed_token(layout):
    pc, tracker = make(layout)
    prompt = [5, 6, 7, 8, 9]
    generate(pc, prompt, [1])
    s = generate(pc, prompt, [1])
    if layout == "kv":
        assert s.offset == 4
    else:
        assert s.offset == 0  # the first run stored states at 0 and at 5 only
        assert generate(pc, prompt, [1]).offset == 4  # ...the second one captured at 4
    check(pc, tracker)


def test_conversation_resumption_keeps_whole_turns(layout):
    pc, tracker = make(layout)
    turn1 = [1, 2, 3, 4, 5]
    generate(pc, turn1, [6, 7, 8])
    turn2 = [*turn1, 6, 7, 8, 9, 10]
    s = generate(pc, turn2, [11, 12])
    assert s.offset == 7  # everything the caches held: turn1 + all but the last generated
    turn3 = [*turn2, 11, 12, 13]
    assert generate(pc, turn3, [14]).offset == 11
    check(pc, tracker)


def test_switching_branches_restores_the_right_content(layout):
    pc, tracker = make(layout)
    a = [1, 2, 3, 4, 5, 6, 7]
    b = [1, 2, 3, 4, 9, 9, 9]
    generate(pc, a, [50, 51])
    generate(pc, b, [60])
    generate(pc, b, [60])
    s = generate(pc, [*a, 50, 51, 52], [70])  # back to a: caches must hold a's tokens
    assert s.offset == 8
    check(pc, tracker)


def test_user_snapshot_is_an_exact_restore_point(layout):
    pc, tracker = make(layout)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    generate(pc, a, [9], schedule=[4])
    s = generate(pc, [1, 2, 3, 4, 20, 21], [22])
    assert s.offset == 4
    node = trie.match(pc.root, [1, 2, 3, 4])[0][-1]
    assert node.end == 4
    check(pc, tracker)


def test_schedule_beyond_what_was_fed_creates_no_node(layout):
    pc, tracker = make(layout)
    session = pc.begin([1, 2, 3, 4, 5, 6], [3, 6])
    session.prefill(5, lambda: None)  # a prefill that stops before the last token
    session.close()
    ends = sorted(n.end for n in trie.walk(pc.root))
    assert ends[-1] == 5 and 3 in ends  # invariant 4: nothing claims offset 6
    check(pc, tracker)


def test_cancelled_prefill_keeps_crossed_snapshots_and_resumes(layout):
    pc, tracker = make(layout, chunk=3)
    prompt = list(range(100, 120))
    calls = itertools.count()

    def cancel_after_two_chunks():
        if next(calls) == 2:
            raise Cancelled()

    session = pc.begin(prompt, [5])
    with pytest.raises(Cancelled):
        session.prefill(len(prompt) - 1, cancel_after_two_chunks)
    session.close()
    assert pc.live.tokens == prompt[:5]  # chunks of 3, cut at the scheduled 5: [0,3), [3,5)
    check(pc, tracker)
    retry = generate(pc, prompt, [1])
    assert retry.offset == 5  # invariant 5: the retry resumes exactly where it stopped
    check(pc, tracker)


def test_failed_forward_adds_no_node_and_empties_the_live_caches(layout):
    pc, tracker = make(layout, chunk=4)
    generate(pc, [1, 2, 3, 4, 5], [6])
    nodes = sorted((n.start, n.end) for n in trie.walk(pc.root))
    session = pc.begin([1, 2, 3, 7, 8, 9, 10, 11, 12])
    pc.model.fail_next = True
    with pytest.raises(RuntimeError, match="half way"):
        session.prefill(8, lambda: None)
    session.close()
    assert pc.live.tokens == []
    assert all(c.tokens == [] for c in pc.live.caches)
    # Only a split of the existing path may differ; no node covers the failed tokens.
    assert all(end <= 6 for _, end in sorted((n.start, n.end) for n in trie.walk(pc.root)))
    assert {e for _, e in nodes} <= {n.end for n in trie.walk(pc.root)}
    check(pc, tracker)
    assert generate(pc, [1, 2, 3, 7, 8, 9], [1]).offset in (0, 3)


def test_full_hit_reuses_the_stored_hidden_row(layout):
    pc, tracker = make(layout, hidden=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert score(pc, prompt).offset == 0
    forwards = len(pc.model.forwards)
    s = score(pc, prompt)
    assert s.offset == len(prompt) and s.hidden_row is not None
    assert len(pc.model.forwards) == forwards  # nothing computed
    # A prefix of a stored prompt is a full hit too (its row is inside an edge).
    s = score(pc, prompt[:5])
    assert s.offset == 5 and len(pc.model.forwards) == forwards
    check(pc, tracker)


def test_rows_shared_prefix_restores_exactly(layout):
    pc, tracker = make(layout, hidden=True)
    shared = [7, 7, 7, 7, 7, 7]
    rows = [[*shared, 1, 2], [*shared, 3, 4, 5], [*shared, 6]]
    offsets = [score(pc, r, schedule=[len(shared)]).offset for r in rows]
    assert offsets == [0, 6, 6]
    check(pc, tracker)


def test_sliding_window_that_wrapped_restores_only_at_node_ends():
    pc, tracker = make("window")
    long = list(range(1, 12))  # 10 tokens fed: the window of 4 wrapped
    generate(pc, long, [50], schedule=[7])
    s = generate(pc, [*long[:9], 99, 98], [1])  # diverges at 9: no window state there
    assert s.offset == 7  # the latest window snapshot at or below the branch point
    check(pc, tracker)


def test_recurrent_restores_only_at_exact_offsets():
    pc, tracker = make("recurrent")
    generate(pc, list(range(1, 21)), [7], schedule=[10])
    s = generate(pc, [*range(1, 16), 99], [1])
    assert s.offset == 10
    check(pc, tracker)


def test_periodic_snapshots_every_interval(layout):
    pc, tracker = make(layout, interval=4)
    generate(pc, list(range(1, 15)), [1])
    ends = {n.end for n in trie.walk(pc.root)}
    assert {4, 8, 12} <= ends
    check(pc, tracker)


def test_eviction_keeps_the_budget_the_active_path_and_branch_points(layout):
    pc, tracker = make(layout)
    system = [1, 2, 3, 4, 5]
    for i in range(5):
        generate(pc, [*system, 100 + i, 200 + i, 300 + i], [400 + i], schedule=[5])
        check(pc, tracker)
    pc.budget.limit = pc.nbytes // 3
    pc.evict()
    check(pc, tracker)
    assert pc.nbytes <= pc.budget.limit or all(
        id(n) in {id(a) for a in trie.match(pc.root, pc.live.tokens)[0]} or len(n.children) > 1
        for n in trie.walk(pc.root)
    )
    active = trie.match(pc.root, pc.live.tokens)[0]
    assert len(active) >= 2 and active[-1].end == len(pc.live.tokens)
    assert trie.match(pc.root, system)[1] == 5  # the shared system prompt (a branch point)


def leaf(pc, tokens):
    path, matched = trie.match(pc.root, tokens)
    return path[-1] if matched == len(tokens) and path[-1].end == len(tokens) else None


@pytest.mark.parametrize("rule", ["oldest", "deepest", "largest"])
def test_eviction_order_oldest_then_deepest_then_largest(rule):
    pc, tracker = make("kv")
    a, b = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10] if rule == "largest" else [5, 6, 7, 8]
    if rule == "deepest":
        generate(pc, [9], [1])  # b hangs below a shared node, so it is deeper
        b = [9, 1, 5, 6, 7]
    generate(pc, a, [1])
    generate(pc, b, [1])
    generate(pc, [42, 43], [1])  # the active path
    na, nb = leaf(pc, a), leaf(pc, b)
    if rule != "oldest":
        na.last_used = nb.last_used = 0.0
    expected_victim = na if rule == "oldest" else nb
    pc.budget.limit = pc.nbytes - 1  # one victim is enough
    pc.evict()
    survivors = list(trie.walk(pc.root))
    assert expected_victim not in survivors
    assert (nb if expected_victim is na else na) in survivors
    check(pc, tracker)


def test_eviction_merges_a_single_child_node_into_its_child():
    pc, tracker = make("recurrent")  # merging frees the parent's whole-state snapshot
    generate(pc, [1, 2, 3, 4, 5, 6], [1], schedule=[3])
    generate(pc, [9, 9], [1])
    parent = trie.match(pc.root, [1, 2, 3])[0][-1]
    assert parent.end == 3 and len(parent.children) == 1
    (child,) = parent.children.values()
    parent.last_used = -1.0  # the oldest candidate
    pc.budget.limit = pc.nbytes - 1
    pc.evict()
    merged = trie.match(pc.root, [1, 2, 3, 4, 5, 6])[0]
    assert [n.end for n in merged[1:]] == [6] and merged[-1] is child
    assert child.snapshots[0].extra[0] == (1, 2, 3, 4, 5, 6)
    check(pc, tracker)


def test_two_caches_share_one_budget_and_evict_only_their_own():
    tracker = Tracker()
    budget = ByteBudget(1 << 40)
    score_cache = prefix_cache(
        FakeModel("kv", tracker), name="score", budget=budget, keep_hidden=True, clock=Clock()
    )
    gen_cache = prefix_cache(
        FakeModel("kv", tracker), name="generate", budget=budget, clock=Clock()
    )
    score(score_cache, [1, 2, 3, 4])
    score(score_cache, [5, 6, 7, 8])
    generate(gen_cache, [1, 2, 3, 4, 5, 6, 7, 8], [9])
    assert budget.used == score_cache.nbytes + gen_cache.nbytes
    gen_nodes = list(trie.walk(gen_cache.root))
    budget.limit = budget.used - 1
    score_cache.evict()  # scoring is over budget: it gives up its own entries only
    assert list(trie.walk(gen_cache.root)) == gen_nodes
    assert budget.used <= budget.limit


def test_lru_touches_only_the_used_nodes(layout):
    pc, tracker = make(layout)
    base = list(range(1, 13))
    generate(pc, base, [1], schedule=[4, 8])
    before = {(n.start, n.end): n.last_used for n in trie.walk(pc.root)}
    s = generate(pc, [*base[:10], 77], [1])
    after = {(n.start, n.end): n.last_used for n in trie.walk(pc.root)}
    changed = {k for k in before if k in after and after[k] != before[k]}
    # The node the restore landed in may be refreshed; the nodes merely crossed are not.
    crossed = {k for k in before if k[1] <= s.offset}
    assert not (changed & {k for k in crossed if k[1] < s.offset})
    check(pc, tracker)


def test_random_requests_match_a_brute_force_oracle(layout):
    """Which prefix is restorable, against an oracle that remembers every stored state."""
    rng = random.Random(1234 + len(layout))
    pc, tracker = make(layout, chunk=3)
    point = layout != "kv"
    stored_states: set[tuple[int, ...]] = set()  # prefixes whose whole state was captured
    fed_sequences: list[list[int]] = []
    for _ in range(60):
        base = rng.choice(fed_sequences) if fed_sequences and rng.random() < 0.7 else []
        keep = rng.randint(0, len(base))
        prompt = base[:keep] + [rng.randint(1, 3) for _ in range(rng.randint(1, 6))]
        generated = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
        schedule = [rng.randint(1, len(prompt))] if rng.random() < 0.3 else []
        target = len(prompt) - 1
        live = pc.live.tokens
        if point:
            candidates = [
                len(p) for p in stored_states if len(p) <= target and list(p) == prompt[: len(p)]
            ]
            if len(live) <= target and live == prompt[: len(live)]:
                candidates.append(len(live))
            expected = max(candidates, default=0)
        else:
            expected = max((trie.common_prefix(s, prompt) for s in fed_sequences), default=0)
            expected = min(expected, target)
        matched = trie.match(pc.root, prompt)[1]
        session = generate(pc, prompt, generated, schedule)
        assert session.offset == expected, (prompt, fed_sequences[-3:])
        check(pc, tracker)
        captures = {p for p in schedule if expected < p <= len(prompt) - 1}
        if expected < min(matched, target):
            captures.add(min(matched, target))
        for c in captures:
            stored_states.add(tuple(prompt[:c]))
        fed = [*prompt, *generated[:-1]]
        stored_states.add(tuple(fed))
        fed_sequences.append(fed)


def test_deferred_stores_wait_for_settle_and_change_nothing_else(layout):
    """Invariant 7 with `defer_stores` (the runner's caches): a closed session stores nothing
    until `settle()` (the engine's after-job hook) or the next entry point, and a run of
    requests gives the same sessions, the same trie and the same live state as storing at
    once."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 6) for _ in range(rng.randrange(2, 12))] for _ in range(40)]
    for scoring in (False, True):  # a scoring cache (hidden rows) or a generation cache
        _deferred_run_equals_immediate(layout, prompts, scoring)


def _deferred_run_equals_immediate(layout, prompts, scoring):
    runs = []
    for defer in (False, True):
        pc, tracker = make(layout, hidden=scoring, limit=4000, defer=defer)
        offsets, waited = [], 0
        for i, prompt in enumerate(prompts):
            session = score(pc, prompt) if scoring else generate(pc, prompt, [7, 8])
            offsets.append(session.offset)
            reached = trie.match(pc.root, pc.live.tokens)[1] == len(pc.live.tokens)
            if not defer:
                assert reached  # stored when the session closed
            elif i % 3:
                pc.settle()
                waited += not reached  # a store waited for settle()...
                assert trie.match(pc.root, pc.live.tokens)[1] == len(pc.live.tokens)  # ...done
            if not defer or i % 3:
                check(pc, tracker)
        assert waited > 5 or not defer
        pc.settle()
        check(pc, tracker)
        shape = sorted((n.start, n.end) for n in trie.walk(pc.root))
        runs.append((offsets, shape, list(pc.live.tokens), pc.nbytes))
    assert runs[0] == runs[1]


def test_a_deferred_store_that_fails_empties_the_live_state(layout):
    pc, tracker = make(layout, hidden=True, defer=True)
    score(pc, [1, 2, 3, 4, 5])

    def broken():
        raise MemoryError("no room for the snapshots")

    pc.store_live = broken
    with pytest.raises(MemoryError):
        pc.settle()
    assert pc.live.tokens == [] and trie.match(pc.root, [1, 2, 3, 4, 5])[1] == 0
    del pc.store_live
    pc.settle()  # nothing waits any more
    assert score(pc, [1, 2, 3, 4, 5]).offset == 0  # recomputed from nothing, stored
    pc.settle()
    check(pc, tracker)
    assert score(pc, [1, 2, 3, 4, 5]).hidden_row is not None
