"""JSON bodies as trees that can hold what `json.dumps` cannot write: strings given as their
exact bytes (invalid UTF-8, lone surrogates, bad escapes), any number literal, any text in
place of a value (NaN, deep nesting), duplicate keys in order. The generator mutates them;
`serialize` writes the bytes sent."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Str:
    text: str = ""
    raw: bytes | None = None  # the exact bytes between the quotes, when set

    def encode(self) -> bytes:
        if self.raw is not None:
            return b'"' + self.raw + b'"'
        return json.dumps(self.text, ensure_ascii=False).encode("utf-8", "surrogatepass")


@dataclass
class Num:
    literal: str


@dataclass
class Lit:
    literal: bytes  # true, false, null, or anything at all (NaN, deep nesting, ...)


@dataclass
class Arr:
    items: list[Any] = field(default_factory=list)


@dataclass
class Obj:
    pairs: list[tuple[Str, Any]] = field(default_factory=list)


Node = Str | Num | Lit | Arr | Obj


def to_node(value: Any) -> Any:
    if isinstance(value, dict):
        return Obj([(Str(k), to_node(v)) for k, v in value.items()])
    if isinstance(value, list):
        return Arr([to_node(v) for v in value])
    if isinstance(value, str):
        return Str(value)
    if isinstance(value, bool):
        return Lit(b"true" if value else b"false")
    if value is None:
        return Lit(b"null")
    if isinstance(value, int):
        return Num(str(value))
    if isinstance(value, float):
        return Num(repr(value))
    raise TypeError(type(value))


def serialize(node: Any, out: list[bytes] | None = None) -> bytes:
    top = out is None
    out = [] if out is None else out
    if isinstance(node, Obj):
        out.append(b"{")
        for i, (key, value) in enumerate(node.pairs):
            if i:
                out.append(b",")
            out.append(key.encode())
            out.append(b":")
            serialize(value, out)
        out.append(b"}")
    elif isinstance(node, Arr):
        out.append(b"[")
        for i, value in enumerate(node.items):
            if i:
                out.append(b",")
            serialize(value, out)
        out.append(b"]")
    elif isinstance(node, Str):
        out.append(node.encode())
    elif isinstance(node, Num):
        out.append(node.literal.encode())
    else:
        out.append(node.literal)
    return b"".join(out) if top else b""
