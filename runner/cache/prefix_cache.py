"""The prefix cache: a trie of snapshots over one set of live model caches.

A request calls `begin(tokens)`; the cache finds the longest stored prefix, makes the live
caches hold the longest part of it every cache kind can restore, and hands back a session
(runner/cache/session.py) that computes the rest and stores what it crossed when it closes.
Scoring and generation each own one `PrefixCache`; a shared `ByteBudget` counts both, and
each evicts only its own nodes.

Invariants (each tested in tests/test_prefix_cache.py):
1. The live caches hold exactly `live.tokens` (every slot at the same offset; runner/cache/
   live.py); nodes on the path of `live.tokens` are the active path.
2. Every non-root node holds, for every edge kind (KV, hidden rows), a snapshot spanning
   exactly its edge; point kinds (sliding window, recurrent) hold states only at node ends.
3. At least one prompt token is computed at `begin`, except when stored hidden rows cover
   the whole prompt (scoring only): then the session carries that row and computes nothing.
4. No node claims tokens the caches never computed: nodes are only created from live
   caches at the offset they reached, after that chunk was evaluated.
5. A cancelled prefill keeps every node it crossed (the next request resumes there); an
   exception inside a forward empties the live caches and adds no node.
6. `nbytes` equals the sum of the node snapshots' bytes; eviction brings the budget's
   total under its limit unless only protected nodes remain. Eviction never takes a node
   on the active path or a branch point (>1 child); oldest first, then deepest, then
   largest; a leaf is removed, a single-child node is merged into its child.
7. Snapshots are scheduled at branch points (where a request leaves the stored path), at
   offsets the caller asks for (the rows' shared prefix), every `interval` tokens, and at
   the end of what a session fed: when the session closes, or, with `defer_stores` (the
   runner's caches), at `settle()`, which the engine calls after the request's answer is
   delivered and every entry point calls before it reads the trie or the live state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx

from runner.cache import trie
from runner.cache.budget import ByteBudget
from runner.cache.kinds import HIDDEN, Kind, KVKind, Snap
from runner.cache.live import LiveState
from runner.cache.session import PrefixSession
from runner.cache.trie import Node

if TYPE_CHECKING:
    from runner.media.request import RequestMedia

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_TOKENS = 8192


@runtime_checkable
class KVRestorer(Protocol):
    """A model that pages a prefix into a plain `KVCache` itself (runner/models/base.py):
    `restore_kv(cache, segments, target, kept)` makes the cache hold [0, target) from the
    trie's KV segments (`Snap`s of (keys, values), in order from 0) in buffers the model owns
    for that cache, positions [0, kept) already held; False when it cannot (nothing changed:
    the cache installs the segments as usual). Equal to `KVKind.install` in what the cache
    then holds."""

    def restore_kv(self, cache: Any, segments: list[Any], target: int, kept: int) -> bool: ...


class PrefixCache:
    """A trie of snapshots over one `LiveState`; sessions compute, the cache stores.

    `keep_hidden` (scoring) also keeps the final hidden rows, so a prompt stored whole is
    scored without computing. `chunk_tokens` bounds a prefill forward; `batch_tokens` the
    suffix tokens of one batched forward: the backend's policy decides both
    (runner/backend/__init__.py), the one place they are set.
    """

    def __init__(
        self,
        model: Any,
        *,
        name: str,
        budget: ByteBudget | None = None,
        keep_hidden: bool = False,
        interval: int = SNAPSHOT_INTERVAL_TOKENS,
        chunk_tokens: int,
        batch_tokens: int,
        defer_stores: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.model = model
        self.name = name
        self.budget = budget or ByteBudget()
        self.budget.members.append(self)
        self.interval = interval
        self.chunk_tokens = chunk_tokens
        self.batch_tokens = batch_tokens
        self.clock = clock
        self.live = self.make_live(model, keep_hidden)
        self.kinds: list[Kind] = list(self.live.kinds)
        self.root = Node([], 0, None, len(self.kinds), clock())
        self.nbytes = 0
        self.ops = _Ops(self.kinds)
        # Whether a closed session's store waits for `settle()` (the engine's after-job
        # hook: a decision request's answer does not wait ~1.2 ms for its 61 snapshots),
        # and whether one is waiting.
        self.defer_stores = defer_stores
        self._unstored = False

    def make_live(self, model: Any, keep_hidden: bool) -> LiveState:
        """The live state this cache computes through (a subclass may make its own: the
        distributed leader's, runner/distributed/leader.py)."""
        return LiveState(model, keep_hidden)

    # --- a closed session's store -------------------------------------------------------
    def session_ended(self) -> None:
        """A session computed the live state and closed: store it now, or at `settle()`."""
        if self.defer_stores:
            self._unstored = True
        else:
            self.store_live()
            self.evict()

    def settle(self) -> None:
        """Store a closed session's live state if it waits (then evict). Should the store
        fail, the live state is emptied (as after a failed forward) and the error raised."""
        if not self._unstored:
            return
        self._unstored = False
        try:
            self.store_live()
            self.evict()
        except BaseException:
            self.live.reset()
            raise

    # --- begin: restore the longest usable prefix ---------------------------------------
    def begin(
        self,
        tokens: list[int],
        schedule: Iterable[int] = (),
        *,
        need_state: bool = False,
        media: RequestMedia | None = None,
    ) -> PrefixSession:
        """A session whose live caches hold the longest restorable prefix of `tokens`.

        With `need_state` the caller wants the live caches at the end of `tokens`: a stored
        hidden row never stands in for them, but when both the states at the very end and
        its hidden row are stored, the session restores all of `tokens` (hidden_row set).
        With `media` (a prompt with images), `tokens` are its keys; no restore and no
        capture lands strictly inside an atomic image.
        """
        assert tokens, "a session needs at least one token"
        self.settle()
        self.live.settle()
        path, matched = trie.match(self.root, tokens)
        n = len(tokens)
        stored_row = self.stored_hidden_row(tokens, path, matched)
        if not need_state and stored_row is not None:
            path[-1].last_used = self.clock()
            self._log("hit", n, matched, n)
            return PrefixSession(self, tokens, n, [], hidden_row=stored_row)
        target = min(matched, n if stored_row is not None else n - 1)
        if media is not None:
            target = media.floor(target)
        offset = self._restore_offset(path, tokens, target)
        self._switch(path, tokens, offset)
        self._touch_landing(path, offset)
        captures = {p for p in schedule if offset < p <= n}
        if offset < target:
            captures.add(target)  # a branch point: later requests leaving here restore exactly
        captures.update(range(self.interval, n + 1, self.interval))
        if media is not None:
            captures = {c for c in captures if media.floor(c) == c}
        self._log("hit" if offset else "miss", n, matched, offset)
        row = stored_row if offset == n else None
        return PrefixSession(
            self,
            tokens,
            offset,
            sorted(c for c in captures if c > offset),
            hidden_row=row,
            media=media,
        )

    def last_hidden(
        self,
        tokens: list[int],
        check: Callable[[], None],
        schedule: Iterable[int] = (),
        media: RequestMedia | None = None,
    ) -> tuple[mx.array, int]:
        """The hidden row of `tokens`' last position ([1, H]), stored or computed, and how
        many tokens were restored instead of computed; `check` raises to cancel."""
        with self.begin(tokens, schedule, media=media) as session:
            return session.last_hidden(check), session.offset

    def stored_hidden_row(
        self, tokens: list[int], path: list[Node] | None = None, matched: int | None = None
    ) -> mx.array | None:
        """The stored final hidden row of the last token when the whole of `tokens` is in the
        trie with hidden rows (scoring's full hit); changes nothing but a waiting store."""
        self.settle()
        if self.live.hidden is None:
            return None
        if path is None or matched is None:
            path, matched = trie.match(self.root, tokens)
        snap = path[-1].snapshots[-1]
        if matched != len(tokens) or snap is None:
            return None
        return HIDDEN.row(snap, len(tokens) - 1)

    def stored_rows(self, tokens: list[int], end: int) -> tuple[list[mx.array], int]:
        """The stored final hidden rows of `tokens`' positions from 0 on, up to `end` or to
        the first position the trie does not hold with hidden rows: the nodes' slices ([1, k,
        H] each, in order) and the positions they cover. Changes nothing but a waiting
        store (a cache without hidden rows covers none)."""
        self.settle()
        if self.live.hidden is None:
            return [], 0
        path, matched = trie.match(self.root, tokens[:end])
        parts: list[mx.array] = []
        covered = 0
        for node in path[1:]:
            snap = node.snapshots[-1]
            stop = min(node.end, matched)
            if snap is None or snap.start != covered or stop <= covered:
                break
            parts.append(snap.arrays[0][:, : stop - snap.start, :])
            covered = stop
        return parts, covered

    def store_rows(
        self, rows: list[list[int]], start: int, batch: list[Any], hidden: mx.array | None
    ) -> None:
        """Store rows computed together from the live state at `start` (their shared prefix):
        row i's tokens [start, len) are in row i of the batched caches `batch` and of
        `hidden` [B, L, H]. Edge kinds get their segments; point kinds none (the padded
        batch ran past shorter rows' ends), so these nodes serve full hits and KV restores."""
        self.settle()
        # `hidden` is None only for a replica that keeps no hidden rows (another rank's copy
        # of the scoring cache, runner/distributed/follower.py)
        assert (self.live.hidden is None) == (hidden is None), "hidden rows go where they are kept"
        # Nodes first, then their segments: a later row may cut the node an earlier row's
        # suffix was stored in (rows sharing more with each other than with the batch), and
        # both parts then take their span from the row that made the node.
        made: dict[int, tuple[Node, int]] = {}  # id -> (a node made here, the row it is in)
        for i, tokens in enumerate(rows):
            path, matched = trie.match(self.root, tokens)
            if matched >= len(tokens) or matched < start:
                continue
            node = path[-1]
            if node.end > matched:
                cut = node
                node = self._split(node, matched)
                if id(cut) in made:
                    made[id(node)] = (node, made[id(cut)][1])
            child = trie.add_child(node, tokens[matched:], self.clock())
            made[id(child)] = (child, i)
        entries: list[tuple[Node, int, Snap | None]] = []
        for node, i in made.values():
            for slot, kind in enumerate(self.kinds):
                if kind is HIDDEN:
                    assert hidden is not None
                    rows_i = hidden[i : i + 1, node.start - start : node.end - start, :]
                    entries.append((node, slot, Snap(node.start, node.end, (mx.array(rows_i),))))
                elif not kind.point:
                    segment = kind.row_segment(batch[slot], i, node.start, node.end)
                    entries.append((node, slot, segment))
        self._set_all(entries)
        self.evict()

    def _restore_offset(self, path: list[Node], tokens: list[int], target: int) -> int:
        """The deepest offset <= target that every kind can restore."""
        if target <= 0:
            return 0
        points = [i for i, k in enumerate(self.kinds) if k.point]
        if not points:
            return target
        best = 0
        for node in path[1:]:
            if node.end <= target and all(node.snapshots[i] is not None for i in points):
                best = max(best, node.end)
        live = len(self.live.tokens)
        if best < live <= target and self.live.tokens == tokens[:live]:
            best = live
        return best

    def _switch(self, path: list[Node], tokens: list[int], offset: int) -> None:
        """Make the live caches hold tokens[:offset]: rewind where the live state allows,
        page snapshots in where it does not."""
        live = len(self.live.tokens)
        kept = trie.common_prefix(self.live.tokens, tokens[:offset])  # the live state has these
        shared = kept >= offset
        # a model that can write KV segments into buffers it owns (the native step's)
        restore = self.model.restore_kv if isinstance(self.model, KVRestorer) else None
        try:
            for slot, (kind, cache) in enumerate(zip(self.kinds, self.live.slots, strict=True)):
                if shared and kind.can_rewind(cache, live, offset):
                    kind.rewind(cache, live, offset)
                elif kind.point:
                    snaps = [n.snapshots[slot] for n in path[1:] if n.end == offset]
                    kind.install(cache, snaps[-1:] if offset else [], offset)
                else:
                    segments = [n.snapshots[slot] for n in path[1:] if n.start < offset]
                    if not (
                        restore
                        and isinstance(kind, KVKind)
                        and restore(cache, segments, offset, kept)
                    ):
                        kind.install(cache, segments, offset)
            self.live.tokens = list(tokens[:offset])
            mx.eval(*self.live.arrays())
        except BaseException:
            # some caches switched and others not: `tokens` would describe none of them
            self.live.reset()
            raise

    def _touch_landing(self, path: list[Node], offset: int) -> None:
        """LRU: only the node the restore landed in counts as used."""
        for node in reversed(path[1:]):
            if node.start < offset <= node.end:
                node.last_used = self.clock()
                return

    # --- storing what a session computed ------------------------------------------------
    def store_live(self) -> Node | None:
        """Store the live state as the node ending at the live offset (creating or
        splitting nodes along the way); returns that node."""
        self._unstored = False  # what a waiting store would store
        self.live.settle()
        offset = len(self.live.tokens)
        if offset == 0:
            return None
        now = self.clock()
        path, matched = trie.match(self.root, self.live.tokens)
        node = path[-1]
        if matched < offset or node.end > matched:
            if node.end > matched:  # the stored edge goes on past us: cut it here
                node = self._split(node, matched)
            if matched < offset:
                node = self._add(node, offset)
        self._set_all(
            [
                (node, slot, kind.capture(self.live.slots[slot], offset, offset))
                for slot, kind in enumerate(self.kinds)
                if kind.point and node.snapshots[slot] is None
            ]
        )
        node.last_used = now
        return node

    def _split(self, node: Node, at: int) -> Node:
        before = _node_bytes(node)
        head = trie.split(node, at, self.ops)
        self.nbytes += _node_bytes(head) + _node_bytes(node) - before
        return head

    def _add(self, parent: Node, end: int) -> Node:
        child = trie.add_child(parent, self.live.tokens[parent.end : end], self.clock())
        self._set_all(
            [
                (child, slot, kind.capture(self.live.slots[slot], parent.end, end))
                for slot, kind in enumerate(self.kinds)
                if not kind.point
            ]
        )
        return child

    def _set_all(self, entries: list[tuple[Node, int, Snap | None]]) -> None:
        """Put each snapshot in its node's slot. A lazy copy would keep its whole source (a
        live or batched buffer) alive until evaluated: they are materialised first, so the
        bytes counted are the bytes held, in one evaluation (one per snapshot cost ~50 us
        each: 31 for a SmolLM2 node, 31 per row of a batch)."""
        mx.eval(*(a for _, _, snap in entries if snap is not None for a in snap.evaluate()))
        for node, slot, snap in entries:
            old = node.snapshots[slot]
            self.nbytes += (snap.nbytes if snap else 0) - (old.nbytes if old else 0)
            node.snapshots[slot] = snap
            if old is not None:
                self.ops.close(slot, old)

    # --- eviction -------------------------------------------------------------------------
    def evict(self) -> None:
        while self.budget.over:
            protected = {id(n) for n in trie.match(self.root, self.live.tokens)[0]}
            candidates = [
                n for n in trie.walk(self.root) if id(n) not in protected and len(n.children) <= 1
            ]
            if not candidates:
                return
            victim = min(candidates, key=lambda n: (n.last_used, -n.end, -_node_bytes(n)))
            self.evict_node(victim)

    def evict_node(self, victim: Node) -> None:
        """Remove one node chosen by `evict` (a leaf; a single-child node is merged into its
        child). Another rank's replica evicts the node rank 0 chose through this too."""
        before = _node_bytes(victim)
        if victim.children:
            (child,) = victim.children.values()
            before += _node_bytes(child)
            merged = trie.merge_with_child(victim, self.ops)
            self.nbytes += _node_bytes(merged) - before
        else:
            trie.remove_leaf(victim, self.ops)
            self.nbytes -= before
        log.debug("prefix cache %s evicted [%d,%d)", self.name, victim.start, victim.end)

    def _log(self, what: str, total: int, matched: int, cached: int) -> None:
        log.info(
            "prefix cache %s %s total=%d matched=%d cached=%d left=%d",
            self.name,
            "hit" if what == "hit" else "miss",
            total,
            matched,
            cached,
            total - cached,
        )


class _Ops:
    """Kind operations by slot, closing every snapshot a split or merge does not keep."""

    def __init__(self, kinds: list[Kind]):
        self.kinds = kinds

    def split(self, slot: int, snap: Snap, at: int) -> tuple[Snap | None, Snap | None]:
        head, tail = self.kinds[slot].split(snap, at)
        if snap is not head and snap is not tail:
            self.close(slot, snap)
        mx.eval(*(a for part in (head, tail) if part is not None for a in part.evaluate()))
        return head, tail

    def merge(self, slot: int, parent: Snap | None, child: Snap | None) -> Snap | None:
        merged = self.kinds[slot].merge(parent, child)
        for snap in (parent, child):
            if snap is not None and snap is not merged:
                self.close(slot, snap)
        if merged is not None:
            mx.eval(*merged.evaluate())
        return merged

    def close(self, slot: int, snap: Snap) -> None:
        self.kinds[slot].close(snap)


def _node_bytes(node: Node) -> int:
    return sum(s.nbytes for s in node.snapshots if s is not None)
