"""Go's `encoding/json` decoding of a request body into a msgspec struct: what the Go
runner's `json.NewDecoder(body).Decode(&request)` accepts and what it makes of it
(docs/PROTOCOL.md §3.1).

Decoding follows Go's `json.Decoder.Decode` into a zero-valued struct (`decode`):
- only the first JSON value of the body is read; whatever follows it is ignored;
- keys match case-insensitively (Unicode simple folding: `Optionſ` is `Options`), unknown
  keys are ignored and their values are only checked for syntax (`1e400` under an unknown key
  is fine); `null` leaves the zero value, also as an element of an array;
  `/v1/score` goes further: its keys also match with underscores left out (`max_tokens`,
  `MaxTokens`, `maxtokens` are one key);
- a key given twice (or in two spellings that fold to one field) decodes into the same value
  in turn, as Go's does (`_Walk`): objects merge, an array decodes into the earlier one's
  elements, `null` empties a slice, a type error in any occurrence fails the body;
- a byte of invalid UTF-8 inside a string, and a `\\u` escape of a lone surrogate, become
  U+FFFD, one per byte (Go's `utf8.DecodeRune`);
- integers must fit Go's int (int64), and numbers for Go's float32 fields are rounded once
  from the exact literal to float32, as Go's ParseFloat(s, 32) does (`go_float32`), and must
  round to a finite float32 (`3.4028235e38`, Go's own spelling of the largest, is fine);
- base64 (`[]byte` fields) may hold CR and LF, which Go's decoder skips, and a `[]byte` may
  also be an array of numbers 0-255;
- nesting deeper than Go's 10,000 levels is refused with Go's message (`invalid character
  '[' exceeded max depth`). msgspec's recursion stops near 1,000 levels, so a value nesting
  deeper than `SHALLOW` is checked in pieces of at most that depth (`_shallow`) and walked
  with its deep parts replaced by empty containers of their kind: no field of a request
  lies that deep, so only unknown values (and type errors) are ever there.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import decimal
import functools
import math
import re
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np

T = TypeVar("T")
MAX_DEPTH = 10_000  # Go's encoding/json maxNestingDepth
# The deepest value handed to msgspec at once: its C recursion shares Python's limit (1,000
# frames, some already taken by the caller).
SHALLOW = 200
# A Go []byte field, carried as its base64 text (`media_bytes` decodes it): on the wire also an
# array of numbers 0-255, written here as base64; null empties it.
GoBytes = Annotated[str, msgspec.Meta(extra={"go": "[]byte"})]


def media_bytes(data: str) -> bytes:
    """Go's base64.StdEncoding.Decode of a []byte field: CR and LF are skipped, padding is
    required; a ValueError says where the input went wrong."""
    text = data.replace("\r", "").replace("\n", "")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("illegal base64 data") from None


class DecodeError(ValueError):
    """The body is not JSON of the expected shape; the message is the decoder's."""


class _Zero:
    """A null array element: the element type's zero value, as Go leaves it."""


ZERO = _Zero()


def _normalise_keys(value: Any, key: Callable[[str], str]) -> Any:
    """Keys through `key`, recursively; null members dropped and null elements marked `ZERO`
    (Go leaves the zero value for both). Numbers with a fraction or an exponent stay Decimal
    (exact, so that a number too large for a float only fails where a field needs it, and a
    float32 field rounds the literal once): `_numbers` turns them into floats by place."""
    if isinstance(value, dict):
        return {key(k): _normalise_keys(v, key) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [ZERO if v is None else _normalise_keys(v, key) for v in value]
    return value


# Half a step past float32's largest value (2^128 - 2^103): a literal reaching it rounds to
# infinity, which Go's ParseFloat(s, 32) refuses; below it, to a finite float32.
_F32_OVERFLOW = Fraction(2**128 - 2**103)


def go_float32(value: decimal.Decimal | int) -> float:
    """The literal `value` as Go's strconv.ParseFloat(s, 32) reads it: the exact decimal rounded
    once to the nearest float32 (ties to even), not through float64 (which rounds some
    literals onto a float32 midpoint, or up onto the overflow limit); +-inf past the limit."""
    if isinstance(value, int):
        value = decimal.Decimal(value)
    if not value.is_finite():
        return float(value)
    if value.is_zero() or value.adjusted() < -60:  # below half the smallest subnormal
        return math.copysign(0.0, -1.0 if value.is_signed() else 1.0)
    if value.adjusted() > 40:
        return math.copysign(math.inf, -1.0 if value.is_signed() else 1.0)
    exact = Fraction(value)
    if abs(exact) >= _F32_OVERFLOW:
        return math.copysign(math.inf, exact)
    with np.errstate(over="ignore"):  # near the limit a step may be an infinity: skipped
        guess = np.float32(float(value))  # within one step of the answer
        steps = (
            np.nextafter(guess, np.float32(-np.inf)),
            guess,
            np.nextafter(guess, np.float32(np.inf)),
        )
    finite = [c for c in steps if np.isfinite(c)]

    def distance(c: np.float32) -> tuple[Fraction, int]:  # then the even mantissa first
        return abs(Fraction(float(c)) - exact), int(np.array(c).view(np.uint32)) & 1

    return float(min(finite, key=distance))


def _numbers(value: Any, float32: bool = False) -> Any:
    """`value` with its numbers as the place takes them: a Go float32 field's literal (a
    Decimal or an int) through `go_float32`; any other Decimal as float64 (beyond it an
    infinity, which no field accepts)."""
    if float32 and isinstance(value, decimal.Decimal | int) and not isinstance(value, bool):
        return go_float32(value)
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value


def _is_float32(info: msgspec.inspect.Type) -> bool:
    while isinstance(info, msgspec.inspect.Metadata):
        if (info.extra or {}).get("go") == "float32":
            return True
        info = info.type
    return False


def _zero_fill(value: Any, info: msgspec.inspect.Type) -> Any:
    """Replace `ZERO` elements by the zero value of their place in the target type, and
    numbers by what their place takes (`_numbers`)."""
    if _is_float32(info):
        return _numbers(value, float32=True)
    if isinstance(info, msgspec.inspect.Metadata):
        return _zero_fill(value, info.type)
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        for field in info.fields:
            if field.encode_name in value:
                value[field.encode_name] = _zero_fill(value[field.encode_name], field.type)
        return value
    if isinstance(info, msgspec.inspect.ListType) and isinstance(value, list):
        item = info.item_type
        return [_zero_of(item) if v is ZERO else _zero_fill(v, item) for v in value]
    return _numbers(value)


def _zero_of(info: msgspec.inspect.Type) -> Any:
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    zeros = {
        msgspec.inspect.StrType: "",
        msgspec.inspect.IntType: 0,
        msgspec.inspect.FloatType: 0.0,
        msgspec.inspect.BoolType: False,
        msgspec.inspect.StructType: {},
        msgspec.inspect.ListType: [],
    }
    return zeros.get(type(info))


def fold_key(key: str) -> str:
    """Go's key matching: Unicode simple case folding (`ſ` is `s`, the Kelvin sign `k`)."""
    return "".join(c.casefold() if len(c.casefold()) == 1 else c.lower() for c in key)


def _replace_byte(error: UnicodeError) -> tuple[str, int]:
    assert isinstance(error, UnicodeDecodeError)
    return "\ufffd", error.start + 1  # one U+FFFD per invalid byte, as Go


codecs.register_error("runner-go-replace", _replace_byte)

# In a string: an escaped surrogate pair (kept), a lone surrogate (replaced), or any escape.
_ESCAPE = re.compile(
    r"\\(u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|u[dD][89a-fA-F][0-9a-fA-F]{2}|.)"
)

# Bytes one regex call may cover: the GIL is held through a call, and a 45 MB run of numbers
# was one search (~1 s: /v1/status waited), a 3 MB string one match (111 ms).
SCAN_WINDOW = 1 << 20

# Text up to the next bracket outside strings: runs of other bytes, and whole strings. A
# lookahead takes a string's body at once (lookaheads do not backtrack), so a string whose
# closing quote is missing is given up after one pass instead of backtracked over byte by
# byte (~100 ms a MB). In C the whole way: a request's strings are not a Python step each.
_TO_BRACKET = re.compile(rb'(?:[^"\[\]{}]+|"(?=([^"\\]*(?:\\.[^"\\]*)*))\1")*', re.DOTALL)
# A string's plain characters and whole escapes (unrolled: runs of plain characters in one
# step; one alternation per character took ~200 ms a MB), stopping before its closing quote,
# at a backslash whose escaped byte is past the call's end, or at that end.
_STRING_PART = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)


def _brackets(body: bytes, start: int, window: int = SCAN_WINDOW) -> Iterator[int]:
    """Where the brackets outside strings are, from `start`, until a string that never
    closes (all that follows is inside it). No regex call covers more than `window` bytes,
    so a long run lets the GIL go between calls."""
    pos, n = start, len(body)
    while pos < n:
        stop = min(pos + window, n)
        pos = _TO_BRACKET.match(body, pos, stop).end()  # type: ignore[union-attr]
        if pos >= n:
            return
        if body[pos] == 0x22:  # a string longer than the window's rest
            end = _string_end(body, pos, window)
            if end is None:
                return
            pos = end
        elif pos < stop:
            yield pos
            pos += 1


def _string_end(body: bytes, quote: int, window: int = SCAN_WINDOW) -> int | None:
    """Where the string literal opening at `body[quote]` ends (None: it never does)."""
    pos, n = quote + 1, len(body)
    while pos < n:
        pos = _STRING_PART.match(body, pos, min(pos + window, n)).end()  # type: ignore[union-attr]
        if pos >= n:
            break
        if body[pos] == 0x22:  # '"'
            return pos + 1
        if body[pos] == 0x5C:  # a backslash the window cut from the byte it escapes
            pos += 2
    return None


def _close(body: bytes, start: int) -> tuple[int | None, int]:
    """The end of the object or array opening at `body[start]` (None if it has none) and
    how deep it nests; DecodeError, with Go's message, where that is deeper than MAX_DEPTH."""
    depth = deepest = 0
    for at in _brackets(body, start):
        if body[at] in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if depth > MAX_DEPTH:
                    raise DecodeError(f"invalid character '{chr(body[at])}' exceeded max depth")
        else:
            depth -= 1
            if depth == 0:
                return at + 1, deepest
    return None, deepest


_RAW = msgspec.json.Decoder(msgspec.Raw)  # a syntax check that builds nothing


def _shallow(text: bytes) -> bytes:
    """`text` (one well-closed object or array) with each container that opens SHALLOW
    levels down replaced by an empty one of its kind (`[]`, `{}`), after checking the
    syntax of each replaced container the same way, piece by piece: a piece is a container
    opening at depth 1, SHALLOW + 1, 2 * SHALLOW + 1, ... with its own such containers
    replaced, so msgspec never recurses more than SHALLOW + 1 levels. DecodeError with
    msgspec's message (positions within the piece) for a malformed piece; the outermost
    piece, returned, is checked by whoever decodes it."""
    # the open pieces, outermost first: [start, the text so far, where the text resumes]
    pieces: list[list[Any]] = []
    depth = 0
    for at in _brackets(text, 0):
        if text[at] in b"[{":
            depth += 1
            if (depth - 1) % SHALLOW == 0:
                pieces.append([at, [], at])
            continue
        if (depth - 1) % SHALLOW == 0:
            start, parts, resume = pieces.pop()
            if not pieces:
                return b"".join([*parts, text[resume : at + 1]])
            try:
                _RAW.decode(b"".join([*parts, text[resume : at + 1]]))
            except msgspec.DecodeError as e:
                raise DecodeError(str(e)) from None
            outer = pieces[-1]
            outer[1] += [text[outer[2] : start], b"[]" if text[start] == 0x5B else b"{}"]
            outer[2] = at + 1
        depth -= 1
    raise AssertionError("_shallow needs a closed value")  # _first_value found its end


def _keep_or_replace(match: re.Match[str]) -> str:
    escape = match.group(1)
    if len(escape) == 5 and escape[0] == "u":  # a surrogate escape standing alone
        return "\\ufffd"
    return match.group(0)


def document(body: bytes, kind_name: str) -> Any:
    """The first JSON value of `body`, as Go's json.Decoder reads it (see the module
    docstring); raises DecodeError with a Go-like message."""
    text = _first_value(body, kind_name)
    return None if text is None else _full(text)


def _full(text: bytes) -> Any:
    """Every value of the document `text` decoded (numbers as Decimal)."""
    try:
        return _DOCUMENT.decode(text)
    except msgspec.DecodeError as e:
        raise DecodeError(str(e)) from None


def _first_value(body: bytes, kind_name: str) -> bytes | None:
    """The text of `body`'s first JSON value as Go's json.Decoder reads it (invalid UTF-8
    and lone surrogate escapes replaced), an object or an array; None for `null`. Raises
    DecodeError with a Go-like message for anything else."""
    start = len(body) - len(body.lstrip(b" \t\n\r"))  # JSON's whitespace, as Go's
    if start == len(body):
        raise DecodeError("EOF")
    first = body[start : start + 1]
    if body[start : start + 4] == b"null":
        return None
    if first not in (b"{", b"["):
        what = {b'"': "string", b"t": "bool", b"f": "bool"}.get(first, "number")
        if first not in b'"tf-0123456789':
            what = "a value"  # not JSON at all: msgspec's message below says why
        # Go reads the whole value before unmarshalling it: one cut short by the end of the
        # body is `unexpected EOF`, a malformed one its syntax error
        if first == b'"':
            end = _string_end(body, start)
        else:
            literal = _LITERAL.match(body, start)
            end = literal.end() if literal else start + 1
        if end is None:
            raise DecodeError("unexpected EOF")
        _syntax(body[start:end], what_ends=end == len(body))
        raise DecodeError(f"json: cannot unmarshal {what} into Go value of type {kind_name}")
    end, deepest = _close(body, start)
    if end is None:  # no end: a syntax error before it, or a body cut short
        if deepest <= SHALLOW:
            _syntax(body[start:])
        raise DecodeError("unexpected EOF")
    text = body[start:end].decode("utf-8", "runner-go-replace")
    if "\\u" in text:
        text = _ESCAPE.sub(_keep_or_replace, text)
    value = text.encode()  # the same brackets where they were: only strings changed
    return value if deepest <= SHALLOW else _shallow(value)


_DOCUMENT = msgspec.json.Decoder(float_hook=decimal.Decimal)
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ELEMENTS = msgspec.json.Decoder(list[msgspec.Raw])


class _Irregular(Exception):
    """An occurrence Go cannot decode into its place (not the shape the place wants, or a
    value of the wrong type). Once, it leads to the whole document decoded instead, for that
    decode's error; `message` is said where the whole decode does not fail (a duplicate key
    later in the document hid the occurrence, which Go still refuses)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class _Duplicated(Exception):
    """A field met twice in one object (the same key, or two that fold to one field)."""


_ABSENT: Any = object()  # no value yet: the place keeps its zero value


def _at(path: tuple[str | int, ...]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _mismatch(raw: Any, kind: Any, path: tuple[str | int, ...]) -> str:
    """msgspec's message for `raw` decoded as `kind`, at `path`."""
    try:
        msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        return f"{e} - at `{_at(path)}`" if path else str(e)
    name = getattr(kind, "__name__", "int")  # `_Byte`, whose `-0` msgspec reads as 0
    return f"Expected `{name}`, got `{bytes(raw[:40]).decode()}` - at `{_at(path)}`"


class _Walk:
    """The members of `body` that fields of the request type take, decoded as Go's
    json.Decoder fills a zero-valued struct, into what `_normalise_keys` gives for a
    document (folded keys, ZERO for null elements); the values of other members are only
    checked for syntax (msgspec skips them), never built: a 45 MB array under an unknown key
    took 7-8 s to build with the GIL held, during which /v1/status could not answer.

    Go decodes each member in order into the field's current value: a duplicate (the same
    key, or one that folds to the same field) merges into an object's fields, decodes an
    array's elements into the slice's elements (also those past its length that an earlier,
    longer array left), and `null` is a no-op except that it empties a slice; an occurrence
    of the wrong type fails the decode even when a later one is right. Without duplicates
    that is what decoding the whole document gives, and `strict=False` walks it fast, raising
    `_Duplicated` at the first duplicate; `strict=True` follows Go member by member, every
    value checked against its field's type where it occurs."""

    def __init__(self, key: Callable[[str], str], strict: bool):
        self.key, self.strict = key, strict
        # id of a slice -> (the slice, its elements past its length)
        self.past_length: dict[int, tuple[list[Any], list[Any]]] = {}
        # path of a []byte field decoded from an array -> its bytes past the visible length
        self.bytes_past: dict[tuple[str | int, ...], bytes] = {}

    def value(self, raw: Any, place: _Place, existing: Any, path: tuple[str | int, ...]) -> Any:
        info = place.info
        past: list[Any] = []
        if isinstance(info, msgspec.inspect.ListType) and isinstance(existing, list):
            past = self.past_length.pop(id(existing), (None, []))[1]
        if place.go_bytes and bytes(memoryview(raw)[:1]) != b"[":
            self.bytes_past.pop(path, None)  # a string or null: a new slice (or nil)
        if _is_null(raw):  # Go: nil for a slice, otherwise nothing changes
            if place.go_bytes:
                return ""
            return [] if isinstance(info, msgspec.inspect.ListType) else existing
        head = bytes(memoryview(raw)[:1])
        if place.go_bytes and head == b"[":
            return self.byte_array(raw, existing, path)
        if isinstance(info, msgspec.inspect.StructType):
            if head != b"{":
                raise _Irregular(_mismatch(raw, place.kind, path))
            return self.members(raw, _fields(info.cls), existing, path)
        if isinstance(info, msgspec.inspect.ListType):
            if head != b"[":
                raise _Irregular(_mismatch(raw, list, path))
            return self.elements(raw, place.item, existing, past, path)
        value = _normalise_keys(_DOCUMENT.decode(raw), self.key)  # a scalar place
        value = _numbers(value, place.go_float32)
        if self.strict:
            place.check(value, path)
        return value

    def members(self, raw: Any, fields: dict[str, _Place], existing: Any, path: tuple) -> Any:
        out = existing if isinstance(existing, dict) else {}
        members = _MEMBERS.decode(raw)  # the last of each key, syntax checked
        pairs: Any = members.items()
        if _dropped(raw, members):
            if not self.strict:
                raise _Duplicated
            pairs = _member_pairs(raw)
        for name, value in pairs:
            folded = self.key(name)
            place = fields.get(folded)
            if place is None:
                continue
            if folded in out and not self.strict:
                raise _Duplicated
            found = self.value(value, place, out.get(folded, _ABSENT), (*path, folded))
            if found is not _ABSENT:
                out[folded] = found
        return out

    def byte_array(self, raw: Any, existing: Any, path: tuple) -> str:
        """A Go []byte written as an array of numbers, as base64 (the field's type here);
        a null element keeps the byte the slice held there, also past the length an earlier,
        longer array left (the slice's backing array, as for any slice: `elements`)."""
        held = b""
        if isinstance(existing, str):
            with contextlib.suppress(ValueError):
                held = media_bytes(existing)
        held += self.bytes_past.pop(path, b"")
        out = bytearray()
        for i, element in enumerate(_ELEMENTS.decode(raw)):
            if _is_null(element):
                out.append(held[i] if i < len(held) else 0)
            elif _UINT8.fullmatch(bytes(element)) and int(bytes(element)) <= 255:
                out.append(int(bytes(element)))
            else:
                raise _Irregular(_mismatch(element, _Byte, (*path, i)))
        if len(held) > len(out):
            self.bytes_past[path] = held[len(out) :]
        return base64.b64encode(bytes(out)).decode()

    def elements(
        self, raw: Any, item: _Place, existing: Any, past: list[Any], path: tuple
    ) -> list[Any]:
        elements = _ELEMENTS.decode(raw)
        if not elements:  # Go makes a new empty slice
            return []
        backing = [*existing, *past] if isinstance(existing, list) else []
        for i, element in enumerate(elements):
            old = backing[i] if i < len(backing) else _ABSENT
            found = self.value(element, item, old, (*path, i))
            found = ZERO if found is _ABSENT else found
            if i < len(backing):
                backing[i] = found
            else:
                backing.append(found)
        visible = backing[: len(elements)]
        if len(backing) > len(elements):  # kept with the list, so that its id stays its own
            self.past_length[id(visible)] = (visible, backing[len(elements) :])
        return visible


# Go's uint8 from a number: strconv.ParseUint's digits (no sign, fraction or exponent).
_UINT8 = re.compile(rb"0|[1-9][0-9]{0,2}")
_Byte = Annotated[int, msgspec.Meta(ge=0, le=255)]


class _Place:
    """A field's or an element's type: msgspec's description, and the annotation to check
    a value with. `go_bytes`: a `GoBytes` field."""

    def __init__(self, kind: Any):
        self.kind, self.go_bytes = kind, False
        self.info = msgspec.inspect.type_info(kind)
        self.go_float32 = _is_float32(self.info)
        while isinstance(self.info, msgspec.inspect.Metadata):
            self.go_bytes |= (self.info.extra or {}).get("go") == "[]byte"
            self.info = self.info.type
        item = self.info.item_type if isinstance(self.info, msgspec.inspect.ListType) else None
        self._item_kind = None if item is None else kind.__args__[0]

    @functools.cached_property
    def item(self) -> _Place:
        return _Place(self._item_kind)

    def check(self, value: Any, path: tuple[str | int, ...]) -> None:
        try:
            msgspec.convert(value, self.kind, strict=True)
            if self.go_bytes:
                media_bytes(value)
        except (msgspec.ValidationError, ValueError) as e:
            raise _Irregular(f"{e} - at `{_at(path)}`") from None


_PLACES: dict[type, _Place] = {}
_FIELDS: dict[type, dict[str, _Place]] = {}


def _place(kind: type) -> _Place:
    """A request type as a place, computed once."""
    if kind not in _PLACES:
        _PLACES[kind] = _Place(kind)
    return _PLACES[kind]


def _fields(cls: type) -> dict[str, _Place]:
    """A struct's fields by encoded name, computed once."""
    if cls not in _FIELDS:
        _FIELDS[cls] = {f.encode_name: _Place(f.type) for f in msgspec.structs.fields(cls)}
    return _FIELDS[cls]


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


_WS = rb"[ \t\n\r]*"
# A member's key and its punctuation: the text between two members' values.
_KEY = re.compile(_WS + rb",?" + _WS + rb'("[^"\\]*(?:\\.[^"\\]*)*")' + _WS + b":" + _WS)
_OBJECT_END = re.compile(_WS + rb"}")


def _dropped(raw: Any, members: dict[str, msgspec.Raw]) -> bool:
    """Whether the object `raw` has members msgspec's dict does not hold (it keeps the last
    of a key): its kept values are views of `raw`, and between them must be only keys."""
    if not members:
        return False
    base = _address(raw)
    spans = sorted((_address(v) - base, len(v)) for v in members.values())
    end = 1  # after the opening brace
    for start, length in spans:
        if not _KEY.fullmatch(raw, end, start):  # a key, and no other member
            return True
        end = start + length
    return not _OBJECT_END.fullmatch(raw, end)


_LITERAL = re.compile(rb"[^,\]} \t\n\r]+")  # a number, true, false or null


def _member_pairs(raw: Any) -> list[tuple[str, bytes]]:
    """The members of the (well-formed) object `raw` in order, duplicates kept."""
    text, pos = bytes(raw), 1
    pairs: list[tuple[str, bytes]] = []
    while (key := _KEY.match(text, pos)) is not None:
        start = key.end()
        if text[start] in b"[{":
            end, _ = _close(text, start)
        elif text[start] == 0x22:
            end = _string_end(text, start)
        else:
            end = _LITERAL.match(text, start).end()  # type: ignore[union-attr]
        assert end is not None  # the text is well-formed
        pairs.append((msgspec.json.decode(key.group(1)), text[start:end]))
        pos = end
    return pairs


def _is_null(raw: msgspec.Raw) -> bool:
    return len(raw) == 4 and bytes(raw) == b"null"


_AT_BYTE = re.compile(r"invalid number \(byte (\d+)\)")


def _syntax(text: bytes, what_ends: bool = True) -> None:
    """Raise the decoder's message for malformed JSON; `unexpected EOF`, as Go says, when
    the text is only cut short at the end of the body (`what_ends`): msgspec says so for a
    string or literal, and calls a number cut at the end (`-`, `1.`, `1e`) invalid."""
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError as e:
        at = _AT_BYTE.search(str(e))
        cut = "truncated" in str(e) or (at is not None and int(at.group(1)) >= len(text))
        if not (cut and what_ends):
            raise DecodeError(str(e)) from None
        raise DecodeError("unexpected EOF") from None


def decode(body: bytes, kind: type[T], key: Callable[[str], str]) -> T:
    """Go's json.Decoder into a zero-valued struct: keys matched through `key`."""
    text = _first_value(body, kind.__name__)
    if text is None:  # Go decodes `null` into a struct as a no-op
        return kind()
    place = _place(kind)
    try:  # only the fields `kind` has (unknown members' values are only syntax-checked)
        try:
            normalised = _Walk(key, strict=False).value(text, place, _ABSENT, ())
        except _Duplicated:  # Go's order of members matters: follow it
            normalised = _Walk(key, strict=True).value(text, place, _ABSENT, ())
    except (_Irregular, msgspec.DecodeError, msgspec.ValidationError) as e:
        document = _full(text)  # the whole document: its own error, or the same result
        if not isinstance(document, dict):
            raise DecodeError(
                f"json: cannot unmarshal array into Go value of type {kind.__name__}"
            ) from None
        if isinstance(e, _Irregular):  # hidden by a later duplicate: Go refuses it still
            raise DecodeError(e.message) from None
        normalised = _normalise_keys(document, key)
    filled = _zero_fill(normalised, place.info)
    try:
        return msgspec.convert(filled, kind, strict=True)
    except (msgspec.ValidationError, ValueError) as e:  # ValueError: bad base64 (MediaItem)
        raise DecodeError(str(e)) from None
