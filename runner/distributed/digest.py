"""A digest of a prefix cache's index: what every rank of a group must hold alike.

The index is the trie's shape (each node's span and tokens, in a fixed order) and the
tokens the live caches hold. Snapshot bytes, clocks and which cache kinds a rank has are
left out: they differ between ranks by design (a pipeline rank holds only its layers), while
the index is rank 0's decisions replayed, and is equal on every rank or the group is out of
step.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np

from runner.cache import trie


def index_digest(caches: dict[str, Any]) -> str:
    """One digest over named prefix caches (each with `root` and `live.tokens`)."""
    h = hashlib.sha256()
    for name in sorted(caches):
        cache = caches[name]
        h.update(name.encode() + b"\0")
        _node(h, cache.root)
        tokens = cache.live.tokens
        h.update(struct.pack("<q", len(tokens)))
        h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()[:16]


def _node(h: Any, node: trie.Node) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        h.update(struct.pack("<qqq", n.start, n.end, len(n.children)))
        h.update(np.asarray(n.tokens, dtype="<i4").tobytes())
        stack.extend(n.children[k] for k in sorted(n.children, reverse=True))


def node_count(cache: Any) -> int:
    return sum(1 for _ in trie.walk(cache.root))
