"""The ranks' rendezvous on rank 0's ring address before MLX's ring forms
(runner/distributed/group.py `rendezvous`), in one process over loopback: every rank meets
whichever starts first, a missing rank 0 ends the others at the deadline with one clear
line, and a connection TCP made to itself (the port free, the kernel choosing it as the
connecting end's too) is dropped rather than taken for rank 0."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from runner.distributed import group
from tools.spawned import free_port


def _rank(rank: int, nodes: list[tuple[str, int]], seconds: float, out: dict[int, Any]) -> None:
    try:
        group.rendezvous(rank, nodes, time.monotonic() + seconds, seconds)
        out[rank] = "met"
    except Exception as e:  # what the rank ended with, for the test's assertion
        out[rank] = e


def _ranks(nodes: list[tuple[str, int]], order: list[int], gap: float, seconds: float) -> dict:
    out: dict[int, Any] = {}
    threads = []
    for rank in order:
        t = threading.Thread(target=_rank, args=(rank, nodes, seconds, out), daemon=True)
        t.start()
        threads.append(t)
        time.sleep(gap)
    for t in threads:
        t.join(seconds + 5)
    return out


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0]])
def test_every_rank_meets_whichever_starts_first(order):
    nodes = [("127.0.0.1", free_port()), ("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert _ranks(nodes, order, 0.3, 20) == {0: "met", 1: "met", 2: "met"}


def test_without_rank_0_a_rank_ends_at_the_deadline():
    nodes = [("127.0.0.1", free_port()), ("127.0.0.1", 1)]
    started = time.monotonic()
    out = _ranks(nodes, [1], 0, 1.0)
    assert isinstance(out[1], group.GroupError)
    assert "did not form within 1 s" in str(out[1]) and "cannot reach rank 0" in str(out[1])
    assert time.monotonic() - started < 5


class _SelfConnected:
    """A socket whose two ends are the same address, as TCP's self-connect leaves one."""

    def __init__(self) -> None:
        self.closed = False
        self.sent: list[bytes] = []
        self.echoed = False

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", 40000)

    def getpeername(self) -> tuple[str, int]:
        return ("127.0.0.1", 40000)

    def sendall(self, data: bytes) -> None:
        self.sent.append(data)

    def settimeout(self, seconds: float) -> None:
        pass

    def recv(self, n: int) -> bytes:
        self.echoed = bool(self.sent)
        return self.sent.pop(0) if self.sent else b""  # its own words back

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> _SelfConnected:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_a_self_connected_socket_is_not_taken_for_rank_0(monkeypatch):
    """The first connection rank 1 makes is to itself: it is closed unused (nothing sent on
    it), and rank 1 meets rank 0 on the next."""
    real = socket.create_connection
    fakes: list[_SelfConnected] = []

    def create_connection(address: Any, *args: Any, **kwargs: Any) -> Any:
        if not fakes:
            fakes.append(_SelfConnected())
            return fakes[0]
        return real(address, *args, **kwargs)

    monkeypatch.setattr(group.socket, "create_connection", create_connection)
    nodes = [("127.0.0.1", free_port()), ("127.0.0.1", 1)]
    out = _ranks(nodes, [1, 0], 0.3, 20)
    assert out == {0: "met", 1: "met"}
    assert fakes and fakes[0].closed and not fakes[0].sent and not fakes[0].echoed
