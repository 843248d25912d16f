"""Every rank but 0: its share of the model and replicas of rank 0's prefix caches, driven
only by rank 0's commands (runner/distributed/leader.py lists them).

A follower decides nothing. Its prefix caches are the runner's `PrefixCache`, with no hidden
rows (only rank 0 unembeds) and a budget that is never over: every store, restore,
eviction and batch is one rank 0 made and sent, applied here through the same code, so the
cache index stays rank 0's (tests compare a digest of it, runner/distributed/digest.py).
Each forward is evaluated at once, so its collectives run in the order rank 0's do.

`serve(sock)` runs the loop on this thread (see its docstring): `stop` ends it with 0, a
closed connection (rank 0 gone) with 1.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from runner.cache import trie
from runner.cache.batch import broadcast
from runner.cache.budget import ByteBudget
from runner.cache.prefix_cache import PrefixCache
from runner.distributed import wire
from runner.distributed.digest import index_digest

log = logging.getLogger(__name__)

ACK_SECONDS = 0.25
GUARD_SECONDS = 2.0
UNBOUNDED = 1 << 62  # a follower never evicts on its own count


class Follower:
    """Replica prefix caches over this rank's share of the model."""

    def __init__(self, model: Any, chunk_tokens: int, batch_tokens: int):
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.batch_tokens = batch_tokens
        self.budget = ByteBudget(UNBOUNDED)
        self.caches: dict[str, PrefixCache] = {}
        self._batches: dict[str, list[Any]] = {}

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    def digest(self) -> str:
        return index_digest(self.caches)

    def execute(self, message: wire.Message) -> str | None:
        """Apply one command; returns a digest when it asks for one."""
        op, name = message.op, message.get("c")
        if op == "open":
            self.caches[name] = PrefixCache(
                self.model,
                name=name,
                budget=self.budget,
                chunk_tokens=self.chunk_tokens,
                batch_tokens=self.batch_tokens,
            )
            return None
        if op == "digest":
            return self.digest()
        if op == "sync":
            return None
        cache = self.caches[name]
        live = cache.live
        if op == "switch":
            (prefix,) = message.lists
            path, matched = trie.match(cache.root, prefix)
            if matched != len(prefix):
                raise RuntimeError(f"switch to {len(prefix)} tokens of which {matched} are stored")
            cache._switch(path, prefix, len(prefix))
        elif op == "feed":
            (tokens,) = message.lists
            live.feed(tokens)
        elif op == "step":
            ((token,),) = message.lists
            mx.eval(live.step(token))
            live.settle()
        elif op == "rows":
            rows = message.lists
            kinds = live.kinds[: len(live.caches)]
            batch = broadcast(kinds, live.caches, len(rows))
            mx.eval(live.forward_rows(batch, rows))
            self._batches[name] = batch
        elif op == "store":
            cache.store_live()
        elif op == "store_rows":
            batch = self._batches.pop(name)
            cache.store_rows(message.lists, int(message.get("start")), batch, None)
        elif op == "evict":
            (key,) = message.lists
            path, matched = trie.match(cache.root, key)
            node = path[-1]
            if matched != len(key) or node.end != len(key):
                raise RuntimeError(f"evict: no node ends at the {len(key)} tokens given")
            cache.evict_node(node)
        elif op == "reset":
            live.reset()
        else:
            raise RuntimeError(f"unknown command {op!r}")
        return None


class LoadPonger:
    """While this rank loads its share (minutes for a large model), a thread answers rank
    0's pings, and ends the process if rank 0 goes. Rank 0 sends nothing else before this
    rank says it is ready, so `finish()` (before `ready`) hands `serve` a clean stream."""

    def __init__(self, sock: socket.socket, rank: int, fail: Callable[[str], None]):
        self.sock, self.rank, self.fail = sock, rank, fail
        self.reader = wire.Reader()
        self.early: list[wire.Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-load-ponger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                self.fail(
                    f"rank {self.rank}: lost rank 0 (the control connection closed) while loading"
                )
                return
            for message in self.reader.feed(data):
                if message.op == "ping":
                    self.sock.sendall(wire.encode("pong"))
                else:
                    self.early.append(message)

    def finish(self) -> tuple[wire.Reader, list[wire.Message]]:
        self._stop.set()
        self._thread.join()
        self.sock.settimeout(None)
        return self.reader, self.early


def serve(
    follower: Follower,
    sock: socket.socket,
    rank: int,
    fail: Callable[[str], None],
    reader: wire.Reader | None = None,
    early: list[wire.Message] | None = None,
) -> int:
    """Execute rank 0's commands until `stop` (0) or a lost connection (1).

    This thread reads the connection and executes what it reads, with no hand-off between
    threads (each costs a wake-up per command). Acknowledgements are lazy: at once for a
    `sync` or a `digest` (rank 0 waits for those), otherwise once the connection has been
    quiet for `ACK_SECONDS` after a command, or every `ACK_SECONDS` while busy, which the
    watchdog's deadline allows for. A guard thread notices rank 0 gone while a command is
    inside MLX (a collective whose peer is gone may not return): it peeks at the connection
    and ends the process after `GUARD_SECONDS`.
    """
    reader = reader or wire.Reader()
    pending: collections.deque[wire.Message] = collections.deque(early or ())
    busy_since: list[float | None] = [None]
    done = threading.Event()
    executed, acked, last_ack = 0, 0, time.monotonic()

    def ack(seq: int, digest: str | None = None) -> None:
        nonlocal acked, last_ack
        sock.sendall(wire.encode("ack", seq=seq, bytes=follower.nbytes, digest=digest))
        acked, last_ack = seq, time.monotonic()

    def guard() -> None:
        while not done.wait(0.5):
            started = busy_since[0]
            if started is None or time.monotonic() - started < GUARD_SECONDS:
                continue
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                try:
                    gone = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone and busy_since[0] is not None:
                    fail(f"rank {rank}: lost rank 0 (the control connection closed) mid-command")

    threading.Thread(target=guard, name="group-guard", daemon=True).start()
    try:
        while True:
            if not pending:
                sock.settimeout(ACK_SECONDS if executed > acked else None)
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    ack(executed)
                    continue
                except OSError:
                    data = b""
                if not data:
                    log.error("rank %d: rank 0 closed the control connection; stopping", rank)
                    return 1
                pending.extend(reader.feed(data))
                continue
            message = pending.popleft()
            if message.op == "ping":
                sock.sendall(wire.encode("pong"))
                continue
            if message.op == "stop":
                log.info("rank %d: stopping (rank 0 stops)", rank)
                return 0
            busy_since[0] = time.monotonic()
            try:
                digest = follower.execute(message)
            except Exception as e:
                text = f"{message.op} failed: {type(e).__name__}: {e}"
                log.exception("rank %d: %s", rank, text)
                with contextlib.suppress(OSError):
                    sock.sendall(wire.encode("error", message=text))
                raise
            finally:
                busy_since[0] = None
            executed = int(message.get("seq", 0))
            if digest is not None:
                log.info("rank %d: cache index digest=%s command=%d", rank, digest, executed)
            if message.op in ("sync", "digest") or time.monotonic() - last_ack > ACK_SECONDS:
                ack(executed, digest)
    finally:
        done.set()
