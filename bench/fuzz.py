"""Fuzz the runner's HTTP surface: generated bodies against a real runner process.

    python -m bench.fuzz --bodies 10000 --seed 1 [--out DIR] [--model-dir DIR]

Writes a tiny random-weight Llama (tests/tiny.py) to a temporary directory, spawns
`python -m runner --model DIR` (tools/spawned.py) and sends it generated bodies for
`/v1/score`, `/v1/completions` and `/v1/tokenize`, one at a time, while a second thread polls
`/v1/status`. Bodies are built from docs/openapi.yaml's request schemas (field names, types,
limits) with the tiny model's vocabulary, so most are valid, and then mutated with Hypothesis:
wrong types, huge and negative numbers, integers beyond int64, NaN/Infinity literals, deep
nesting, unknown, duplicate and re-spelled keys, invalid UTF-8, lone surrogates, control
characters, trailing data, empty and truncated bodies, very long strings, `[img-N]` tags with
and without media, bad base64, bodies over the 64 MiB limit.

Checks after every body (names as in the summary and in tests/test_fuzz.py):

- `answered`: an HTTP answer came back whole (no dropped connection, no timeout);
- `no-5xx`: the status is 200 or 4xx;
- `schema`: the answer is one docs/openapi.yaml documents for the operation, and its body
  matches the schema (JSON parsed strictly: NaN/Infinity literals rejected; every line of a
  completions stream, the last one with `Done: true`);
- `no-error-line`: a completions stream carries no `Error` line;
- `alive`: the runner process is still running;
- `go-status`: the status is the one the Go runner would give. A model of Go's
  `json.NewDecoder(body).Decode(&request)` (`go_decode`: first value only, trailing data
  ignored, depth limit 10000, invalid UTF-8 and lone surrogates become U+FFFD, int fields
  must be int64 integer literals, Options numbers float32, null a no-op except for slices,
  keys folded as Go folds them, duplicate keys decoded into the same field in order) says
  whether Go rejects the body (then the answer must be 400) or what it decodes to; in that
  case the decoded request, written canonically, is sent too (a "twin") and the two
  answers must have the same status;
- `go-message`: a 400's text is the one Go's would have (`Bad Request` for a completions body
  Go cannot decode; otherwise the twin's text, the runner's own validation message).

Throughout, `/v1/status` must answer within 100 ms (`status-latency`; the worst latency and
the body in flight then are reported). A body that fails a check is written to the output
directory (`NNNNN-ENDPOINT.body`, the exact bytes sent, with `NNNNN-ENDPOINT.json`: the
checks failed, the answer, Go's verdict). The summary gives bodies by endpoint and status,
failures by check with their first bodies, the worst `/v1/status` latency and the runner's
RSS before and after. Needs `hypothesis` and `jsonschema` (the `test` extra).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import http.client
import json
import math
import multiprocessing
import os
import queue
import random
import re
import struct
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OPENAPI_PATH = REPO / "docs" / "openapi.yaml"
ENDPOINTS = ("score", "completions", "tokenize")
PATHS = {"score": "/v1/score", "completions": "/v1/completions", "tokenize": "/v1/tokenize"}
CHECKS = (
    "answered",
    "no-5xx",
    "schema",
    "no-error-line",
    "alive",
    "go-status",
    "go-message",
    "status-latency",
)
STATUS_LATENCY_LIMIT_S = 0.100
MAX_STREAM_LINES = 96  # a completions stream is read this far, then the client hangs up
REQUEST_TIMEOUT_S = 120.0
MIB = 1 << 20


# --- docs/openapi.yaml ------------------------------------------------------------------------


class StrictJSONError(ValueError):
    pass


def strict_json(text: str) -> Any:
    """JSON as Go reads it: NaN, Infinity and -Infinity are not JSON."""

    def constant(name: str) -> Any:
        raise StrictJSONError(f"non-JSON constant {name}")

    return json.loads(text, parse_constant=constant)


def _pointer(parts: list[str]) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


class OpenAPI:
    """docs/openapi.yaml: its operations, and answers checked against them."""

    URI = "urn:runner:openapi"

    def __init__(self, path: Path = OPENAPI_PATH):
        import yaml
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        self.doc: dict[str, Any] = yaml.safe_load(path.read_text())
        resource = Resource.from_contents(self.doc, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(self.URI, resource)
        self._validators: dict[str, Any] = {}

    # navigation
    def resolve(self, obj: Any, parts: list[str]) -> tuple[Any, list[str]]:
        """Follow local `$ref`s (to a fixpoint); the object and its JSON-pointer parts."""
        while isinstance(obj, dict) and "$ref" in obj and len(obj) == 1:
            ref = obj["$ref"]
            assert ref.startswith("#/"), ref
            parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
            obj = self.doc
            for p in parts:
                obj = obj[p]
        return obj, parts

    def schema(self, name: str) -> dict[str, Any]:
        return self.doc["components"]["schemas"][name]

    def operations(self) -> Iterator[tuple[str, str]]:
        for path, item in self.doc["paths"].items():
            for method in ("get", "head", "post", "put", "patch", "delete", "options"):
                if method in item:
                    yield path, method.upper()

    def validator(self, parts: list[str]) -> Any:
        from jsonschema import Draft202012Validator

        pointer = _pointer(parts)
        if pointer not in self._validators:
            self._validators[pointer] = Draft202012Validator(
                {"$ref": f"{self.URI}#{pointer}"}, registry=self.registry
            )
        return self._validators[pointer]

    def schema_errors(self, parts: list[str], value: Any) -> list[str]:
        return [
            f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"[:300]
            for e in self.validator(parts).iter_errors(value)
        ]

    # answers
    def check_answer(
        self,
        path: str,
        method: str,
        status: int,
        headers: dict[str, str],
        body: bytes,
        *,
        complete: bool = True,
        non_finite: bool = False,
    ) -> list[str]:
        """What is wrong with this answer according to the document ([] if nothing).

        `headers` keys are lower-case. `complete=False`: a stream the client stopped reading,
        so its last line need not end it. `non_finite=True`: the model's own logits are not
        finite, so a response marked `x-non-finite` may take the documented exception (an
        empty JSON body; a stream that ends before its Done line)."""
        item = self.doc["paths"].get(path)
        if item is None:
            return [f"{path} is not documented"]
        operation = item.get(method.lower())
        if operation is None:
            return [f"{method} {path} is not documented"]
        base = ["paths", path, method.lower(), "responses"]
        key = str(status) if str(status) in operation["responses"] else "default"
        if key not in operation["responses"]:
            return [f"{method} {path}: status {status} is not documented"]
        response, parts = self.resolve(operation["responses"][key], [*base, key])
        problems = []
        for name, header in (response.get("headers") or {}).items():
            header, _ = self.resolve(header, [])
            value = headers.get(name.lower())
            if value is None:
                if header.get("required"):
                    problems.append(f"header {name} missing")
                continue
            schema = header.get("schema") or {}
            if "const" in schema and value != schema["const"]:
                problems.append(f"header {name} is {value!r}, not {schema['const']!r}")
        if "x-location" in response and headers.get("location") != response["x-location"]:
            problems.append(f"Location {headers.get('location')!r}, not {response['x-location']!r}")
        content = response.get("content")
        if not content:
            if body:
                problems.append(f"status {status} documents no body, got {body[:80]!r}")
            return problems
        media = headers.get("content-type", "").split(";")[0].strip()
        exception = response.get("x-non-finite") if non_finite else None
        if exception == "empty-body" and not body:
            return problems
        if exception == "ends-early":
            complete = False
        if media not in content:
            return [*problems, f"content type {media!r} is not one of {sorted(content)}"]
        schema_parts = [*parts, "content", media, "schema"]
        if media == "text/plain":
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as e:
                return [*problems, f"text/plain body is not UTF-8: {e}"]
            return problems + self.schema_errors(schema_parts, text)
        if media == "application/jsonl":
            return problems + self._check_jsonl(schema_parts, body, complete)
        try:
            value = strict_json(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            return [*problems, f"body is not strict JSON: {e}: {body[:120]!r}"]
        if not body.endswith(b"\n"):
            problems.append("JSON body does not end with a newline")
        return problems + self.schema_errors(schema_parts, value)

    def _check_jsonl(self, parts: list[str], body: bytes, complete: bool) -> list[str]:
        problems = []
        lines = body.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif complete:
            problems.append("stream does not end with a newline")
        if complete and not lines:
            return ["empty stream"]
        values = []
        for n, line in enumerate(lines):
            try:
                value = strict_json(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                problems.append(f"line {n} is not strict JSON: {e}: {line[:120]!r}")
                continue
            values.append(value)
            problems += [f"line {n}: {p}" for p in self.schema_errors(parts, value)]
        last = values[-1] if values and isinstance(values[-1], dict) else {}
        if complete and last and last.get("Done") is not True and last.get("Error") is None:
            problems.append("the stream's last line is not Done")
        for value in values[:-1]:
            if isinstance(value, dict) and value.get("Done") is True:
                problems.append("a Done line before the end of the stream")
        return problems


@cache
def openapi() -> OpenAPI:
    return OpenAPI()


# --- JSON bodies as trees that can hold what json.dumps cannot write --------------------------


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


# --- what Go's encoding/json makes of a body ---------------------------------------------------

GO_MAX_DEPTH = 10000  # the runner's too (runner/protocol/go_json.py)
_WS = b" \t\r\n"
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_HEX4 = re.compile(rb"[0-9a-fA-F]{4}")
_ESCAPES = {
    ord('"'): '"',
    ord("\\"): "\\",
    ord("/"): "/",
    ord("b"): "\b",
    ord("f"): "\f",
    ord("n"): "\n",
    ord("r"): "\r",
    ord("t"): "\t",
}


class GoSyntaxError(ValueError):
    pass


class GoTypeError(ValueError):
    pass


def _go_rune(raw: bytes, i: int) -> tuple[str, int]:
    """utf8.DecodeRune: a valid sequence, or U+FFFD for one byte."""
    lead = raw[i]
    size = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if lead <= 0xF4 else 0
    if size and lead >= 0xC2:
        with contextlib.suppress(UnicodeDecodeError):
            return raw[i : i + size].decode("utf-8"), size
    return "\ufffd", 1


def go_unquote(raw: bytes) -> str:
    """A scanned string's contents as Go's `unquote` decodes them."""
    out: list[str] = []
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == 0x5C:
            e = raw[i + 1]
            if e != ord("u"):
                out.append(_ESCAPES[e])
                i += 2
                continue
            r = int(raw[i + 2 : i + 6], 16)
            i += 6
            if 0xD800 <= r < 0xE000:
                if r < 0xDC00 and raw[i : i + 2] == b"\\u" and _HEX4.fullmatch(raw[i + 2 : i + 6]):
                    r2 = int(raw[i + 2 : i + 6], 16)
                    if 0xDC00 <= r2 < 0xE000:
                        out.append(chr(0x10000 + ((r - 0xD800) << 10) + (r2 - 0xDC00)))
                        i += 6
                        continue
                out.append("\ufffd")
                continue
            out.append(chr(r))
        elif c < 0x80:
            out.append(chr(c))
            i += 1
        else:
            rune, size = _go_rune(raw, i)
            out.append(rune)
            i += size
    return "".join(out)


def _scan_string(b: bytes, i: int) -> tuple[str, int]:
    """b[i] is the opening quote; the decoded string and the index after the closing one."""
    j = i + 1
    n = len(b)
    while True:
        if j >= n:
            raise GoSyntaxError("unexpected end of JSON input")
        c = b[j]
        if c == 0x22:
            return go_unquote(b[i + 1 : j]), j + 1
        if c < 0x20:
            raise GoSyntaxError("invalid character in string literal")
        if c == 0x5C:
            if j + 1 >= n:
                raise GoSyntaxError("unexpected end of JSON input")
            e = b[j + 1]
            if e == ord("u"):
                if not _HEX4.fullmatch(b[j + 2 : j + 6]):
                    raise GoSyntaxError("invalid character in \\u hexadecimal escape")
                j += 6
            elif e in _ESCAPES:
                j += 2
            else:
                raise GoSyntaxError("invalid character in string escape code")
        else:
            j += 1


def _skip_ws(b: bytes, i: int) -> int:
    while i < len(b) and b[i] in _WS:
        i += 1
    return i


def go_scan(b: bytes) -> Any:
    """The first JSON value of `b` as Go's json.Decoder reads it (whatever follows is never
    read), as a tree: ("obj", [(key, node)...]), ("arr", [...]), ("str", s), ("num", literal),
    ("bool", b), ("null",). Raises GoSyntaxError (`EOF` for nothing but whitespace)."""
    i = _skip_ws(b, 0)
    if i >= len(b):
        raise GoSyntaxError("EOF")
    stack: list[list[Any]] = []  # ["obj", pairs, key] or ["arr", items]
    n = len(b)
    go_scan.deepest = 0  # type: ignore[attr-defined]  (the nesting the last scan reached)
    while True:
        # a value starts at i
        if i >= n:
            raise GoSyntaxError("unexpected EOF")
        c = b[i]
        value: Any
        if c in b"{[":
            if len(stack) + 1 > GO_MAX_DEPTH:
                raise GoSyntaxError(f"invalid character {chr(c)!r} exceeded max depth")
            go_scan.deepest = max(go_scan.deepest, len(stack) + 1)  # type: ignore[attr-defined]
            i = _skip_ws(b, i + 1)
            if i < n and b[i] == (0x7D if c == 0x7B else 0x5D):
                value = ("obj", []) if c == 0x7B else ("arr", [])
                i += 1
            elif c == 0x7B:
                if i >= n or b[i] != 0x22:
                    raise GoSyntaxError("looking for beginning of object key string")
                key, i = _scan_string(b, i)
                i = _skip_ws(b, i)
                if i >= n or b[i] != 0x3A:
                    raise GoSyntaxError("after object key")
                i = _skip_ws(b, i + 1)
                stack.append(["obj", [], key])
                continue
            else:
                stack.append(["arr", []])
                continue
        elif c == 0x22:
            text, i = _scan_string(b, i)
            value = ("str", text)
        elif c == 0x2D or 0x30 <= c <= 0x39:
            m = _NUMBER.match(b, i)
            if m is None:
                raise GoSyntaxError("in numeric literal")
            value = ("num", m.group().decode())
            i = m.end()
        elif b.startswith(b"true", i):
            value, i = ("bool", True), i + 4
        elif b.startswith(b"false", i):
            value, i = ("bool", False), i + 5
        elif b.startswith(b"null", i):
            value, i = ("null",), i + 4
        else:
            raise GoSyntaxError(f"invalid character {chr(c)!r} looking for beginning of value")
        # attach the value to its parents, closing them as far as they end
        while True:
            if not stack:
                return value
            frame = stack[-1]
            i = _skip_ws(b, i)
            if i >= n:
                raise GoSyntaxError("unexpected EOF")
            c = b[i]
            if frame[0] == "obj":
                frame[1].append((frame[2], value))
                if c == 0x2C:
                    i = _skip_ws(b, i + 1)
                    if i >= n or b[i] != 0x22:
                        raise GoSyntaxError("looking for beginning of object key string")
                    frame[2], i = _scan_string(b, i)
                    i = _skip_ws(b, i)
                    if i >= n or b[i] != 0x3A:
                        raise GoSyntaxError("after object key")
                    i = _skip_ws(b, i + 1)
                    break
                if c != 0x7D:
                    raise GoSyntaxError("after object key:value pair")
                stack.pop()
                value = ("obj", frame[1])
                i += 1
            else:
                frame[1].append(value)
                if c == 0x2C:
                    i = _skip_ws(b, i + 1)
                    break
                if c != 0x5D:
                    raise GoSyntaxError("after array element")
                stack.pop()
                value = ("arr", frame[1])
                i += 1


# Go types, read off docs/openapi.yaml: ("str",), ("int",), ("f32",), ("bool",), ("bytes",),
# ("uint8",), ("slice", elem), ("struct", name, {canonical key: type}, fold).


def go_fold(key: str) -> str:
    """encoding/json's foldName for ASCII field names: ASCII case folded, and the two
    non-ASCII runes whose fold orbit holds an ASCII letter (U+017F ſ ~ s, U+212A K ~ k)."""
    return "".join(
        c.upper() if c < "\x80" else {"\u017f": "S", "\u212a": "K"}.get(c, c) for c in key
    )


def score_fold(key: str) -> str:
    return go_fold(key.replace("_", ""))


def go_type(api: OpenAPI, schema: dict[str, Any], fold: Callable[[str], str], name: str) -> Any:
    schema, parts = api.resolve(schema, [])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind == "object":
        fields = {
            key: go_type(api, sub, fold, key) for key, sub in schema.get("properties", {}).items()
        }
        return ("struct", parts[-1] if parts else name, fields, fold)
    if kind == "array":
        return ("slice", go_type(api, schema["items"], fold, name))
    if kind == "string":
        return ("bytes",) if schema.get("contentEncoding") == "base64" else ("str",)
    if kind == "integer":
        return ("int",)
    if kind == "number":
        return ("f32",) if schema.get("format") == "float" else ("f64",)
    if kind == "boolean":
        return ("bool",)
    raise ValueError(f"no Go type for {schema}")


@cache
def request_types() -> dict[str, Any]:
    api = openapi()
    return {
        "score": go_type(api, api.schema("ScoreRequest"), score_fold, "ScoreRequest"),
        "completions": go_type(api, api.schema("CompletionRequest"), go_fold, "CompletionRequest"),
    }


class GoSlice(list):
    """A decoded slice; `stale` is what lies between its length and capacity, which Go's
    decoder reuses when a later duplicate key decodes a longer array into it."""

    stale: list[Any]

    def __init__(self, items=(), stale=()):
        super().__init__(items)
        self.stale = list(stale)


F32_OVERFLOW = Fraction(2**128 - 2**103)  # |x| at or above this rounds to float32 infinity


_DECIMAL = re.compile(r"(-?)([0-9]+)(?:\.([0-9]+))?(?:[eE]([+-]?[0-9]+))?")
FLOAT32_MAX = struct.unpack("f", struct.pack("I", 0x7F7FFFFF))[0]


def _f32(literal: str) -> float:
    """strconv.ParseFloat(literal, 32): rounded to float32; out of range is an error."""
    sign, whole, frac, exp = _DECIMAL.fullmatch(literal).groups()
    digits = whole + (frac or "")
    first = len(digits) - len(digits.lstrip("0"))
    if first == len(digits):
        return -0.0 if sign else 0.0
    magnitude = len(whole) - first - 1 + int(exp or 0)  # of the leading digit
    if magnitude > 40:
        raise GoTypeError("float32 overflow")
    if magnitude < -60:
        return -0.0 if sign else 0.0
    value = Fraction(literal)
    if abs(value) >= F32_OVERFLOW:
        raise GoTypeError("float32 overflow")
    try:
        return struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:  # float64 rounding reached the threshold; float32 rounds down
        return math.copysign(FLOAT32_MAX, float(value))


def _go_zero(typ: Any) -> Any:
    kind = typ[0]
    if kind == "struct":
        return {}
    if kind in ("slice", "bytes"):
        return None
    return {"str": "", "int": 0, "uint8": 0, "f32": 0.0, "f64": 0.0, "bool": False}[kind]


def _go_base64(text: str) -> bytes:
    """base64.StdEncoding.Decode: padded, CR and LF ignored, trailing bits not checked."""
    text = text.replace("\r", "").replace("\n", "")
    alphabet = re.compile(r"[A-Za-z0-9+/]*")
    if len(text) % 4:
        raise GoTypeError("illegal base64 data")
    body = text.rstrip("=")
    pad = len(text) - len(body)
    if pad > 2 or not alphabet.fullmatch(body) or (pad and len(body) % 4 not in (2, 3)):
        raise GoTypeError("illegal base64 data")
    return base64.b64decode(body + "=" * (-len(body) % 4) if body else "")


def go_decode(node: Any, typ: Any, existing: Any) -> Any:
    """Decode a scanned node into a value of Go type `typ` that holds `existing`."""
    kind, tag = typ[0], node[0]
    if tag == "null":
        return None if kind in ("slice", "bytes") else existing
    if kind == "struct":
        if tag != "obj":
            raise GoTypeError(f"cannot unmarshal {tag} into {typ[1]}")
        _, _, fields, fold = typ
        folded = {fold(k): k for k in fields}
        result = dict(existing or {})
        for key, value in node[1]:
            name = key if key in fields else folded.get(fold(key))
            if name is None:
                continue
            ftype = fields[name]
            current = result.get(name, _go_zero(ftype))
            result[name] = go_decode(value, ftype, current)
        return result
    if kind == "slice" or (kind == "bytes" and tag == "arr"):
        if tag != "arr":
            raise GoTypeError(f"cannot unmarshal {tag} into a slice")
        elem = typ[1] if kind == "slice" else ("uint8",)
        old = [] if existing is None else list(existing) + list(getattr(existing, "stale", []))
        if kind == "bytes" and isinstance(existing, bytes):
            old = list(existing)
        items = [
            go_decode(item, elem, old[i] if i < len(old) else _go_zero(elem))
            for i, item in enumerate(node[1])
        ]
        if kind == "bytes":
            return bytes(items)
        return GoSlice(items, old[len(items) :] if items else [])
    if kind == "bytes":
        if tag != "str":
            raise GoTypeError(f"cannot unmarshal {tag} into []byte")
        return _go_base64(node[1])
    if kind == "str":
        if tag != "str":
            raise GoTypeError(f"cannot unmarshal {tag} into string")
        return node[1]
    if kind == "bool":
        if tag != "bool":
            raise GoTypeError(f"cannot unmarshal {tag} into bool")
        return node[1]
    if tag != "num":
        raise GoTypeError(f"cannot unmarshal {tag} into a number")
    literal = node[1]
    if kind in ("int", "uint8"):
        if not re.fullmatch(r"-?(0|[1-9][0-9]*)", literal):
            raise GoTypeError(f"cannot unmarshal number {literal} into int")
        value = int(literal)
        low, high = (-(2**63), 2**63 - 1) if kind == "int" else (0, 255)
        if not low <= value <= high:
            raise GoTypeError(f"cannot unmarshal number {literal} into {kind}")
        return value
    if kind == "f32":
        return _f32(literal)
    value = float(literal)
    if math.isinf(value):
        raise GoTypeError("float64 overflow")
    return value


def _canonical_value(value: Any, typ: Any, keep_zero: bool = False) -> Any:
    kind = typ[0]
    if kind == "struct":
        out = {}
        for name, ftype in typ[2].items():
            v = (value or {}).get(name, _go_zero(ftype))
            if v is None or (v == _go_zero(ftype) and not keep_zero and ftype[0] != "struct"):
                continue
            out[name] = _canonical_value(v, ftype)
        return out
    if kind == "slice":
        return [_canonical_value(v, typ[1], keep_zero=True) for v in value]
    if kind == "bytes":
        return base64.b64encode(value).decode()
    return value


@dataclass(frozen=True)
class GoVerdict:
    ok: bool
    error: str = ""
    canonical: bytes | None = None  # the decoded request, written plainly
    depth: int = 0  # the nesting the body's first value reaches


def go_verdict(endpoint: str, body: bytes) -> GoVerdict:
    """What the Go runner's `json.NewDecoder(body).Decode(&request)` makes of `body`."""
    typ = request_types()[endpoint]
    try:
        node = go_scan(body)
        value = {} if node[0] == "null" else go_decode(node, typ, {})
    except (GoSyntaxError, GoTypeError) as e:
        return GoVerdict(False, str(e))
    canonical = json.dumps(_canonical_value(value, typ), ensure_ascii=False, allow_nan=False)
    return GoVerdict(True, canonical=canonical.encode("utf-8"), depth=go_scan.deepest)  # type: ignore[attr-defined]


# --- generation ---------------------------------------------------------------------------------

# The tiny model's text (tests/tiny.py CORPUS): these tokenize to a few tokens each, and the
# candidates are (mostly) single tokens after them.
# fmt: off
PREFIXES = (
    "",
    "Answer with Yes or No.\n",
    "The quick brown fox jumps over the lazy dog. A small model reads a short story.\n",
    "Is the sky blue? Yes. Is grass red? No. Is it? Yes. Is it? No.\n" * 3,
)
QUESTIONS = (
    "Is the sky blue?", "Is grass red?", "Is it?", "Answer: A, B, C or", "The cat sat on the",
    "Q: Is the sea wet?\nA:", "Numbers like 1, 2, 3 and", "names such as Alice, Bob and",
    "The dog slept by the",
)
CANDIDATES = (
    " Yes", " No", " A", " B", " C", " D", " the", " a", " is", " sky", " blue", "?", "!", ".",
    ",", " Yes.", "<|im_end|>", "", " ",
)
KEYS_UNKNOWN = ("x", "model", "stream", "format", "foo_bar", "Images", "rows_", "", "🙂", "num")
EDGE_NUMBERS = (
    "0", "-0", "1", "-1", "2", "7", "26", "27", "64", "65", "255", "256", "2047", "2048", "2049",
    "2147483647", "2147483648", "-2147483649", "4294967296", "9007199254740993",
    "9223372036854775807", "-9223372036854775808", "9223372036854775808",
    "-9223372036854775809", "18446744073709551615", "18446744073709551616",
    "100000000000000000000000000000", "1.0", "0.5", "-0.0", "1e2", "1E+2", "1e-7",
    "3.4028234663852886e38", "3.4028235e38", "3.4028236e38", "3.5e38", "1e39",
    "1.7976931348623157e308", "1e308", "1e309", "4.9e-324", "1e-400", "-1e39", "0.1", "1e400",
)
OVERFLOW_INTS = (
    "9223372036854775808", "-9223372036854775809", "18446744073709551615",
    "18446744073709551616", "99999999999999999999999", "-99999999999999999999999", "1" + "0" * 60,
)
NON_FINITE = (b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"1e999", b"-1e999")
INVALID_UTF8 = (
    b"\xff", b"\xfe", b"\x80", b"\xc3", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xed\xbf\xbf",
    b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xf0\x9f\x98", b"\xf8\x88\x80\x80\x80",
)
SURROGATES = (
    b"\\ud800", b"\\udc00", b"\\uDFFF", b"\\udbff", b"\\ud83d\\u0041", b"\\ud83d\\ude00",
    b"\\ud800\\ud800", b"\\udc00\\ud800",
)
BAD_ESCAPES = (b"\\x41", b"\\U0041", b"\\u12", b"\\u12G4", b"\\a", b"\\'", b"\\")
CONTROL = (b"\x00", b"\x01", b"\t", b"\n", b"\r", b"\x1b", b"\x1f", b"\\u0000", b"\\u001f", b"\x7f")
TRAILING = (
    b" x", b"{}", b"}", b"]", b'\n{"a":1}', b"garbage", b"\x00", b",", b"\xff", b"   null", b"\n",
    b"\r\n\t ", b"[", b'"', b"0", b'{"Prompt":"other"}',
)
EMPTY_BODIES = (
    b"", b" ", b"\n\t\r ", b"null", b" null ", b"{}", b"[]", b"0", b'""', b"true", b"nul", b"{",
    b"[", b"\xef\xbb\xbf{}", b"[{}]", b"nullx", b"{}}", b"\x00",
)
BAD_BASE64 = (
    "!!!!", "aGk", "aGk=\n", "a===", "====", "aGk=aGk=", "aGVsbG8", " aGk=", "aGk=\r\n", "YQ",
    "_-_-", "aGk\u00e9", "aG k=", "aGk==", "=aGk",
)
GOOD_BASE64 = ("", "aGk=", "iVBORw0KGgo=", "AAAA", "aGVs\nbG8=")
KINDS = ("image", "audio", "", "video", "IMAGE")
DEEP_DEPTHS = (32, 500, 999, 1000, 1001, 2000, 5000, 9998, 10001, 50000)
LONG_LENGTHS = (1_000, 10_000, 100_000, 1_000_000)
COMMON_MUTATIONS = (
    "wrong-type", "number-edge", "int64-overflow", "non-finite", "deep-nesting", "unknown-keys",
    "duplicate-key", "key-spelling", "key-escape", "invalid-utf8", "lone-surrogate",
    "control-char", "bad-escape", "trailing-data", "empty-body", "long-string", "img-tags",
    "bad-base64", "truncate", "whitespace", "null-member", "null-element",
)
MUTATIONS = {
    "score": (*COMMON_MUTATIONS, "limits"),
    "completions": (*COMMON_MUTATIONS, "key-fold"),  # /v1/score's own key matching: unknown
}
TYPICAL = {  # values a client sends, per Options field (the schema gives the type)
    "temperature": ("0", "0.0", "0.7", "1", "1.5"),
    "top_k": ("0", "1", "5", "40"),
    "top_p": ("0", "0.5", "0.9", "1"),
    "min_p": ("0", "0.05", "0.5"),
    "typical_p": ("0", "1"),
    "seed": ("-1", "0", "42", "123456789"),
    "num_predict": ("1", "2", "4", "8"),
    "repeat_last_n": ("-1", "0", "8", "64"),
    "repeat_penalty": ("0", "1", "1.1", "2"),
    "presence_penalty": ("0", "0.5", "-0.5"),
    "frequency_penalty": ("0", "0.5", "-0.5"),
    "num_ctx": ("0", "2048", "4096"),
}
# fmt: on


@dataclass
class Case:
    endpoint: str
    body: bytes
    tags: tuple[str, ...] = ()
    pad_to: int = 0  # > 0: the prompt is padded so the body is this long (sent lazily)

    def materialize(self) -> bytes:
        if not self.pad_to:
            return self.body
        marker = b"@@PAD@@"
        assert marker in self.body
        return self.body.replace(marker, b"x" * (self.pad_to - len(self.body) + len(marker)), 1)


def _choice(draw: Any, options: Any) -> Any:
    from hypothesis import strategies as st

    return draw(st.sampled_from(list(options)))


def _spelled(rnd: random.Random, key: str, endpoint: str) -> str:
    """Another spelling of `key` that the runner (and Go) must read as the same key."""
    options = [
        key,
        key.lower(),
        key.upper(),
        "".join(rnd.choice((c.lower(), c.upper())) for c in key),
    ]
    if endpoint == "score":
        bare = key.replace("_", "")
        options += [
            bare,
            bare.upper(),
            "_" + key,
            key + "_",
            key.replace("_", "__"),
            "Max" + bare[3:] if bare.startswith("max") else bare,
        ]
    return rnd.choice(options)


class Generator:
    """Bodies from docs/openapi.yaml's request schemas, mutated."""

    def __init__(
        self,
        api: OpenAPI | None = None,
        *,
        allow_oversize: bool = True,
        long_lengths: tuple[int, ...] = LONG_LENGTHS,
    ):
        self.api = api or openapi()
        self.allow_oversize = allow_oversize
        self.long_lengths = long_lengths
        self.options = self.api.schema("Options")["properties"]

    # base documents
    def _text(self, rnd: random.Random) -> str:
        return rnd.choice(PREFIXES) + rnd.choice(QUESTIONS)

    def score_doc(self, draw: Any, rnd: random.Random) -> Obj:
        from hypothesis import strategies as st

        row_schema = self.api.schema("ScoreRow")["properties"]
        req = self.api.schema("ScoreRequest")["properties"]
        rows_max = req["rows"]["maxItems"]
        cand_max = row_schema["candidates"]["maxItems"]
        n_rows = draw(st.one_of(st.integers(1, 4), st.integers(1, rows_max)))
        prefix = rnd.choice(PREFIXES)
        rows = []
        for _ in range(n_rows):
            n_cand = min(cand_max, rnd.choice((1, 2, 2, 3, 4, rnd.randint(1, cand_max))))
            cands = rnd.sample(CANDIDATES[:15], min(n_cand, 15))
            if rnd.random() < 0.1:
                cands.append(rnd.choice(CANDIDATES))
            prompt = prefix + rnd.choice(QUESTIONS) if rnd.random() < 0.8 else self._text(rnd)
            rows.append(
                Obj(
                    [
                        (Str(_spelled(rnd, "prompt", "score")), Str(prompt)),
                        (Str(_spelled(rnd, "candidates", "score")), Arr([Str(c) for c in cands])),
                    ]
                )
            )
        max_tokens = _choice(draw, ("64", "512", "2048", "128", "16", "1", "3"))
        pairs = [
            (Str(_spelled(rnd, "rows", "score")), Arr(rows)),
            (Str(_spelled(rnd, "max_tokens", "score")), Num(max_tokens)),
        ]
        rnd.shuffle(pairs)
        return Obj(pairs)

    def completions_doc(self, draw: Any, rnd: random.Random) -> Obj:
        pairs: list[tuple[Str, Any]] = [
            (Str(_spelled(rnd, "Prompt", "completions")), Str(self._text(rnd)))
        ]
        options = []
        for name in rnd.sample(sorted(self.options), rnd.randint(0, 6)):
            schema = self.options[name]
            kind = schema["type"]
            if name == "num_predict" or (name not in TYPICAL and kind in ("integer", "number")):
                value: Any = Num(rnd.choice(TYPICAL.get(name, ("0", "1", "4"))))
            elif name in TYPICAL:
                value = Num(rnd.choice(TYPICAL[name]))
            elif kind == "boolean":
                value = Lit(rnd.choice((b"true", b"false")))
            elif kind == "array":
                value = Arr(
                    [Str(rnd.choice(("\n", "Q:", "</s>", ""))) for _ in range(rnd.randint(0, 3))]
                )
            else:
                continue
            options.append((Str(_spelled(rnd, name, "completions")), value))
        # num_predict small unless a mutation says otherwise: a whole context takes seconds
        if not any(k.text.lower() == "num_predict" for k, _ in options):
            options.append((Str("num_predict"), Num(rnd.choice(TYPICAL["num_predict"]))))
        pairs.append((Str(_spelled(rnd, "Options", "completions")), Obj(options)))
        if rnd.random() < 0.3:
            pairs.append((Str(_spelled(rnd, "Logprobs", "completions")), Lit(b"true")))
            pairs.append(
                (
                    Str(_spelled(rnd, "TopLogprobs", "completions")),
                    Num(str(rnd.choice((0, 1, 5, 20)))),
                ),
            )
        rnd.shuffle(pairs)
        return Obj(pairs)

    # tokenize: raw text
    def tokenize_case(self, draw: Any, rnd: random.Random) -> Case:
        from hypothesis import strategies as st

        kind = _choice(
            draw,
            (
                "text",
                "unicode",
                "bytes",
                "invalid-utf8",
                "long-string",
                "empty-body",
                "special",
                "json",
            ),
        )
        if kind == "text":
            body = self._text(rnd).encode()
        elif kind == "unicode":
            body = draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
        elif kind == "bytes":
            body = draw(st.binary(max_size=300))
        elif kind == "invalid-utf8":
            text = self._text(rnd).encode()
            cut = rnd.randint(0, len(text))
            body = text[:cut] + rnd.choice(INVALID_UTF8) + text[cut:]
        elif kind == "long-string":
            body = (rnd.choice(QUESTIONS) + " ").encode() * (rnd.choice(self.long_lengths) // 16)
        elif kind == "empty-body":
            body = rnd.choice((b"", b" ", b"\n", b"\x00"))
        elif kind == "special":
            body = rnd.choice(
                ("<|im_end|>", "<|endoftext|>Is it?", "[img-0] Is it?", "<|im_start|>user")
            ).encode()
        else:
            body = rnd.choice((*EMPTY_BODIES, b'{"rows":[]}'))
        return Case("tokenize", body, (kind,))

    # mutations on the tree
    @staticmethod
    def _walk(node: Any, path: tuple = ()) -> Iterator[tuple[Any, Any, Any, tuple]]:
        """(container, index, child, path) for every value below `node`."""
        if isinstance(node, Obj):
            for i, (key, value) in enumerate(node.pairs):
                yield node, i, value, (*path, key.text.lower())
                yield from Generator._walk(value, (*path, key.text.lower()))
        elif isinstance(node, Arr):
            for i, value in enumerate(node.items):
                yield node, i, value, (*path, i)
                yield from Generator._walk(value, (*path, i))

    @staticmethod
    def _replace(container: Any, index: int, value: Any) -> None:
        if isinstance(container, Obj):
            container.pairs[index] = (container.pairs[index][0], value)
        else:
            container.items[index] = value

    def _random_value(self, rnd: random.Random, depth: int = 0) -> Any:
        kind = rnd.choice(
            ("str", "num", "lit", "arr", "obj") if depth < 3 else ("str", "num", "lit")
        )
        if kind == "str":
            return Str(rnd.choice(("", "x", "Is it?", "[img-0]", "\u00e9\U0001f600")))
        if kind == "num":
            return Num(rnd.choice(EDGE_NUMBERS))
        if kind == "lit":
            return Lit(rnd.choice((b"true", b"false", b"null")))
        if kind == "arr":
            return Arr([self._random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))])
        return Obj(
            [
                (Str(rnd.choice(KEYS_UNKNOWN)), self._random_value(rnd, depth + 1))
                for _ in range(rnd.randint(0, 3))
            ]
        )

    def _insert_raw(self, rnd: random.Random, node: Str, insert: bytes) -> None:
        raw = node.raw if node.raw is not None else node.encode()[1:-1]
        cut = rnd.randint(0, len(raw))
        while cut and raw[cut - 1 : cut] == b"\\":  # never split an escape
            cut -= 1
        node.raw = raw[:cut] + insert + raw[cut:]

    def mutate(
        self, endpoint: str, doc: Obj, name: str, draw: Any, rnd: random.Random
    ) -> bytes | None:
        """Apply mutation `name` to `doc` in place; a whole body when it replaces the tree."""
        values = list(self._walk(doc))
        strings = [v for v in values if isinstance(v[2], Str)]
        numbers = [v for v in values if isinstance(v[2], Num)]
        objects = [doc] + [v[2] for v in values if isinstance(v[2], Obj)]
        arrays = [v[2] for v in values if isinstance(v[2], Arr)]
        if name == "wrong-type" and values:
            container, index, _, _ = rnd.choice(values)
            self._replace(container, index, self._random_value(rnd))
        elif name == "number-edge" and numbers:
            container, index, _, _ = rnd.choice(numbers)
            self._replace(container, index, Num(_choice(draw, EDGE_NUMBERS)))
        elif name == "int64-overflow":
            ints = [v for v in numbers if re.fullmatch(r"-?\d+", v[2].literal)] or numbers
            if ints:
                container, index, _, _ = rnd.choice(ints)
                self._replace(container, index, Num(_choice(draw, OVERFLOW_INTS)))
        elif name == "non-finite" and values:
            container, index, _, _ = rnd.choice(numbers or values)
            self._replace(container, index, Lit(_choice(draw, NON_FINITE)))
        elif name == "deep-nesting":
            depth = _choice(draw, DEEP_DEPTHS)
            style = rnd.choice(("arr", "obj", "mixed"))
            if style == "arr":
                nested = b"[" * depth + b"]" * depth
            elif style == "obj":
                nested = b'{"a":' * depth + b"1" + b"}" * depth
            else:
                nested = b'[{"a":' * (depth // 2) + b"null" + b"}]" * (depth // 2)
            target = rnd.choice(objects)
            target.pairs.insert(
                rnd.randint(0, len(target.pairs)), (Str(rnd.choice(KEYS_UNKNOWN)), Lit(nested))
            )
        elif name == "unknown-keys":
            for _ in range(rnd.randint(1, 4)):
                target = rnd.choice(objects)
                target.pairs.insert(
                    rnd.randint(0, len(target.pairs)),
                    (Str(rnd.choice(KEYS_UNKNOWN)), self._random_value(rnd)),
                )
        elif name == "duplicate-key":
            candidates = [o for o in objects if o.pairs]
            if candidates:
                target = rnd.choice(candidates)
                key, value = rnd.choice(target.pairs)
                again = rnd.choice(
                    (Lit(b"null"), copy.deepcopy(value), self._random_value(rnd), Arr([]), Obj([]))
                )
                spelling = Str(_spelled(rnd, key.text, endpoint))
                target.pairs.insert(rnd.randint(0, len(target.pairs)), (spelling, again))
        elif name == "key-spelling":
            candidates = [o for o in objects if o.pairs]
            if candidates:
                target = rnd.choice(candidates)
                i = rnd.randrange(len(target.pairs))
                key, value = target.pairs[i]
                target.pairs[i] = (Str(_spelled(rnd, key.text, endpoint)), value)
        elif name == "key-fold":  # Go folds ſ to s and K (Kelvin) to k; see go_fold
            candidates = [
                (o, i)
                for o in objects
                for i, (k, _) in enumerate(o.pairs)
                if re.search("[sSkK]", k.text)
            ]
            if candidates:
                target, i = rnd.choice(candidates)
                key, value = target.pairs[i]
                folded = (
                    re.sub("[sS]", "\u017f", key.text, count=1)
                    if rnd.random() < 0.5 or not re.search("[kK]", key.text)
                    else re.sub("[kK]", "\u212a", key.text, count=1)
                )
                target.pairs[i] = (Str(folded), value)
        elif name == "key-escape":
            candidates = [o for o in objects if o.pairs]
            if candidates:
                target = rnd.choice(candidates)
                i = rnd.randrange(len(target.pairs))
                key, value = target.pairs[i]
                raw = "".join(f"\\u{ord(c):04x}" if rnd.random() < 0.5 else c for c in key.text)
                target.pairs[i] = (Str(key.text, raw=raw.encode("utf-8", "surrogatepass")), value)
        elif name in ("invalid-utf8", "lone-surrogate", "control-char", "bad-escape"):
            targets = strings + [(None, None, k, ()) for o in objects for k, _ in o.pairs]
            if targets:
                pool = {
                    "invalid-utf8": INVALID_UTF8,
                    "lone-surrogate": SURROGATES,
                    "control-char": CONTROL,
                    "bad-escape": BAD_ESCAPES,
                }[name]
                self._insert_raw(rnd, rnd.choice(targets)[2], _choice(draw, pool))
        elif name == "long-string" and strings:
            length = _choice(draw, self.long_lengths)
            unit = rnd.choice(("x", " the", "Is the sky blue? ", "\u00e9", "\U0001f600", "[img-0]"))
            container, index, _, _ = rnd.choice(strings)
            self._replace(container, index, Str(unit * max(1, length // len(unit))))
        elif name == "img-tags":
            prompts = [v for v in strings if v[3] and v[3][-1] in ("prompt",)]
            for container, index, node, _ in prompts[: rnd.randint(1, 3)]:
                tag = f"[img-{rnd.choice(('0', '1', '-1', '99999999999999999999', 'x', ''))}]"
                self._replace(
                    container,
                    index,
                    Str(
                        rnd.choice((tag + node.text, node.text + tag, node.text + " " + tag + " ?"))
                    ),
                )
            if rnd.random() < 0.6:
                doc.pairs.append(self._media(endpoint, rnd, GOOD_BASE64))
        elif name == "bad-base64":
            doc.pairs.append(self._media(endpoint, rnd, BAD_BASE64))
        elif name == "null-member" and values:
            container, index, _, _ = rnd.choice(values)
            self._replace(container, index, Lit(b"null"))
        elif name == "null-element" and arrays:
            target = rnd.choice(arrays)
            target.items.insert(rnd.randint(0, len(target.items)), Lit(b"null"))
        elif name == "limits" and endpoint == "score":
            rows = [
                v[2] for v in values if isinstance(v[2], Arr) and v[3] and v[3][-1] in ("rows",)
            ]
            cands = [
                v[2] for v in values if isinstance(v[2], Arr) and v[3] and v[3][-1] == "candidates"
            ]
            if rows and (rnd.random() < 0.5 or not cands):
                n = _choice(draw, (0, 63, 64, 65, 100))
                rows[0].items = (
                    [copy.deepcopy(rows[0].items[i % max(1, len(rows[0].items))]) for i in range(n)]
                    if rows[0].items
                    else []
                )
            elif cands:
                n = _choice(draw, (0, 25, 26, 27, 40))
                cands[0].items = [Str(c) for c in (CANDIDATES * 3)[:n]]
        return None

    def _media(self, endpoint: str, rnd: random.Random, data: tuple[str, ...]) -> tuple[Str, Any]:
        items = []
        for _ in range(rnd.choice((0, 1, 1, 2))):
            item = [(Str("data"), Str(rnd.choice(data)))]
            if rnd.random() < 0.8:
                item.append(
                    (Str("id"), Num(rnd.choice(("0", "1", "-1", "7", "9223372036854775808"))))
                )
            if rnd.random() < 0.8:
                item.append((Str(rnd.choice(("Kind", "kind", "KIND"))), Str(rnd.choice(KINDS))))
            items.append(Obj(item))
        key = "media" if endpoint == "score" else "Media"
        return Str(_spelled(rnd, key, endpoint)), Arr(items)

    def case(self, draw: Any) -> Case:
        from hypothesis import strategies as st

        endpoint = _choice(draw, ("score",) * 9 + ("completions",) * 8 + ("tokenize",) * 3)
        # Bulk content comes from a seeded Random: Hypothesis draws structure and edge values
        # (its integers favour boundaries, so counts hit 1 and 64), the Random the text.
        rnd = random.Random(draw(st.integers(0, 2**64 - 1)))
        if endpoint == "tokenize":
            return self.tokenize_case(draw, rnd)
        doc = self.score_doc(draw, rnd) if endpoint == "score" else self.completions_doc(draw, rnd)
        count = _choice(draw, (0, 0, 1, 1, 1, 1, 2, 2, 3))
        names = [rnd.choice(MUTATIONS[endpoint]) for _ in range(count)]
        body_level = {"trailing-data", "empty-body", "truncate", "whitespace"}
        for name in names:
            if name not in body_level:
                self.mutate(endpoint, doc, name, draw, rnd)
        body = serialize(doc)
        for name in names:
            if name == "trailing-data":
                body += _choice(draw, TRAILING)
            elif name == "empty-body":
                body = _choice(draw, EMPTY_BODIES)
            elif name == "truncate" and body:
                body = body[: rnd.randrange(len(body))]
            elif name == "whitespace":
                ws = rnd.choice((b" ", b"\n", b"\t\r\n ", b"\xef\xbb\xbf", b"\x0c"))
                body = ws + body if rnd.random() < 0.5 else body + ws
        pad_to = 0
        if self.allow_oversize and rnd.random() < 0.001:  # over the 64 MiB limit
            names.append("oversize")
            pad_to = 64 * MIB + rnd.choice((1, 4096))
            key = "prompt" if endpoint == "score" else "Prompt"
            doc = (
                Obj([(Str(key), Str("@@PAD@@"))])
                if endpoint == "completions"
                else Obj(
                    [
                        (
                            Str("rows"),
                            Arr(
                                [
                                    Obj(
                                        [
                                            (Str(key), Str("@@PAD@@")),
                                            (Str("candidates"), Arr([Str(" Yes")])),
                                        ]
                                    )
                                ]
                            ),
                        ),
                        (Str("max_tokens"), Num("64")),
                    ]
                )
            )
            body = serialize(doc)
        return Case(endpoint, body, tuple(names) or ("valid",), pad_to)


def generate_cases(
    count: int,
    seed: int,
    *,
    allow_oversize: bool = True,
    long_lengths: tuple[int, ...] = LONG_LENGTHS,
) -> list[Case]:
    """`count` distinct cases drawn by Hypothesis from seed `seed` (the same list every time).

    Hypothesis runs only as a generator here (phase `generate`, no database, no shrinking):
    it revisits near-identical examples on purpose, so repeats are dropped and a few more
    examples than asked for are drawn."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    generator = Generator(allow_oversize=allow_oversize, long_lengths=long_lengths)
    cases: list[Case] = []
    seen: set[tuple[str, bytes, int]] = set()

    @st.composite
    def one(draw):
        return generator.case(draw)

    @hypothesis_seed(seed)
    @settings(
        max_examples=count * 3 // 2 + 20,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(one())
    def collect(case: Case) -> None:
        key = (case.endpoint, case.body, case.pad_to)
        if key not in seen and len(cases) < count:
            seen.add(key)
            cases.append(case)

    collect()
    return cases


# --- talking to the runner ------------------------------------------------------------------------


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""  # a dropped connection, a timeout: no whole answer
    complete: bool = True  # False: the client stopped reading a long stream
    seconds: float = 0.0

    def text(self, limit: int = 300) -> str:
        return self.body[:limit].decode("utf-8", "replace")


def send(port: int, path: str, body: bytes, *, timeout: float = REQUEST_TIMEOUT_S) -> Answer:
    """POST `body` exactly as given; a completions stream is read MAX_STREAM_LINES lines at most."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    answer = Answer()
    try:
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError) as e:
            answer.error = f"send: {type(e).__name__}"  # the server may have answered early
        response = conn.getresponse()
        answer.error = ""
        answer.status = response.status
        answer.headers = {k.lower(): v for k, v in response.getheaders()}
        if answer.headers.get("content-type", "").startswith("application/jsonl"):
            lines = []
            while True:
                line = response.readline()
                if not line:
                    break
                lines.append(line)
                if len(lines) >= MAX_STREAM_LINES:
                    answer.complete = False
                    break
            answer.body = b"".join(lines)
        else:
            answer.body = response.read()
    except (http.client.HTTPException, OSError) as e:
        answer.error = answer.error or f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    answer.seconds = time.perf_counter() - started
    return answer


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _poll_status(port: Any, interval: float, halt: Any, paused: Any, results: Any) -> None:
    """The poller's process: GET /v1/status on one kept-alive connection until `halt`,
    putting (start, seconds, error) for each poll, then None."""
    conn, connected_to = None, None
    while not halt.is_set():
        if paused.is_set():
            time.sleep(interval)
            continue
        target = port.value
        if conn is None or target != connected_to:
            if conn is not None:
                conn.close()
            conn, connected_to = http.client.HTTPConnection("127.0.0.1", target, timeout=10), target
        started = time.monotonic()
        error = ""
        try:
            conn.request("GET", "/v1/status")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200 or not body.startswith(b'{"Status":0'):
                error = f"{response.status}: {body[:100]!r}"
        except (http.client.HTTPException, OSError) as e:
            if not paused.is_set():
                error = f"{type(e).__name__}: {e}"
            conn.close()
            conn = None
        results.put((started, time.monotonic() - started, error))
        time.sleep(interval)
    if conn is not None:
        conn.close()
    results.put(None)


class StatusPoller:
    """GET /v1/status in a loop, from a process of its own: a thread here would wait for this
    process's GIL while it builds and judges megabyte bodies, and count that as the runner's
    latency (measured: a worst poll of 211 ms from a thread, 93 ms from a process, over the
    same kind of bodies). Records every latency and, for the slow ones, which body was in
    flight (`in_flight`, set by the sender; matched by time). Results are read at `stop()`."""

    def __init__(self, port: int, interval: float = 0.02, limit: float = STATUS_LATENCY_LIMIT_S):
        context = multiprocessing.get_context("spawn")
        self.interval, self.limit = interval, limit
        self.latencies: list[float] = []
        self.slow: list[tuple[float, str]] = []  # (seconds, what was in flight)
        self.errors: list[str] = []
        self._port = context.Value("i", port)
        self._halt, self._paused = context.Event(), context.Event()
        self._results = context.Queue()
        self._process = context.Process(
            target=_poll_status,
            args=(self._port, interval, self._halt, self._paused, self._results),
            daemon=True,
            name="status-poller",
        )
        self._flights: list[tuple[float, float, str]] = []  # (start, end, label)
        self._current: tuple[float, str] | None = None

    @property
    def port(self) -> int:
        return int(self._port.value)

    @port.setter
    def port(self, value: int) -> None:
        self._port.value = value

    @property
    def in_flight(self) -> str:
        return self._current[1] if self._current else ""

    @in_flight.setter
    def in_flight(self, label: str) -> None:
        now = time.monotonic()
        if self._current is not None:
            self._flights.append((self._current[0], now, self._current[1]))
        self._current = (now, label) if label else None

    def start(self) -> None:
        self._process.start()

    def pause(self, paused: bool) -> None:
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    def stop(self) -> None:
        self.in_flight = ""
        self._halt.set()
        while True:
            try:
                item = self._results.get(timeout=15)
            except queue.Empty:
                break
            if item is None:
                break
            started, elapsed, error = item
            flight = self._flight_at(started, started + elapsed)
            self.latencies.append(elapsed)
            if error:
                self.errors.append(f"{error} (in flight: {flight})")
            if elapsed > self.limit:
                self.slow.append((elapsed, flight))
        self._process.join(timeout=5)

    def _flight_at(self, begin: float, end: float) -> str:
        """The body in flight while a poll ran (the latest that overlaps it)."""
        for start, stop, label in reversed(self._flights):
            if start <= end and stop >= begin:
                return label
        return ""

    def worst(self) -> tuple[float, str]:
        if not self.slow:
            return (max(self.latencies, default=0.0), "")
        return max(self.slow)


# --- the run --------------------------------------------------------------------------------------


@dataclass
class Failure:
    index: int
    endpoint: str
    checks: list[str]
    details: list[str]
    body: bytes
    tags: tuple[str, ...]
    status: int
    answer: str
    file: str = ""


@dataclass
class Report:
    seed: int
    bodies: int = 0
    twins: int = 0
    by_status: Counter = field(default_factory=Counter)  # (endpoint, status) -> count
    failures: list[Failure] = field(default_factory=list)
    by_check: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    latencies: list[float] = field(default_factory=list)
    worst_status: tuple[float, str] = (0.0, "")
    slow_status: int = 0
    slow_polls: list[tuple[float, str]] = field(default_factory=list)
    status_errors: list[str] = field(default_factory=list)
    rss_before: int | None = None
    rss_after: int | None = None
    restarts: int = 0
    seconds: float = 0.0
    out_dir: str = ""

    def failed(self, check: str) -> list[Failure]:
        return [f for f in self.failures if check in f.checks]


def check_answer(
    api: OpenAPI, endpoint: str, answer: Answer, alive: bool
) -> tuple[list[str], list[str]]:
    """The per-body checks that need no Go model: (failed checks, details)."""
    checks, details = [], []
    if answer.error:
        checks.append("answered")
        details.append(f"no whole answer: {answer.error}")
    if answer.status and not (answer.status == 200 or 400 <= answer.status < 500):
        checks.append("no-5xx")
        details.append(f"status {answer.status}: {answer.text()!r}")
    if answer.status and not answer.error:
        problems = api.check_answer(
            PATHS[endpoint],
            "POST",
            answer.status,
            answer.headers,
            answer.body,
            complete=answer.complete,
        )
        if problems:
            checks.append("schema")
            details += problems[:5]
    if endpoint == "completions" and answer.status == 200 and b'"Error":{' in answer.body:
        checks.append("no-error-line")
        details.append(
            "Error line: "
            + answer.body[answer.body.find(b'"Error":{') :][:200].decode("utf-8", "replace")
        )
    if not alive:
        checks.append("alive")
        details.append("the runner exited")
    return checks, details


def _message(answer: Answer) -> str:
    return answer.body.decode("utf-8", "replace")


class Fuzzer:
    """Sends cases to a runner, checks every answer; `runner` is a tools.spawned.SpawnedRunner,
    `restart` makes a new one when it dies (None: a death ends the run)."""

    def __init__(
        self, runner: Any, out_dir: Path, seed: int, restart: Callable[[], Any] | None = None
    ):
        self.runner = runner
        self.restart = restart
        self.api = openapi()
        self.out = out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.report = Report(seed=seed, out_dir=str(out_dir))
        self._twins: dict[tuple[str, bytes], Answer] = {}
        self.poller: StatusPoller | None = None

    def _alive(self) -> bool:
        return self.runner.process.poll() is None

    def _post(self, endpoint: str, body: bytes, label: str) -> Answer:
        if self.poller is not None:
            self.poller.in_flight = label
        answer = send(self.runner.port, PATHS[endpoint], body)
        if self.poller is not None:
            self.poller.in_flight = ""
        return answer

    def run(
        self, cases: list[Case], progress: Callable[[int, Report], None] | None = None
    ) -> Report:
        report = self.report
        started = time.perf_counter()
        report.rss_before = rss_bytes(self.runner.process.pid)
        self.poller = StatusPoller(self.runner.port)
        self.poller.start()
        try:
            for index, case in enumerate(cases):
                self.one(index, case)
                if progress is not None:
                    progress(index + 1, report)
                if not self._alive():
                    if self.restart is None:
                        break
                    self.poller.pause(True)
                    self.runner = self.restart()
                    self.poller.port = self.runner.port
                    self.poller.pause(False)
                    report.restarts += 1
        finally:
            self.poller.stop()
        if self._alive():
            report.rss_after = rss_bytes(self.runner.process.pid)
        report.latencies = self.poller.latencies
        report.worst_status = self.poller.worst()
        report.slow_status = len(self.poller.slow)
        report.slow_polls = list(self.poller.slow)
        report.status_errors = self.poller.errors
        if self.poller.slow:
            report.by_check["status-latency"] = [-1]
        report.seconds = time.perf_counter() - started
        return report

    def one(self, index: int, case: Case) -> None:
        report = self.report
        body = case.materialize()
        label = f"#{index} {case.endpoint} {','.join(case.tags)} {body[:60]!r}"
        answer = self._post(case.endpoint, body, label)
        report.bodies += 1
        report.by_status[(case.endpoint, answer.status or answer.error.split(":")[0])] += 1
        checks, details = check_answer(self.api, case.endpoint, answer, self._alive())
        verdict = None
        if case.endpoint != "tokenize" and answer.status and self._alive():
            verdict = go_verdict(case.endpoint, body) if not case.pad_to else None
            if case.pad_to:  # documented: the runner refuses bodies over 64 MiB, Go has no limit
                if answer.status != 400 or not answer.body.startswith(b"request body too large"):
                    checks.append("go-status")
                    details.append(
                        f"over 64 MiB: expected 400 request body too large, got {answer.status}"
                    )
            elif not verdict.ok:
                if answer.status != 400:
                    checks.append("go-status")
                    details.append(
                        f"Go rejects the body ({verdict.error}): expected 400, got {answer.status}"
                    )
                elif case.endpoint == "completions" and answer.body != b"Bad Request\n":
                    checks.append("go-message")
                    details.append(
                        f"Go cannot decode it ({verdict.error}): expected 'Bad Request', "
                        f"got {_message(answer)!r}"
                    )
            else:
                twin = self._twin(case.endpoint, verdict.canonical, index)
                if twin is not None and twin.status and answer.status != twin.status:
                    checks.append("go-status")
                    details.append(
                        f"Go decodes it as {verdict.canonical[:300]!r}, answered {twin.status} "
                        f"({twin.text(120)!r}); this body got {answer.status} "
                        f"({answer.text(120)!r})"
                    )
                elif (
                    twin is not None
                    and answer.status == twin.status == 400
                    and answer.body != twin.body
                ):
                    checks.append("go-message")
                    details.append(
                        f"400 {_message(answer)!r}, Go decodes it as "
                        f"{verdict.canonical[:200]!r}: {_message(twin)!r}"
                    )
        if checks:
            self._record(index, case, body, answer, checks, details, verdict)

    def _twin(self, endpoint: str, canonical: bytes, index: int) -> Answer | None:
        key = (endpoint, canonical)
        if key not in self._twins:
            twin = self._post(endpoint, canonical, f"#{index} twin {canonical[:60]!r}")
            self.report.twins += 1
            checks, details = check_answer(self.api, endpoint, twin, self._alive())
            if checks:  # a plain, valid-syntax body failing is a failure of its own
                self._record(
                    index,
                    Case(endpoint, canonical, ("twin",)),
                    canonical,
                    twin,
                    checks,
                    details,
                    None,
                )
            if not self._alive():
                return None
            self._twins[key] = twin
        return self._twins[key]

    def _record(self, index, case, body, answer, checks, details, verdict) -> None:
        name = f"{index:05d}-{case.endpoint}{'-twin' if case.tags == ('twin',) else ''}"
        failure = Failure(
            index, case.endpoint, checks, details, body, case.tags, answer.status, answer.text(500)
        )
        if len(body) <= 8 * MIB:
            (self.out / f"{name}.body").write_bytes(body)
            failure.file = str(self.out / f"{name}.body")
        meta = {
            "index": index,
            "endpoint": case.endpoint,
            "path": PATHS[case.endpoint],
            "checks": checks,
            "details": details,
            "tags": list(case.tags),
            "status": answer.status,
            "error": answer.error,
            "answer": answer.text(2000),
            "body_bytes": len(body),
            "go": None
            if verdict is None
            else {
                "decodes": verdict.ok,
                "error": verdict.error,
                "canonical": None
                if verdict.canonical is None
                else verdict.canonical[:2000].decode(),
            },
        }
        (self.out / f"{name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        self.report.failures.append(failure)
        for check in checks:
            self.report.by_check[check].append(index)


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:.1f} MiB"


def summary(report: Report) -> str:
    lines = [
        f"fuzz: {report.bodies} bodies (+{report.twins} canonical twins), seed {report.seed}, "
        f"{report.seconds:.0f} s, runner restarts {report.restarts}"
    ]
    lines.append("bodies by endpoint and status:")
    for endpoint in ENDPOINTS:
        counts = {s: n for (e, s), n in report.by_status.items() if e == endpoint}
        total = sum(counts.values())
        parts = "  ".join(f"{s}: {n}" for s, n in sorted(counts.items(), key=lambda x: str(x[0])))
        lines.append(f"  {endpoint:<12} {total:>6}   {parts}")
    lines.append("checks:")
    for check in CHECKS:
        if check == "status-latency":
            continue
        failed = report.failed(check)
        lines.append(f"  {check:<14} {'ok' if not failed else f'FAILED on {len(failed)} bodies'}")
        for failure in failed[:4]:
            lines.append(
                f"      #{failure.index} {failure.endpoint} [{','.join(failure.tags)}] -> "
                f"{failure.status}: {failure.body[:110]!r}"
            )
            for detail in failure.details[:2]:
                lines.append(f"        {detail[:220]}")
            if failure.file:
                lines.append(f"        {failure.file}")
    lat = sorted(report.latencies)
    worst, flight = report.worst_status
    if lat:
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        limit_ms = STATUS_LATENCY_LIMIT_S * 1000
        verdict = f"FAILED: {report.slow_status} polls over {limit_ms:.0f} ms"
        during = f" during {flight[:120]}" if flight else ""
        lines.append(
            f"  status-latency {'ok' if not report.slow_status else verdict} (polls {len(lat)}, "
            f"median {lat[len(lat) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
            f"worst {worst * 1000:.1f} ms{during})"
        )
    for seconds, flight in sorted(report.slow_polls, reverse=True)[:3]:
        lines.append(f"      {seconds * 1000:.0f} ms during {flight[:150]}")
    if report.status_errors:
        errors = report.status_errors
        lines.append(f"  /v1/status errors: {len(errors)}, first: {errors[0][:200]}")
    growth = (
        None
        if report.rss_before is None or report.rss_after is None
        else report.rss_after - report.rss_before
    )
    lines.append(
        f"runner RSS: before {_mib(report.rss_before)}, after {_mib(report.rss_after)}"
        + ("" if growth is None else f" ({growth / MIB:+.1f} MiB)")
    )
    lines.append(f"failing bodies: {len(report.failures)} written to {report.out_dir}")
    return "\n".join(lines)


def write_model(path: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.tiny import write_tiny_model

    return write_tiny_model("LlamaForCausalLM", path)


def spawn(model_dir: Path, log_dir: Path, *flags: str) -> Any:
    from tools.spawned import SpawnedRunner

    log_dir.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix="runner-", suffix=".log", dir=log_dir)
    os.close(handle)
    runner = SpawnedRunner("--model", str(model_dir), *flags, log_path=Path(name))
    runner.wait_ready(timeout=300)
    return runner


def run_fuzz(
    bodies: int,
    seed: int,
    out_dir: Path,
    model_dir: Path | None = None,
    *,
    cache_bytes: int = 64 * MIB,
    restart: bool = True,
    allow_oversize: bool = True,
    long_lengths: tuple[int, ...] = LONG_LENGTHS,
    progress: bool = False,
) -> Report:
    """Generate `bodies` cases, spawn a tiny runner (`--cache-bytes cache_bytes`, so that RSS
    growth is not the prefix caches filling up), send them; the report."""
    cases = generate_cases(bodies, seed, allow_oversize=allow_oversize, long_lengths=long_lengths)
    with contextlib.ExitStack() as stack:
        if model_dir is None:
            temp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            model_dir = write_model(temp / "tiny-llama")
        runners: list[Any] = []

        def start() -> Any:
            runner = spawn(model_dir, out_dir / "logs", "--cache-bytes", str(cache_bytes))
            runners.append(runner)
            return runner

        stack.callback(lambda: [r.stop() for r in runners])
        fuzzer = Fuzzer(start(), out_dir, seed, restart=start if restart else None)

        def show(done: int, report: Report) -> None:
            if progress and (done % 250 == 0 or done == len(cases)):
                failing = len(report.failures)
                print(f"  {done}/{len(cases)} bodies, {failing} failing", file=sys.stderr)

        return fuzzer.run(cases, show)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fuzz", description="Fuzz a spawned tiny runner's HTTP surface."
    )
    parser.add_argument("--bodies", type=int, default=2000, help="bodies to send (2000)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (0)")
    parser.add_argument("--out", type=Path, help="where failing bodies go (a new temp dir)")
    parser.add_argument("--model-dir", type=Path, help="fuzz this model directory instead")
    parser.add_argument("--cache-bytes", type=int, default=64 * MIB, help="runner cache budget")
    parser.add_argument("--no-oversize", action="store_true", help="no bodies over 64 MiB")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="runner-fuzz-"))
    report = run_fuzz(
        args.bodies,
        args.seed,
        out,
        args.model_dir,
        cache_bytes=args.cache_bytes,
        allow_oversize=not args.no_oversize,
        progress=True,
    )
    print(summary(report))
    if args.json:
        data = {
            "seed": report.seed,
            "bodies": report.bodies,
            "twins": report.twins,
            "by_status": {f"{e} {s}": n for (e, s), n in report.by_status.items()},
            "failures": {check: [f.index for f in report.failed(check)] for check in CHECKS},
            "worst_status_s": report.worst_status[0],
            "slow_status_polls": report.slow_status,
            "rss_before": report.rss_before,
            "rss_after": report.rss_after,
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 1 if report.failures or report.slow_status else 0


if __name__ == "__main__":
    sys.exit(main())
