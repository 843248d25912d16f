"""The control channel's messages: a JSON header and token lists as int32, framed.

A frame is `>II` (header bytes, payload bytes), the header (a JSON object: `op` and its
fields, `lens` the lengths of the token lists) and the payload (the lists, int32
little-endian, one after another). No pickle: a frame carries ids and numbers, never code.
`Reader` turns a byte stream back into messages, however the stream is cut.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_PREFIX = struct.Struct(">II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 30


class WireError(Exception):
    """A frame that is not one this protocol writes."""


@dataclass
class Message:
    op: str
    fields: dict[str, Any] = field(default_factory=dict)
    lists: list[list[int]] = field(default_factory=list)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def encode(op: str, lists: list[list[int]] | tuple = (), **fields: Any) -> bytes:
    header = {"op": op, **fields}
    if lists:
        header["lens"] = [len(x) for x in lists]
        payload = np.concatenate([np.asarray(x, dtype="<i4").reshape(-1) for x in lists])
        body = payload.tobytes()
    else:
        body = b""
    text = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(len(text), len(body)) + text + body


def decode(header: bytes, body: bytes) -> Message:
    try:
        fields = json.loads(header)
    except ValueError as e:
        raise WireError(f"bad header: {e}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("op"), str):
        raise WireError("a header is an object with an op")
    op = fields.pop("op")
    lens = fields.pop("lens", [])
    values = np.frombuffer(body, dtype="<i4")
    if sum(lens) != len(values) or any(not isinstance(n, int) or n < 0 for n in lens):
        raise WireError("token lists do not match the payload")
    lists, at = [], 0
    for n in lens:
        lists.append(values[at : at + n].tolist())
        at += n
    return Message(op, fields, lists)


class Reader:
    """Messages from a byte stream fed in pieces."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buffer += data
        out = []
        while len(self._buffer) >= _PREFIX.size:
            head, size = _PREFIX.unpack_from(self._buffer)
            if head > MAX_HEADER or size > MAX_PAYLOAD:
                raise WireError(f"frame of {head} + {size} bytes")
            end = _PREFIX.size + head + size
            if len(self._buffer) < end:
                break
            start = _PREFIX.size
            out.append(
                decode(
                    bytes(self._buffer[start : start + head]),
                    bytes(self._buffer[start + head : end]),
                )
            )
            del self._buffer[:end]
        return out
