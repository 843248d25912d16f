"""Forming the group: MLX's communication backend, and the control channel beside it.

`mx.distributed.init(strict=True)` joins the process group MLX is told of (`mlx.launch`
sets `MLX_RANK` and `MLX_HOSTFILE`; so can anyone, on each machine): the model's
collectives run there. Commands and their acknowledgements run on a control channel of
their own, a TCP connection from every rank to rank 0, so that rank 0 sees a rank die (its
connection closes) whatever MLX is doing, and a rank sees rank 0 go.

Rank 0 listens on its own address in the hostfile (or `OLLAMA_MLX_RUNNER_GROUP_HOST`), on a
port the system picks, and tells the others the port with one `all_sum` (the only collective
outside a forward). Each rank then connects and says hello: its rank and a key over the
hostfile and the options, which must be rank 0's. Every wait has a deadline
(`GROUP_SECONDS`): MLX's ring waits for a missing peer forever.

Before MLX's ring forms, the ranks meet (`rendezvous`): MLX's ring gives a connect to a peer
that is not listening yet five tries over 15 s, so a rank that starts more than 15 s after
its neighbours (a slow machine, a loaded one, a slow ssh) ended the group with "Couldn't
connect". Every rank first says hello on rank 0's ring address and waits for rank 0's go,
sent once all have; only then does each call `mx.distributed.init`, all within moments.
Nothing connects to a ring port once MLX listens there but MLX's own peers: no rank is
still in the rendezvous when rank 0 says go (a stray connection would be taken for a peer).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runner.distributed import wire

HOST_ENV = "OLLAMA_MLX_RUNNER_GROUP_HOST"
GROUP_SECONDS_ENV = "OLLAMA_MLX_RUNNER_GROUP_SECONDS"
DEFAULT_GROUP_SECONDS = 120.0


class GroupError(Exception):
    """The group cannot form; the message is one `Error:` line."""


def group_seconds() -> float:
    return float(os.environ.get(GROUP_SECONDS_ENV, "") or DEFAULT_GROUP_SECONDS)


@dataclass
class Joined:
    group: Any  # mx.distributed.Group
    rank: int
    size: int


def join(seconds: float) -> Joined:
    """`mx.distributed.init(strict=True)` within `seconds` (run it on the thread that will
    issue the collectives: MLX's streams are per thread)."""
    import mlx.core as mx

    if "MLX_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        raise GroupError(
            "--distributed needs a process group: start every rank under mlx.launch, or "
            "set MLX_RANK and MLX_HOSTFILE for each"
        )
    deadline = time.monotonic() + seconds
    ring = ring_nodes()
    if ring is not None:
        rendezvous(int(os.environ["MLX_RANK"]), ring, deadline, seconds)
    outcome: dict[str, Any] = {}

    def init() -> None:
        try:
            outcome["group"] = mx.distributed.init(strict=True)
        except Exception as e:  # MLX's own words: no backend, a bad hostfile
            outcome["error"] = f"{type(e).__name__}: {e}"

    # MLX's init keeps the interpreter lock while its ring waits (2026-12-07: the thread
    # that started it stopped at its next bytecode), so this join's deadline holds only
    # where the lock is given back (another backend); in a ring the rendezvous's deadline
    # is the one that holds, and MLX's own 15 s of connects after it.
    thread = threading.Thread(target=init, name="group-init", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise GroupError(
            f"the process group did not form within {seconds:g} s (rank "
            f"{os.environ.get('MLX_RANK', '?')}: every rank in MLX_HOSTFILE must be started; "
            f"{GROUP_SECONDS_ENV} sets the deadline)"
        )
    if "error" in outcome:
        raise GroupError(f"cannot join the process group: {outcome['error']}")
    group = outcome["group"]
    if group.size() < 2:
        raise GroupError("--distributed with a group of one process: run it without the flag")
    return Joined(group, group.rank(), group.size())


def ring_nodes() -> list[tuple[str, int]] | None:
    """Each rank's first address in MLX's ring hostfile, when MLX will form a ring (MLX_RANK
    and MLX_HOSTFILE set, the file a list of `ip:port` lists); None otherwise (MPI, or a
    file MLX itself will refuse with its own words)."""
    path = os.environ.get("MLX_HOSTFILE", "")
    if "MLX_RANK" not in os.environ or not path:
        return None
    try:
        with open(path) as f:
            hosts = json.load(f)
        nodes = []
        for addresses in hosts:
            host, port = str(addresses[0]).rsplit(":", 1)
            nodes.append((host, int(port)))
    except (OSError, ValueError, LookupError, TypeError):
        return None
    return nodes if len(nodes) >= 2 else None


def rendezvous(rank: int, nodes: list[tuple[str, int]], deadline: float, seconds: float) -> None:
    """Every rank meets on rank 0's ring address before MLX's ring forms (module note)."""
    size = len(nodes)
    if not 0 <= rank < size:
        return  # MLX says what is wrong with the rank
    host, port = nodes[0]
    if rank == 0:
        _gather(host, port, size, deadline, seconds)
        return
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))
            )
        except OSError:
            if time.monotonic() > deadline:
                raise GroupError(
                    f"the process group did not form within {seconds:g} s (rank {rank} cannot "
                    f"reach rank 0 at {host}:{port}; {GROUP_SECONDS_ENV} sets the deadline)"
                ) from None
            time.sleep(0.1)
            continue
        if sock.getsockname() == sock.getpeername():
            sock.close()  # TCP's self-connect: the port was free and the kernel chose it
            continue
        with sock:
            sock.sendall(wire.encode("meet", rank=rank))
            answer = _read_one(sock, deadline)
        if answer is not None and answer.op == "go":
            return
        if time.monotonic() > deadline:
            raise GroupError(
                f"the process group did not form within {seconds:g} s (rank {rank}: every "
                f"rank in MLX_HOSTFILE must be started; {GROUP_SECONDS_ENV} sets the deadline)"
            )
        # rank 0 went away before its go (it restarts, or it failed): meet again


def _gather(host: str, port: int, size: int, deadline: float, seconds: float) -> None:
    """Rank 0: a hello from every other rank on its ring address, then go to each."""
    server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((host, port))
        server.listen(64)
    except OSError as e:
        server.close()
        raise GroupError(f"cannot listen on rank 0's address {host}:{port}: {e}") from None
    met: dict[int, socket.socket] = {}
    try:
        while len(met) < size - 1:
            sock = _next_connection(
                server, size, met, deadline,
                lambda missing: f"the process group did not form within {seconds:g} s (ranks "
                f"{missing} did not start; {GROUP_SECONDS_ENV} sets the deadline)",
            )  # fmt: skip
            hello = _read_one(sock, min(deadline, time.monotonic() + 5.0))
            rank = int(hello.get("rank", -1)) if hello is not None and hello.op == "meet" else -1
            if not 0 < rank < size:
                sock.close()  # not a rank of ours
                continue
            if rank in met:
                met[rank].close()  # the same rank again: it lost its first connection
            met[rank] = sock
        # Stop listening before the first go: a rank told go connects MLX's ring to this
        # port at once, and a connection this listener's backlog took would be lost to
        # MLX (that rank would take it for its link to rank 0: both ranks then wait).
        server.close()
        for sock in met.values():
            with contextlib.suppress(OSError):
                sock.sendall(wire.encode("go"))
    finally:
        for sock in met.values():
            sock.close()
        server.close()


def rank0_host() -> str:
    """Rank 0's address: `OLLAMA_MLX_RUNNER_GROUP_HOST`, else its first in MLX_HOSTFILE."""
    host = os.environ.get(HOST_ENV, "").strip()
    if host:
        return host
    path = os.environ.get("MLX_HOSTFILE", "")
    try:
        with open(path) as f:
            hosts = json.load(f)
        first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
        if isinstance(first, dict):  # mlx.launch's JSON host lists
            first = (first.get("ips") or [first.get("ssh")])[0]
        return str(first).rsplit(":", 1)[0] if ":" in str(first) else str(first)
    except (OSError, ValueError, LookupError, TypeError):
        raise GroupError(
            f"cannot read rank 0's address from MLX_HOSTFILE ({path or 'unset'}): set {HOST_ENV}"
        ) from None


def group_key(options: str) -> str:
    """What every rank must agree on: the hostfile's bytes and the distributed options."""
    h = hashlib.sha256(options.encode())
    path = os.environ.get("MLX_HOSTFILE", "")
    if path:
        try:
            with open(path, "rb") as f:
                h.update(f.read().strip())
        except OSError:
            pass
    return h.hexdigest()[:16]


def listen(host: str) -> socket.socket:
    server = socket.create_server((host, 0), backlog=64)
    return server


def broadcast_port(joined: Joined, port: int) -> int:
    """Rank 0's port to every rank (one all_sum)."""
    import mlx.core as mx

    value = mx.array([port if joined.rank == 0 else 0], dtype=mx.int32)
    total = mx.distributed.all_sum(value, group=joined.group)
    mx.eval(total)
    return int(total.item())  # type: ignore[arg-type]


def accept(server: socket.socket, size: int, key: str, seconds: float) -> dict[int, socket.socket]:
    """Rank 0: a hello from every other rank within `seconds`."""
    deadline = time.monotonic() + seconds
    links: dict[int, socket.socket] = {}
    while len(links) < size - 1:
        sock = _next_connection(
            server, size, links, deadline,
            lambda missing: f"ranks {missing} did not connect to rank 0's control channel "
            f"within {seconds:g} s",
        )  # fmt: skip
        hello = _read_one(sock, deadline)
        if hello is None or hello.op != "hello":
            sock.close()
            continue
        rank = int(hello.get("rank", -1))
        if hello.get("key") != key:
            sock.sendall(wire.encode("refused", message="options or hostfile differ from rank 0's"))
            sock.close()
            raise GroupError(
                f"rank {rank} was started with other options or another hostfile than rank 0 "
                "(--distributed, --pipeline-split and MLX_HOSTFILE must be the same everywhere)"
            )
        if not 0 < rank < size or rank in links:
            sock.close()
            raise GroupError(f"a second rank {rank} connected to rank 0")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(wire.encode("welcome"))
        links[rank] = sock
    server.close()
    return links


def connect(host: str, port: int, rank: int, key: str, seconds: float) -> socket.socket:
    """Another rank: connect to rank 0 and say hello."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(0.1, deadline - time.monotonic())
            )
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise GroupError(f"rank {rank} cannot reach rank 0 at {host}:{port}: {e}") from None
            time.sleep(0.1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(wire.encode("hello", rank=rank, key=key))
    answer = _read_one(sock, deadline)
    if answer is None or answer.op != "welcome":
        said = answer.get("message") if answer is not None else "no answer"
        raise GroupError(f"rank 0 refused rank {rank}: {said}")
    sock.settimeout(None)
    return sock


def _next_connection(
    server: socket.socket,
    size: int,
    have: dict[int, socket.socket],
    deadline: float,
    missing_said: Callable[[list[int]], str],
) -> socket.socket:
    """Rank 0: the next connection to `server` before `deadline`; past it, a GroupError that
    names the ranks of [1, size) not in `have`."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GroupError(missing_said(sorted(set(range(1, size)) - set(have))))
        server.settimeout(left)
        try:
            return server.accept()[0]
        except TimeoutError:
            continue


def _read_one(sock: socket.socket, deadline: float) -> wire.Message | None:
    reader = wire.Reader()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            data = sock.recv(1 << 16)
        except (TimeoutError, OSError):
            return None
        if not data:
            return None
        messages = reader.feed(data)
        if messages:
            return messages[0]
