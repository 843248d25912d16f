"""Wire types of the runner protocol, spelled as the Go structs are (docs/PROTOCOL.md §3).

Decoding follows Go's `json.Decoder.Decode` into a zero-valued struct (`go_document`):
- only the first JSON value of the body is read; whatever follows it is ignored;
- keys match case-insensitively (Unicode simple folding: `Optionſ` is `Options`), unknown
  keys are ignored and their values are only checked for syntax (`1e400` under an unknown key
  is fine); `null` leaves the zero value, also as an element of an array;
  `/v1/score` goes further: its keys also match with underscores left out (`max_tokens`,
  `MaxTokens`, `maxtokens` are one key);
- a byte of invalid UTF-8 inside a string, and a `\\u` escape of a lone surrogate, become
  U+FFFD, one per byte (Go's `utf8.DecodeRune`);
- integers must fit Go's int (int64), and numbers for Go's float32 fields must round to a
  finite float32 (`3.4028235e38`, Go's own spelling of the largest, is fine);
- base64 (`[]byte` fields) may hold CR and LF, which Go's decoder skips;
- nesting deeper than `MAX_DEPTH` is refused (Go allows 10,000; msgspec's recursion stops
  near 1,000, so the runner draws its own line well below).
Encoding follows Go's `json.Encoder`: a non-finite float cannot be written (`go_encodable`).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import decimal
import math
import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

import msgspec

T = TypeVar("T")
MAX_DEPTH = 500
# Halfway between float32's largest value and the next power of two: what rounds below it is
# finite in float32 (Go's ParseFloat(s, 32)), what reaches it rounds to infinity.
FLOAT32_LIMIT = 3.4028235677973366e38
GoInt = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
GoFloat32 = Annotated[float, msgspec.Meta(gt=-FLOAT32_LIMIT, lt=FLOAT32_LIMIT)]


class MediaItem(msgspec.Struct):
    data: str = ""  # base64 on the wire, as Go's []byte; `media_bytes` decodes it
    id: GoInt = 0
    kind: str = ""

    def __post_init__(self) -> None:
        media_bytes(self.data)  # a body with bad base64 does not decode, as in Go

    @property
    def raw(self) -> bytes:
        """The item's bytes."""
        return media_bytes(self.data)


def media_bytes(data: str) -> bytes:
    """Go's base64.StdEncoding.Decode of a []byte field: CR and LF are skipped, padding is
    required; a ValueError says where the input went wrong."""
    text = data.replace("\r", "").replace("\n", "")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("illegal base64 data") from None


class ScoreRow(msgspec.Struct):
    prompt: str = ""
    candidates: list[str] = msgspec.field(default_factory=list)


class ScoreRequest(msgspec.Struct):
    rows: list[ScoreRow] = msgspec.field(default_factory=list)
    maxtokens: GoInt = 0
    media: list[MediaItem] = msgspec.field(default_factory=list)


class ScoreResponse(msgspec.Struct):
    logits: list[list[float]]
    input_tokens: int
    cached_tokens: int


class StatusResponse(msgspec.Struct):
    Status: int
    Progress: int
    ContextLength: int
    Memory: int


class DecodeError(ValueError):
    """The body is not JSON of the expected shape; the message is the decoder's."""


class _Zero:
    """A null array element: the element type's zero value, as Go leaves it."""


ZERO = _Zero()


def _normalise_keys(value: Any, key: Callable[[str], str]) -> Any:
    """Keys through `key`, recursively; null members dropped and null elements marked `ZERO`
    (Go leaves the zero value for both); numbers (read as Decimal, so that a number too large
    for a float only fails where a field needs it) as float."""
    if isinstance(value, dict):
        return {key(k): _normalise_keys(v, key) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [ZERO if v is None else _normalise_keys(v, key) for v in value]
    if isinstance(value, decimal.Decimal):
        return float(value)  # beyond float64: an infinity, which no field accepts
    return value


def _zero_fill(value: Any, info: msgspec.inspect.Type) -> Any:
    """Replace `ZERO` elements by the zero value of their place in the target type."""
    if isinstance(info, msgspec.inspect.Metadata):
        return _zero_fill(value, info.type)
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        for field in info.fields:
            if field.encode_name in value:
                value[field.encode_name] = _zero_fill(value[field.encode_name], field.type)
    elif isinstance(info, msgspec.inspect.ListType) and isinstance(value, list):
        item = info.item_type
        return [_zero_of(item) if v is ZERO else _zero_fill(v, item) for v in value]
    return value


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

# Where a token may start: a string's opening quote, or a bracket. A plain search, ~10 ms a
# MB; a search for whole tokens tried the string pattern at every byte (33-96 ms a MB).
_TOKEN_START = re.compile(rb'[\[\]{}"]')
# A string's plain characters and whole escapes (unrolled: runs of plain characters in one
# step, ~10 ms a MB; one alternation per character took ~200 ms), stopping before its
# closing quote, at a backslash whose escaped byte is past the call's end, or at that end.
# It cannot fail, so it never backtracks over a long string as `"..."` does when the closing
# quote is missing.
_STRING_PART = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)


def _tokens(body: bytes, start: int, window: int = SCAN_WINDOW) -> Iterator[tuple[int, int]]:
    """The spans that `finditer` of the per-character pattern `"(?:[^"\\]|\\.)*"|[][{}]`
    (DOTALL) finds from `start`: string literals, and brackets outside them; a quote that
    never closes is passed over as finditer passes it. No regex call covers more than
    `window` bytes, so a long run lets the GIL go between calls."""
    pos, n = start, len(body)
    while pos < n:
        stop = min(pos + window, n)
        found = _TOKEN_START.search(body, pos, stop)
        if found is None:
            pos = stop
            continue
        at = found.start()
        if body[at] != 0x22:  # a bracket
            yield at, at + 1
            pos = at + 1
            continue
        end = _string_end(body, at, window)
        if end is None:  # never closes: finditer goes on from the next byte
            pos = at + 1
            continue
        yield at, end
        pos = end


def _string_end(body: bytes, quote: int, window: int) -> int | None:
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


def _keep_or_replace(match: re.Match[str]) -> str:
    escape = match.group(1)
    if len(escape) == 5 and escape[0] == "u":  # a surrogate escape standing alone
        return "\\ufffd"
    return match.group(0)


def go_document(body: bytes, kind_name: str) -> Any:
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
            _syntax(body[start:])
        raise DecodeError(f"json: cannot unmarshal {what} into Go value of type {kind_name}")
    depth, end = 0, None
    for at, token_end in _tokens(body, start):
        bracket = body[at : at + 1]
        if bracket in (b"{", b"["):
            depth += 1
            if depth > MAX_DEPTH:
                raise DecodeError(f"exceeded max depth ({MAX_DEPTH})")
        elif bracket in (b"}", b"]"):
            depth -= 1
            if depth == 0:
                end = token_end
                break
    if end is None:  # no end: a syntax error before it, or a body cut short
        _syntax(body[start:])
        raise DecodeError("unexpected EOF")
    text = body[start:end].decode("utf-8", "runner-go-replace")
    if "\\u" in text:
        text = _ESCAPE.sub(_keep_or_replace, text)
    return text.encode()


_DOCUMENT = msgspec.json.Decoder(float_hook=decimal.Decimal)
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ELEMENTS = msgspec.json.Decoder(list[msgspec.Raw])


class _Irregular(Exception):
    """A value `_known` does not follow (not the shape its place wants): the document is
    decoded whole instead, so that the error or the result is the full decode's."""


def _known(raw: Any, info: msgspec.inspect.Type, key: Callable[[str], str]) -> Any:
    """What `_normalise_keys(_full(raw), key)` gives, less the members no field of `info`
    takes: those values are only checked for syntax (as msgspec skips them), never built.
    A 45 MB array under an unknown key took 7-8 s to build as Python objects with the GIL
    held, during which the event loop could not answer /v1/status; skipped, ~0.1 s."""
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    head = bytes(memoryview(raw)[:1])
    if isinstance(info, msgspec.inspect.StructType):
        if head != b"{":
            raise _Irregular
        fields = {f.encode_name: f.type for f in info.fields}
        out = {}
        for name, value in _MEMBERS.decode(raw).items():
            folded = key(name)
            if folded in fields and not _is_null(value):  # null: the zero value, as Go
                out[folded] = _known(value, fields[folded], key)
        return out
    if isinstance(info, msgspec.inspect.ListType):
        if head != b"[":
            raise _Irregular
        return [
            ZERO if _is_null(v) else _known(v, info.item_type, key) for v in _ELEMENTS.decode(raw)
        ]
    return _normalise_keys(_DOCUMENT.decode(raw), key)  # a scalar place, or any other type


def _is_null(raw: msgspec.Raw) -> bool:
    return len(raw) == 4 and bytes(raw) == b"null"


def _syntax(text: bytes) -> None:
    """Raise the decoder's message for malformed JSON (nothing when the text is only cut
    short, which the caller reports as Go does: unexpected EOF)."""
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError as e:
        if "truncated" not in str(e):
            raise DecodeError(str(e)) from None


def _decode(body: bytes, kind: type[T], key: Callable[[str], str]) -> T:
    """Go's json.Decoder into a zero-valued struct: keys matched through `key`."""
    text = _first_value(body, kind.__name__)
    if text is None:  # Go decodes `null` into a struct as a no-op
        return kind()
    info = _type_info(kind)
    try:  # only the fields `kind` has (unknown members' values are only syntax-checked)
        normalised = _known(text, info, key)
    except (_Irregular, msgspec.DecodeError, msgspec.ValidationError):
        document = _full(text)  # the whole document: its own error, or the same result
        if not isinstance(document, dict):
            raise DecodeError(
                f"json: cannot unmarshal array into Go value of type {kind.__name__}"
            ) from None
        normalised = _normalise_keys(document, key)
    filled = _zero_fill(normalised, info)
    try:
        return msgspec.convert(filled, kind, strict=True)
    except (msgspec.ValidationError, ValueError) as e:  # ValueError: bad base64 (MediaItem)
        raise DecodeError(str(e)) from None


_TYPE_INFO: dict[type, msgspec.inspect.Type] = {}


def _type_info(kind: type) -> msgspec.inspect.Type:
    """msgspec's description of `kind`, computed once (it walks every field)."""
    if kind not in _TYPE_INFO:
        _TYPE_INFO[kind] = msgspec.inspect.type_info(kind)
    return _TYPE_INFO[kind]


def _score_key(key: str) -> str:
    return fold_key(key.replace("_", ""))


def decode_score_request(body: bytes) -> ScoreRequest:
    return _decode(body, ScoreRequest, _score_key)


_json_encoder = msgspec.json.Encoder()


def encode_json(value: Any) -> bytes:
    """JSON plus the trailing newline that Go's json.Encoder writes."""
    return _json_encoder.encode(value) + b"\n"


def go_encodable(value: Any) -> bool:
    """Whether Go's json.Encoder could write `value`: it refuses NaN and infinities (and
    then writes nothing at all), where msgspec would write `null`, which a Go client reads
    as 0 without an error."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(go_encodable(v) for v in value)
    if isinstance(value, msgspec.Struct):
        return all(go_encodable(getattr(value, f)) for f in value.__struct_fields__)
    return True


# --- /v1/completions ------------------------------------------------------------------------
# CompletionRequest and CompletionResponse have no JSON tags in Go, so their keys are the Go
# field names; api.Options keys are its snake_case tags. Go matches keys case-insensitively
# but, unlike /v1/score, does not drop underscores: `decode_completion_request` lowercases keys
# only, and these structs spell every field in lowercase.


class Options(msgspec.Struct):
    """api.Options with its embedded Runner options. Fields the runner does not use are
    declared anyway so that a value of the wrong type fails decoding as it does in Go."""

    num_ctx: GoInt = 0
    num_batch: GoInt = 0
    num_gpu: GoInt = 0
    main_gpu: GoInt = 0
    use_mmap: bool = False
    num_thread: GoInt = 0
    draft_num_predict: GoInt = 0
    num_keep: GoInt = 0
    seed: GoInt = 0
    num_predict: GoInt = 0
    top_k: GoInt = 0
    top_p: GoFloat32 = 0.0
    min_p: GoFloat32 = 0.0
    typical_p: GoFloat32 = 0.0
    repeat_last_n: GoInt = 0
    temperature: GoFloat32 = 0.0
    repeat_penalty: GoFloat32 = 0.0
    presence_penalty: GoFloat32 = 0.0
    frequency_penalty: GoFloat32 = 0.0
    stop: list[str] = msgspec.field(default_factory=list)


class CompletionRequest(msgspec.Struct):
    prompt: str = ""
    media: list[MediaItem] = msgspec.field(default_factory=list)
    options: Options = msgspec.field(default_factory=Options)
    logprobs: bool = False
    toplogprobs: GoInt = 0


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float


class Logprob(msgspec.Struct, omit_defaults=True):
    """llm.Logprob: TokenLogprob's fields promoted, `top_logprobs` omitted when empty."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class StatusError(msgspec.Struct):
    StatusCode: int
    Status: str
    error: str


class CompletionResponse(msgspec.Struct):
    Content: str = ""
    Done: bool = False
    DoneReason: int = 0
    PromptEvalCount: int = 0
    PromptEvalDuration: int = 0  # nanoseconds, as Go's time.Duration
    EvalCount: int = 0
    EvalDuration: int = 0
    Logprobs: list[Logprob] | None = None  # Go's nil slice: null, never []
    Error: StatusError | None = None


def decode_completion_request(body: bytes) -> CompletionRequest:
    return _decode(body, CompletionRequest, fold_key)
