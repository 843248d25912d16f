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
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
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
    outcome: dict[str, Any] = {}

    def init() -> None:
        try:
            outcome["group"] = mx.distributed.init(strict=True)
        except Exception as e:  # MLX's own words: no backend, a bad hostfile
            outcome["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=init, name="group-init", daemon=True)
    thread.start()
    thread.join(seconds)
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
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(1, size)) - set(links))
            raise GroupError(
                f"ranks {missing} did not connect to rank 0's control channel within {seconds:g} s"
            )
        server.settimeout(left)
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
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
