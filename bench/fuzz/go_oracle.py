"""What the Go runner's `json.NewDecoder(body).Decode(&request)` makes of a body: an oracle
written apart from the runner's own decoder (runner/protocol/go_json.py), node by node after
Go's scanner and decoder, with the request types read off docs/openapi.yaml.

`go_scan` reads the first JSON value as Go's scanner does (whatever follows is never read;
JSON's four whitespace bytes; nesting up to 10,000 levels; invalid UTF-8 and lone surrogate
escapes become U+FFFD, one per byte); `go_decode` decodes the tree into a Go type the way
`encoding/json` fills a value (keys folded as Go folds them, unknown keys skipped, `null` a
no-op except that it empties a slice, a duplicate key decoded into the same value in turn,
ints int64 integer literals, float32 fields finite, `[]byte` as padded base64 or an array of
numbers); `go_verdict` says whether Go accepts a body and, if it does, writes the decoded
request plainly (the fuzz's "twin"). tests/test_go_oracle.py checks it against Go's
documented behaviour and against the runner's decoder.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache
from typing import Any

from bench.fuzz.openapi import OpenAPI, openapi

GO_MAX_DEPTH = 10000  # the runner's too (runner/protocol/go_json.py)
_WS = b" \t\r\n"
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


def _quote_char(c: int) -> str:
    """Go's scanner's quoteChar: the byte as a rune (0xff is ÿ), in strconv.Quote's escapes
    between single quotes."""
    if c == 0x27:
        return "'\\''"
    if c == 0x22:
        return "'\"'"
    if c == 0x5C:
        return "'\\\\'"
    char = chr(c)
    named = {7: "\\a", 8: "\\b", 12: "\\f", 10: "\\n", 13: "\\r", 9: "\\t", 11: "\\v"}
    if c in named:
        return f"'{named[c]}'"
    if c < 0x20 or c == 0x7F:
        return f"'\\x{c:02x}'"
    if not char.isprintable():  # strconv.IsPrint: U+0080-U+009F, U+00A0, U+00AD
        return f"'\\u{c:04x}'"
    return f"'{char}'"


def _fail(b: bytes, i: int, context: str) -> GoSyntaxError:
    """Go's SyntaxError for byte `i` in `context`; `unexpected EOF` when the body ends first
    (json.Decoder reports a value cut short so, whatever the scanner was expecting)."""
    if i >= len(b):
        return GoSyntaxError("unexpected EOF")
    return GoSyntaxError(f"invalid character {_quote_char(b[i])} {context}")


def _scan_string(b: bytes, i: int) -> tuple[str, int]:
    """b[i] is the opening quote; the decoded string and the index after the closing one."""
    j = i + 1
    n = len(b)
    while True:
        if j >= n:
            raise _fail(b, j, "")
        c = b[j]
        if c == 0x22:
            return go_unquote(b[i + 1 : j]), j + 1
        if c < 0x20:
            raise _fail(b, j, "in string literal")
        if c == 0x5C:
            e = b[j + 1] if j + 1 < n else None
            if e == ord("u"):
                for k in range(j + 2, j + 6):
                    if k >= n or not _HEX4.fullmatch(b[k : k + 1] * 4):
                        raise _fail(b, k, "in \\u hexadecimal character escape")
                j += 6
            elif e is not None and e in _ESCAPES:
                j += 2
            else:
                raise _fail(b, j + 1, "in string escape code")
        else:
            j += 1


def _scan_number(b: bytes, i: int) -> int:
    """b[i] is `-` or a digit; the index after the number, as Go's scanner reads one."""
    n = len(b)
    j = i + 1 if b[i] == 0x2D else i
    if j >= n or not 0x30 <= b[j] <= 0x39:
        raise _fail(b, j, "in numeric literal")
    j = j + 1 if b[j] == 0x30 else _digits(b, j)  # no digit follows a leading 0
    if j < n and b[j] == 0x2E:
        if j + 1 >= n or not 0x30 <= b[j + 1] <= 0x39:
            raise _fail(b, j + 1, "after decimal point in numeric literal")
        j = _digits(b, j + 1)
    if j < n and b[j] in b"eE":
        j += 1
        if j < n and b[j] in b"+-":
            j += 1
        if j >= n or not 0x30 <= b[j] <= 0x39:
            raise _fail(b, j, "in exponent of numeric literal")
        j = _digits(b, j)
    return j


def _digits(b: bytes, j: int) -> int:
    while j < len(b) and 0x30 <= b[j] <= 0x39:
        j += 1
    return j


_LITERALS = {ord("t"): (b"true", ("bool", True)), ord("f"): (b"false", ("bool", False))}
_LITERALS[ord("n")] = (b"null", ("null",))


def _scan_literal(b: bytes, i: int) -> tuple[Any, int]:
    """b[i] starts true, false or null; the node and the index after it."""
    word, node = _LITERALS[b[i]]
    for k in range(1, len(word)):
        if i + k >= len(b) or b[i + k] != word[k]:
            expecting = _quote_char(word[k])
            raise _fail(b, i + k, f"in literal {word.decode()} (expecting {expecting})")
    return node, i + len(word)


def _skip_ws(b: bytes, i: int) -> int:
    while i < len(b) and b[i] in _WS:
        i += 1
    return i


def _object_key(b: bytes, i: int, context: str) -> tuple[str, int]:
    """A member's key at `i` (after whitespace) and the index after its colon and the
    whitespace that follows."""
    i = _skip_ws(b, i)
    if i >= len(b) or b[i] != 0x22:
        raise _fail(b, i, context)
    key, i = _scan_string(b, i)
    i = _skip_ws(b, i)
    if i >= len(b) or b[i] != 0x3A:
        raise _fail(b, i, "after object key")
    return key, _skip_ws(b, i + 1)


def go_scan(b: bytes) -> Any:
    """The first JSON value of `b` as Go's json.Decoder reads it (whatever follows is never
    read), as a tree: ("obj", [(key, node)...]), ("arr", [...]), ("str", s), ("num", literal),
    ("bool", b), ("null",). Raises GoSyntaxError with Go's message: `EOF` for nothing but
    whitespace, `unexpected EOF` for a value cut short, else the scanner's `invalid character
    ...` for the first byte that cannot continue the value."""
    i = _skip_ws(b, 0)
    if i >= len(b):
        raise GoSyntaxError("EOF")
    stack: list[list[Any]] = []  # ["obj", pairs, key] or ["arr", items]
    n = len(b)
    go_scan.deepest = 0  # type: ignore[attr-defined]  (the nesting the last scan reached)
    while True:
        # a value starts at i
        if i >= n:
            raise _fail(b, i, "")
        c = b[i]
        value: Any
        if c in b"{[":
            if len(stack) + 1 > GO_MAX_DEPTH:
                raise _fail(b, i, "exceeded max depth")
            go_scan.deepest = max(go_scan.deepest, len(stack) + 1)  # type: ignore[attr-defined]
            i = _skip_ws(b, i + 1)
            if i < n and b[i] == (0x7D if c == 0x7B else 0x5D):
                value = ("obj", []) if c == 0x7B else ("arr", [])
                i += 1
            elif c == 0x7B:
                key, i = _object_key(b, i, "looking for beginning of object key string")
                stack.append(["obj", [], key])
                continue
            else:
                stack.append(["arr", []])
                continue
        elif c == 0x22:
            text, i = _scan_string(b, i)
            value = ("str", text)
        elif c == 0x2D or 0x30 <= c <= 0x39:
            end = _scan_number(b, i)
            value, i = ("num", b[i:end].decode()), end
        elif c in _LITERALS:
            value, i = _scan_literal(b, i)
        else:
            raise _fail(b, i, "looking for beginning of value")
        # attach the value to its parents, closing them as far as they end
        while True:
            if not stack:
                return value
            frame = stack[-1]
            i = _skip_ws(b, i)
            if i >= n:
                raise _fail(b, i, "")
            c = b[i]
            if frame[0] == "obj":
                frame[1].append((frame[2], value))
                if c == 0x2C:
                    frame[2], i = _object_key(
                        b, i + 1, "looking for beginning of object key string"
                    )
                    break
                if c != 0x7D:
                    raise _fail(b, i, "after object key:value pair")
                stack.pop()
                value = ("obj", frame[1])
                i += 1
            else:
                frame[1].append(value)
                if c == 0x2C:
                    i = _skip_ws(b, i + 1)
                    break
                if c != 0x5D:
                    raise _fail(b, i, "after array element")
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


class GoByteSlice(bytes):
    """A []byte decoded from an array of numbers, with `stale` as a GoSlice has (a []byte
    decoded from base64 has only zeros past its length)."""

    stale: list[int]

    def __new__(cls, items=b"", stale=()):
        self = super().__new__(cls, items)
        self.stale = list(stale)
        return self


F32_OVERFLOW = Fraction(2**128 - 2**103)  # |x| at or above this rounds to float32 infinity


_DECIMAL = re.compile(r"(-?)([0-9]+)(?:\.([0-9]+))?(?:[eE]([+-]?[0-9]+))?")
F32_MAX_BITS = 0x7F7FFFFF  # the largest finite float32's bits


def _f32_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _f32(literal: str) -> float:
    """strconv.ParseFloat(literal, 32): the exact decimal rounded once to the nearest float32,
    ties to even (not through float64 first, which can round twice); at or past the midpoint
    between the largest float32 and 2**128 it is out of range, an error; underflow is 0."""
    sign, whole, frac, exp = _DECIMAL.fullmatch(literal).groups()  # type: ignore[union-attr]
    digits = whole + (frac or "")
    first = len(digits) - len(digits.lstrip("0"))
    if first == len(digits):
        return -0.0 if sign else 0.0
    magnitude = len(whole) - first - 1 + int(exp or 0)  # of the leading digit
    if magnitude > 40:
        raise GoTypeError("float32 overflow")
    if magnitude < -60:
        return -0.0 if sign else 0.0
    value = abs(Fraction(literal))
    if value >= F32_OVERFLOW:
        raise GoTypeError("float32 overflow")
    # float64's nearest, then float32's nearest to that: the answer or one of its neighbours
    near = struct.unpack("<I", struct.pack("<f", min(float(value), _f32_bits(F32_MAX_BITS))))[0]
    candidates = [b for b in (near - 1, near, near + 1) if 0 <= b <= F32_MAX_BITS]
    best = min(candidates, key=lambda b: (abs(Fraction(_f32_bits(b)) - value), b & 1))
    return -_f32_bits(best) if sign else _f32_bits(best)


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
        # Go decodes element i into the slice's element i, also past its length while within
        # its capacity (what an earlier, longer array left), and keeps the capacity when it
        # truncates; an empty array makes a new empty slice
        old = [] if existing is None else list(existing) + list(getattr(existing, "stale", []))
        items = [
            go_decode(item, elem, old[i] if i < len(old) else _go_zero(elem))
            for i, item in enumerate(node[1])
        ]
        stale = old[len(items) :] if items else []
        return GoByteSlice(items, stale) if kind == "bytes" else GoSlice(items, stale)
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
    # the decoded request: {field name as docs/openapi.yaml spells it: value}, fields the body
    # never set absent, slices as GoSlice, float32 fields as the float32 value, []byte as bytes
    value: Any = field(default=None, compare=False, repr=False)


def go_verdict(endpoint: str, body: bytes) -> GoVerdict:
    """What the Go runner's `json.NewDecoder(body).Decode(&request)` makes of `body`."""
    typ = request_types()[endpoint]
    try:
        node = go_scan(body)
        value = {} if node[0] == "null" else go_decode(node, typ, {})
    except (GoSyntaxError, GoTypeError) as e:
        return GoVerdict(False, str(e))
    canonical = json.dumps(_canonical_value(value, typ), ensure_ascii=False, allow_nan=False)
    depth = go_scan.deepest  # type: ignore[attr-defined]
    return GoVerdict(True, canonical=canonical.encode("utf-8"), depth=depth, value=value)
