"""Rank 0: the only rank that decides. Its prefix caches send every action to the others.

`Leader` is rank 0's end of the control channel (one link per other rank): numbered
commands out, acknowledgements in. `LeaderPrefixCache` is the runner's `PrefixCache` with
every action that changes a cache index or a live state also sent, in the order it happens,
before it happens (a forward's collectives need every rank in it):

| command | sent by | the other ranks |
|---|---|---|
| `open c` | a cache is made | make prefix cache `c` (no hidden rows, no budget of their own) |
| `switch c T` | `_switch` (begin's restore) | make their live caches hold T (rank 0 chose T) |
| `feed c T` | `LiveState.feed` | the same prefill forward |
| `step c t` | `LiveState.step` | the same decode forward |
| `rows c R...` | `LiveState.forward_rows` | the same batched forward over their live state |
| `store c` | `store_live` | store their live state as the node rank 0 stores |
| `store_rows c s R...` | `store_rows` | store the rows they just computed |
| `evict c P` | `evict_node` | evict the node at path P (rank 0 chose it) |
| `reset c` | `LiveState.reset` | empty their live state |
| `sync` | the budget, the rank check | acknowledge at once, with their cache bytes |
| `digest` | the rank check | answer a digest of their cache index |
| `stop` | shutdown | exit 0 |

Nothing another rank does depends on its clock, its byte counts or its sockets: which prefix
to restore, where to store, what to evict, how rows are batched and when a request stops
(a cancellation is only rank 0 sending nothing more) all arrive as commands.

Bytes: a node's snapshots weigh differently on each rank (a pipeline rank holds only its
layers). Every acknowledgement carries the rank's prefix-cache bytes, and the budget
(`GroupBudget`) is over when any rank is: rank 0 evicts, by its own LRU order, until every
rank's bytes are under the limit. Restores: with a point kind (sliding window, recurrent
state) on another rank but none here, rank 0's caches carry a phantom point slot
(`PHANTOM`) that records where such states are stored, so rank 0 never restores where
another rank cannot.

Faults (`Leader`'s monitor thread): a link that closes (a rank exited or was killed) ends
rank 0 with `Error: rank N ...` at once; a rank that acknowledges no command, or answers no
ping (sent every second), for `timeout` seconds is stuck: the same. A forward that raises
on rank 0 ends it too: the ranks' collectives can no longer be paired.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx

from runner.cache.budget import ByteBudget
from runner.cache.kinds import Kind, Snap
from runner.cache.live import LiveState
from runner.cache.prefix_cache import PrefixCache
from runner.cache.trie import Node
from runner.distributed import wire
from runner.distributed.digest import index_digest

log = logging.getLogger(__name__)

PING_SECONDS = 1.0


class Link(Protocol):
    """One other rank's end of the control channel, as rank 0 sees it."""

    def send(self, frame: bytes) -> None: ...

    def close(self) -> None: ...


class SocketLink:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, frame: bytes) -> None:
        with self._lock:
            self.sock.sendall(frame)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Leader:
    """Rank 0's end of the control channel: commands out, acknowledgements in, the watchdog.

    `fail(message)` ends the process (`Error: message`, exit 1); in tests it may raise.
    """

    def __init__(
        self,
        links: dict[int, Link],
        *,
        timeout: float,
        fail: Callable[[str], None],
        ping_seconds: float = PING_SECONDS,
    ):
        self.links = links
        self.ranks = sorted(links)
        self.timeout = timeout
        self.fail = fail
        self.ping_seconds = ping_seconds
        self.seq = 0
        self.acked = dict.fromkeys(self.ranks, 0)
        self.bytes = dict.fromkeys(self.ranks, 0)
        self.digests: dict[int, dict[int, str]] = {r: {} for r in self.ranks}
        self.ready: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, str] = {}
        self.caches: dict[str, PrefixCache] = {}
        self._sent: collections.deque[tuple[int, str, float]] = collections.deque()
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._lost = threading.Event()
        self._stopping = False
        self._monitor: threading.Thread | None = None
        self._pongs: dict[int, float | None] = dict.fromkeys(self.ranks)
        self.checks = 0

    # --- commands -------------------------------------------------------------------------
    def send(
        self, op: str, cache: str | None = None, lists: list[list[int]] | tuple = (), **fields: Any
    ) -> int:
        """Send one numbered command to every other rank; its number."""
        with self._send_lock:
            self.seq += 1
            seq = self.seq
            frame = wire.encode(op, lists, seq=seq, c=cache, **fields)
            with self._cond:
                self._sent.append((seq, op, time.monotonic()))
            for rank in self.ranks:
                try:
                    self.links[rank].send(frame)
                except OSError as e:
                    self.lost(rank, f"cannot send to it: {e}")
        return seq

    def sync(self) -> dict[int, int]:
        """Wait until every rank has executed every command sent; their cache bytes (a
        `sync` command, which the others acknowledge at once)."""
        target = self.send("sync")
        with self._cond:
            while any(self.acked[r] < target for r in self.ranks):
                self._cond.wait(0.5)
            return dict(self.bytes)

    def on_message(self, rank: int, message: wire.Message) -> None:
        """A message from `rank` (the monitor thread, or a direct link in tests)."""
        op = message.op
        with self._cond:
            if op == "ack":
                seq = int(message.get("seq", 0))
                self.acked[rank] = max(self.acked[rank], seq)
                self.bytes[rank] = int(message.get("bytes", 0))
                if message.get("digest") is not None:
                    self.digests[rank][seq] = str(message.get("digest"))
                low = min(self.acked.values())
                while self._sent and self._sent[0][0] <= low:
                    self._sent.popleft()
            elif op == "pong":
                self._pongs[rank] = None
            elif op == "ready":
                self.ready[rank] = dict(message.fields)
            elif op == "error":
                self.errors[rank] = str(message.get("message", ""))
            self._cond.notify_all()

    def wait_ready(self) -> dict[int, dict[str, Any]]:
        """Every other rank's `ready` (sent once its model is loaded)."""
        with self._cond:
            while len(self.ready) < len(self.ranks):
                self._cond.wait(0.5)
            return dict(self.ready)

    def check_digests(self) -> None:
        """Compare every rank's digest of its cache index with rank 0's (after a job)."""
        for cache in self.caches.values():
            cache.live.settle()
        mine = index_digest(self.caches)
        seq = self.send("digest")
        with self._cond:
            while any(self.acked[r] < seq for r in self.ranks):
                self._cond.wait(0.5)
        self.checks += 1
        theirs = {r: self.digests[r].pop(seq, None) for r in self.ranks}
        log.info("ranks in step check=%d digest=%s ranks=%s", self.checks, mine, theirs)
        for rank, digest in theirs.items():
            if digest != mine:
                self.fail(
                    f"rank {rank}'s prefix-cache index ({digest}) differs from rank 0's "
                    f"({mine}) after check {self.checks}: the group is out of step"
                )

    # --- faults ---------------------------------------------------------------------------
    def lost(self, rank: int, why: str) -> None:
        if self._stopping:
            return
        self._lost.set()
        said = self.errors.get(rank)
        detail = f" ({said})" if said else ""
        log.error("rank %d of the group %s%s", rank, why, detail)
        self.fail(f"rank {rank} of the group {why}{detail}; every rank must be restarted")

    def forward_failed(self, error: BaseException) -> None:
        """A forward raised on rank 0: the ranks' collectives can no longer be paired. A rank
        that died is named (the monitor sees its link close within milliseconds)."""
        if self._lost.wait(1.0):
            while True:  # the monitor is ending the process
                time.sleep(1.0)
        self.fail(f"a forward failed on rank 0 of the group: {type(error).__name__}: {error}")

    def stop(self) -> None:
        """Tell every rank to exit (rank 0 is stopping)."""
        if self._stopping:
            return
        self._stopping = True  # first: a rank that exits on `stop` is not a lost rank
        self.send("stop")
        for link in self.links.values():
            link.close()

    # --- the monitor (socket links) -------------------------------------------------------
    def start_monitor(self, socks: dict[int, socket.socket]) -> None:
        self._monitor = threading.Thread(
            target=self._watch, args=(socks,), name="group-monitor", daemon=True
        )
        self._monitor.start()

    def _watch(self, socks: dict[int, socket.socket]) -> None:
        selector = selectors.DefaultSelector()
        readers = {}
        for rank, sock in socks.items():
            selector.register(sock, selectors.EVENT_READ, rank)
            readers[rank] = wire.Reader()
        last_ping = time.monotonic()
        while not self._stopping:
            for key, _ in selector.select(timeout=0.2):
                rank = key.data
                try:
                    data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                except OSError as e:
                    data, error = b"", str(e)
                else:
                    error = "exited (its control connection closed)"
                if not data:
                    if self._stopping:
                        return
                    selector.unregister(key.fileobj)
                    self.lost(rank, error)
                    return
                try:
                    messages = readers[rank].feed(data)
                except wire.WireError as e:
                    self.lost(rank, f"sent a malformed message: {e}")
                    return
                for message in messages:
                    self.on_message(rank, message)
            now = time.monotonic()
            self._watchdog(now)
            if now - last_ping >= self.ping_seconds:
                last_ping = now
                self._ping(now)

    def _watchdog(self, now: float) -> None:
        with self._cond:
            for rank in self.ranks:
                for seq, op, sent in self._sent:
                    if seq > self.acked[rank]:
                        if now - sent > self.timeout:
                            self.fail(
                                f"rank {rank} of the group is stuck: command {seq} ({op}) "
                                f"unanswered for {now - sent:.1f} s (watchdog "
                                f"{self.timeout:g} s); every rank must be restarted"
                            )
                        break
                asked = self._pongs.get(rank)
                if asked is not None and now - asked > self.timeout:
                    self.fail(
                        f"rank {rank} of the group is stuck: no answer to a ping for "
                        f"{now - asked:.1f} s (watchdog {self.timeout:g} s); every rank must "
                        "be restarted"
                    )

    def _ping(self, now: float) -> None:
        frame = wire.encode("ping")
        for rank in self.ranks:
            if self._pongs.get(rank) is None:
                self._pongs[rank] = now
                try:
                    self.links[rank].send(frame)
                except OSError as e:
                    self.lost(rank, f"cannot send to it: {e}")


# --- rank 0's caches ------------------------------------------------------------------------


class PhantomKind(Kind):
    """A point kind that holds nothing: it marks where another rank's point states (sliding
    windows, recurrent states) are stored, so that rank 0, having none of its own, restores
    only where they can (`PrefixCache._restore_offset` counts it as any point kind)."""

    name = "phantom"
    point = True
    batches = True

    def capture(self, cache: Any, start: int, end: int) -> Snap | None:
        return Snap(end, end, ())

    def can_rewind(self, cache: Any, offset: int, target: int) -> bool:
        return target == offset

    def rewind(self, cache: Any, offset: int, target: int) -> None:
        assert target == offset

    def install(self, cache: Any, snaps: list[Snap], target: int) -> None:
        if target:
            (snap,) = snaps
            assert snap.end == target, "a point state restores only where it was taken"

    def broadcast(self, cache: Any, batch: int) -> Any:
        return cache


PHANTOM = PhantomKind()


class PhantomState:
    """The phantom slot's live object (`OwnKind`)."""

    prefix_kind: Kind = PHANTOM


class LeaderLive(LiveState):
    """Rank 0's live state: each forward and reset is sent first, each forward evaluated at
    once (so a failure is seen here, where the ranks' collectives were still paired)."""

    def __init__(self, model: Any, keep_hidden: bool, leader: Leader, name: str, phantom: bool):
        self.leader: Leader | None = None  # LiveState.__init__ resets: nothing to send yet
        self.phantom = phantom
        self.name = name
        super().__init__(model, keep_hidden)
        self.leader = leader

    def reset(self) -> None:
        if self.leader is not None:
            self.leader.send("reset", self.name)
        super().reset()
        if self.phantom:  # before the hidden rows: the prefix cache reads those last
            at = len(self.caches)
            self.slots.insert(at, PhantomState())
            self.kinds.insert(at, PHANTOM)

    def feed(self, tokens: list[int], media: Any = None) -> mx.array:
        assert media is None, "images are refused in distributed runs"
        assert self.leader is not None
        self.leader.send("feed", self.name, [tokens])
        try:
            return super().feed(tokens)
        except Exception as e:
            self.leader.forward_failed(e)
            raise

    def step(self, token: int | mx.array, layout: Any = None) -> mx.array:
        assert layout is None, "images are refused in distributed runs"
        assert self.leader is not None
        value = token if isinstance(token, int) else int(token.reshape(-1)[0].item())  # type: ignore[arg-type]
        self.leader.send("step", self.name, [[value]])
        hidden = super().step(value)
        try:
            mx.eval(hidden)
        except Exception as e:
            self.reset()
            self.leader.forward_failed(e)
            raise
        return hidden

    def forward_rows(self, batch: list[Any], rows: list[list[int]], layout: Any = None) -> mx.array:
        assert layout is None, "images are refused in distributed runs"
        assert self.leader is not None
        self.leader.send("rows", self.name, rows)
        hidden = super().forward_rows(batch, rows)
        try:
            mx.eval(hidden)
        except Exception as e:
            self.leader.forward_failed(e)
            raise
        return hidden


class LeaderPrefixCache(PrefixCache):
    """The runner's prefix cache on rank 0: the same decisions, each action also sent."""

    def __init__(self, model: Any, *, leader: Leader, phantom: bool = False, **kwargs: Any):
        self.leader = leader
        self.phantom = phantom
        super().__init__(model, **kwargs)
        leader.caches[self.name] = self
        leader.send("open", self.name)

    def make_live(self, model: Any, keep_hidden: bool) -> LiveState:
        return LeaderLive(model, keep_hidden, self.leader, self.name, self.phantom)

    def _switch(self, path: list[Node], tokens: list[int], offset: int) -> None:
        self.leader.send("switch", self.name, [list(tokens[:offset])])
        super()._switch(path, tokens, offset)

    def store_live(self) -> Node | None:
        self.leader.send("store", self.name)
        return super().store_live()

    def evict_node(self, victim: Node) -> None:
        self.leader.send("evict", self.name, [path_tokens(victim)])
        super().evict_node(victim)

    def store_rows(
        self, rows: list[list[int]], start: int, batch: list[Any], hidden: mx.array | None
    ) -> None:
        self.settle()  # its own commands first, in the order they happen
        self.leader.send("store_rows", self.name, rows, start=start)
        super().store_rows(rows, start, batch, hidden)


def path_tokens(node: Node) -> list[int]:
    """The tokens from the root to the end of `node`: its identity on every rank."""
    parts = []
    at: Node | None = node
    while at is not None and at.parent is not None:
        parts.append(at.tokens)
        at = at.parent
    return [t for part in reversed(parts) for t in part]


class GroupBudget(ByteBudget):
    """One byte limit for every rank's prefix caches: over when any rank is (each rank's
    bytes from its acknowledgements, after every command sent so far)."""

    def __init__(self, limit: int, leader: Leader):
        super().__init__(limit)
        self.leader = leader

    @property
    def used(self) -> int:
        local = sum(c.nbytes for c in self.members)
        if local > self.limit:
            return local
        return max([local, *self.leader.sync().values()])
