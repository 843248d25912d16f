"""The token trie's structure (the Go runner's cache_trie_test.go in spirit)."""

from __future__ import annotations

import pytest

from runner.cache import trie
from runner.cache.trie import Node


class Ops:
    """Snapshots are (start, end) tuples; split and merge are arithmetic."""

    def __init__(self) -> None:
        self.closed: list[tuple[int, int]] = []

    def split(self, slot, snap, at):
        return (snap[0], at), (at, snap[1])

    def merge(self, slot, parent, child):
        return (parent[0], child[1])

    def close(self, slot, snap):
        self.closed.append(snap)


def build(*sequences: list[int]) -> Node:
    root = Node([], 0, None, 1, 0.0)
    for tokens in sequences:
        path, matched = trie.match(root, tokens)
        node = path[-1]
        if node.end > matched:
            node = trie.split(node, matched, Ops())
        if matched < len(tokens):
            child = trie.add_child(node, tokens[matched:], 0.0)
            child.snapshots[0] = (child.start, child.end)
    trie.check_invariants(root)
    return root


def test_match_picks_the_right_branch_and_counts_tokens():
    root = build([1, 2, 3, 4], [1, 2, 5, 6], [7, 8])
    path, matched = trie.match(root, [1, 2, 5, 9])
    assert matched == 3 and [n.end for n in path[1:]] == [2, 4]
    assert trie.match(root, [9])[1] == 0
    assert trie.match(root, [7, 8, 9])[1] == 2


def test_split_divides_snapshots_between_head_and_child():
    root = build([1, 2, 3, 4, 5])
    (node,) = root.children.values()
    node.last_used = 4.0
    head = trie.split(node, 2, Ops())
    assert (head.start, head.end, head.snapshots[0]) == (0, 2, (0, 2))
    assert (node.start, node.end, node.snapshots[0]) == (2, 5, (2, 5))
    assert node.parent is head and head.last_used == node.last_used == 4.0
    trie.check_invariants(root)


def test_merge_with_child_round_trips_a_split():
    root = build([1, 2, 3, 4, 5])
    (node,) = root.children.values()
    node.last_used = 5.0
    head = trie.split(node, 3, Ops())
    head.last_used = 9.0
    merged = trie.merge_with_child(head, Ops())
    assert merged.tokens == [1, 2, 3, 4, 5] and merged.end == 5
    assert merged.snapshots[0] == (0, 5) and merged.last_used == 9.0
    assert root.children[1] is merged
    trie.check_invariants(root)


def test_merge_needs_exactly_one_child_and_remove_needs_a_leaf():
    root = build([1, 2, 3], [1, 2, 4])
    (shared,) = root.children.values()
    with pytest.raises(AssertionError):
        trie.merge_with_child(shared, Ops())
    with pytest.raises(AssertionError):
        trie.remove_leaf(shared, Ops())
    with pytest.raises(AssertionError):
        trie.remove_leaf(root, Ops())
    ops = Ops()
    leaf = shared.children[3]
    trie.remove_leaf(leaf, ops)
    assert ops.closed == [(2, 3)] and 3 not in shared.children and leaf.parent is None
    trie.check_invariants(root)


def test_repeated_branching_stays_consistent():
    root = build([1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [1, 2, 7], [1, 8], [1, 2, 3, 4, 5, 0])
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [1, 2, 7], [1, 8], [1, 2, 3, 4, 5, 0]):
        assert trie.match(root, tokens)[1] == len(tokens)
    assert sorted(n.end for n in trie.walk(root)) == [1, 2, 2, 3, 3, 4, 5, 6, 6]


def test_common_prefix_is_the_first_difference():
    import random

    from runner.cache.trie import common_prefix

    rng = random.Random(0)
    for _ in range(3000):
        a = rng.choices([1, 2], k=rng.randint(0, 80))
        b = a[: rng.randint(0, len(a))] + rng.choices([1, 2, 3], k=rng.randint(0, 80))
        pairs = enumerate(zip(a, b, strict=False))
        expected = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(b, a) == expected
        assert common_prefix(tuple(a), b) == expected
