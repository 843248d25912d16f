"""bench/fuzz/go_oracle.py, the fuzz's model of Go's `json.NewDecoder(body).Decode(&request)`,
checked two ways:

- against Go's documented behaviour (the encoding/json and strconv docs, and the scanner's
  messages): bodies whose fate in Go is known, each with the rule it shows and the result
  written out. Every accepted value and every message here was also checked against Go
  1.19's own encoding/json with structs spelled as docs/PROTOCOL.md §3 spells them (the
  /v1/score underscore rule of §3.1 is the runner's protocol, not Go's, and has cases of its
  own);
- against the runner's decoder (runner/protocol/go_json.py `decode` through wire.py's
  `decode_score_request` / `decode_completion_request`, and `document`), written apart from
  it: on a corpus of generated fuzz bodies (a fixed seed) and the hand-written bodies here,
  both must accept and refuse alike and decode to the same values.

A value is written as `go_shape` writes it: a struct's fields by docs/openapi.yaml's names,
those at Go's zero value left out (a nil slice is a zero, an empty one `[]` is not), []byte
as base64, float32 fields as the float32 value.
"""

from __future__ import annotations

import base64
import decimal
import re
import struct
from typing import Any

import msgspec
import pytest

from bench.fuzz.cases import generate_cases
from bench.fuzz.go_oracle import (
    GoSyntaxError,
    go_scan,
    go_unquote,
    go_verdict,
    request_types,
)
from runner.protocol import go_json
from runner.protocol.go_json import DecodeError, fold_key, media_bytes
from runner.protocol.wire import _score_key, decode_completion_request, decode_score_request

SCORE, COMPLETIONS = "score", "completions"
ROW = b'{"prompt":"Is it","candidates":[" the"]}'
FFFD = "\ufffd"


def f32(x: float) -> float:
    """`x` rounded to float32 (Go's float32 of a value that float64 holds exactly)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
F32_TINIEST = struct.unpack("<f", struct.pack("<I", 1))[0]  # the smallest subnormal


class Refused:
    """Go's Decode returns an error; `message`: its text (None: a type error, whose text the
    oracle does not spell as Go does)."""

    def __init__(self, message: str | None = None):
        self.message = message

    def __repr__(self) -> str:
        return f"Refused({self.message!r})"


def _zero(typ: Any) -> Any:
    return {"struct": {}, "slice": None, "bytes": None, "str": "", "bool": False}.get(typ[0], 0)


def go_shape(value: Any, typ: Any) -> Any:
    """A decoded Go value written as the expectations below are (see the module docstring)."""
    kind = typ[0]
    if kind == "struct":
        out = {}
        for name, ftype in typ[2].items():
            shaped = go_shape((value or {}).get(name, _zero(ftype)), ftype)
            nil = ftype[0] in ("slice", "bytes") and shaped is None
            if not nil and (ftype[0] in ("slice", "bytes") or shaped not in ({}, "", 0)):
                out[name] = shaped
        return out
    if kind == "slice":
        return None if value is None else [go_shape(v, typ[1]) for v in value]
    if kind == "bytes":
        return None if value is None else base64.b64encode(value).decode()
    return value


def decoded(endpoint: str, body: bytes) -> Any:
    """The oracle's verdict on `body`: a Refused or the decoded value's shape."""
    verdict = go_verdict(endpoint, body)
    if not verdict.ok:
        return Refused(verdict.error)
    return go_shape(verdict.value, request_types()[endpoint])


# --- Go's documented behaviour ------------------------------------------------------------------


def _rows(*prompts: str) -> dict:
    return {"rows": [{"prompt": p} for p in prompts]}


GO_RULES = [
    # Keys: "Unmarshal matches incoming object keys to the keys used by Marshal (either the
    # struct field name or its tag), preferring an exact match but also accepting a
    # case-insensitive match" -- under Unicode simple case folding (bytes.EqualFold; Go 1.21+
    # foldName): ſ (U+017F) folds with s, the Kelvin sign (U+212A) with k.
    (COMPLETIONS, b'{"pRoMpT":"x"}', {"Prompt": "x"}),
    (COMPLETIONS, '{"Optionſ":{"top_k":2}}'.encode(), {"Options": {"top_k": 2}}),
    (COMPLETIONS, '{"Options":{"top_\u212a":2}}'.encode(), {"Options": {"top_k": 2}}),
    (
        COMPLETIONS,
        '{"OPTIONS":{"ſEED":3,"TOP_\u212a":4}}'.encode(),
        {"Options": {"seed": 3, "top_k": 4}},
    ),
    # ... and nothing else: İ (U+0130) and ı (U+0131) have no simple folding to i
    (COMPLETIONS, '{"\u0130ptions":{"top_k":2},"Opt\u0131ons":{"top_k":2}}'.encode(), {}),
    # ... an underscore is a character like any other: `topk` is not `top_k`
    (COMPLETIONS, b'{"Options":{"topk":2,"TOP_K":3}}', {"Options": {"top_k": 3}}),
    # ... keys are unquoted before they are matched (escapes; invalid UTF-8 is U+FFFD)
    (COMPLETIONS, b'{"Pr\\u006fmpt":"x","Prompt\xff":"y"}', {"Prompt": "x"}),
    # Unknown keys: "Unmarshal ignores keys that don't match" -- their values are scanned for
    # syntax only, so a number no Go type holds is fine there
    (SCORE, b'{"x":1e400,"max_tokens":3}', {"max_tokens": 3}),
    (SCORE, b'{"x":[1,{"y":-1e999,"z":"\xff"}],"max_tokens":3}', {"max_tokens": 3}),
    (SCORE, b'{"x":NaN}', Refused("invalid character 'N' looking for beginning of value")),
    (SCORE, b'{"x":"\x01"}', Refused("invalid character '\\x01' in string literal")),
    # A key given twice: each occurrence is decoded in turn into the same value. Objects merge
    # ("Unmarshal ... keeps existing map entries"; a struct's fields are set one by one)
    (
        COMPLETIONS,
        b'{"Options":{"top_k":2},"Options":{"seed":3}}',
        {"Options": {"seed": 3, "top_k": 2}},
    ),
    (COMPLETIONS, b'{"Prompt":"a","prompt":"b"}', {"Prompt": "b"}),
    # ... an array "resets the slice length to zero and then appends each element": the
    # decoder decodes element i into the slice's element i, also past its length while within
    # its capacity, so an earlier, longer array's elements come back
    (
        SCORE,
        b'{"rows":[' + ROW + b'],"rows":[{"prompt":"x"}]}',
        {"rows": [{"prompt": "x", "candidates": [" the"]}]},
    ),
    (
        SCORE,
        b'{"rows":[' + ROW + b"," + ROW + b'],"rows":[{"prompt":"x"}],"rows":[{},{}]}',
        {
            "rows": [
                {"prompt": "x", "candidates": [" the"]},
                {"prompt": "Is it", "candidates": [" the"]},
            ]
        },
    ),
    # ... an empty array is a new empty slice (nothing comes back)
    (SCORE, b'{"rows":[' + ROW + b"," + ROW + b'],"rows":[],"rows":[{},{}]}', {"rows": [{}, {}]}),
    (
        COMPLETIONS,
        b'{"Options":{"stop":["a","b"]},"Options":{"stop":["c"]},"Options":{"stop":["d",null]}}',
        {"Options": {"stop": ["d", "b"]}},
    ),
    # ... a type error in any occurrence is the error, even when a later one is right
    (SCORE, b'{"max_tokens":"5","max_tokens":5}', Refused()),
    (SCORE, b'{"rows":[{"prompt":"a","candidates":true,"candidates":[" the"]}]}', Refused()),
    # null: "unmarshals into an interface, map, pointer, or slice by setting that Go value to
    # nil ... Otherwise, ... null ... has no effect on the value": it empties a slice, leaves a
    # number, string, bool or struct as it was (the zero value, unless a duplicate set it)
    (SCORE, b"null", {}),
    (SCORE, b'{"max_tokens":null,"rows":null,"media":null}', {}),
    (SCORE, b'{"max_tokens":5,"MAX_TOKENS":null}', {"max_tokens": 5}),
    (SCORE, b'{"rows":[' + ROW + b'],"ROWS":null}', {}),
    (COMPLETIONS, b'{"Options":{"top_k":2},"Options":null}', {"Options": {"top_k": 2}}),
    # ... and an element of null is the element's zero value (or what it held)
    (SCORE, b'{"rows":[null]}', {"rows": [{}]}),
    (
        COMPLETIONS,
        b'{"Options":{"stop":[null]},"Media":[null]}',
        {"Media": [{}], "Options": {"stop": [""]}},
    ),
    # Strings: "When unmarshaling quoted strings, invalid UTF-8 or invalid UTF-16 surrogate
    # pairs are not treated as an error. Instead, they are replaced by the Unicode replacement
    # character U+FFFD." One per byte that utf8.DecodeRune rejects (a truncated sequence, an
    # encoded surrogate, an overlong form, a code point past U+10FFFF)
    (SCORE, b'{"rows":[{"prompt":"a\xffb\xe2\x82\x28"}]}', _rows(f"a{FFFD}b{FFFD}{FFFD}(")),
    (SCORE, b'{"rows":[{"prompt":"\xed\xa0\x80|\xc0\xaf"}]}', _rows(FFFD * 3 + "|" + FFFD * 2)),
    (
        SCORE,
        b'{"rows":[{"prompt":"\xf4\x90\x80\x80\xf0\x9f\x98\x80"}]}',
        _rows(FFFD * 4 + "\U0001f600"),
    ),
    # ... a `\u` escape of a lone surrogate is U+FFFD; a pair is one rune
    (SCORE, b'{"rows":[{"prompt":"\\ud800|\\udc00\\ud800"}]}', _rows(f"{FFFD}|{FFFD}{FFFD}")),
    (
        SCORE,
        b'{"rows":[{"prompt":"\\ud800\\ud83d\\ude00\\ud83d\\u0041"}]}',
        _rows(f"{FFFD}\U0001f600{FFFD}A"),
    ),
    (SCORE, b'{"rows":[{"prompt":"\\\\ud800\\u0000"}]}', _rows("\\ud800\x00")),
    # int fields: strconv.ParseInt(literal, 10, 64): an integer literal within int64
    (SCORE, b'{"max_tokens":9223372036854775807}', {"max_tokens": 2**63 - 1}),
    (SCORE, b'{"max_tokens":-9223372036854775808}', {"max_tokens": -(2**63)}),
    (SCORE, b'{"max_tokens":-0}', {}),
    (SCORE, b'{"max_tokens":9223372036854775808}', Refused()),
    (SCORE, b'{"max_tokens":-9223372036854775809}', Refused()),
    (SCORE, b'{"max_tokens":1.0}', Refused()),
    (SCORE, b'{"max_tokens":1e2}', Refused()),
    # float32 fields: strconv.ParseFloat(literal, 32): the nearest float32; "more than 1/2
    # ULP away from the largest floating point number of the given size" is ErrRange, an
    # error; underflow is not an error (the nearest value, 0)
    (COMPLETIONS, b'{"Options":{"temperature":0.1}}', {"Options": {"temperature": f32(0.1)}}),
    (
        COMPLETIONS,
        b'{"Options":{"temperature":3.4028235e38}}',
        {"Options": {"temperature": F32_MAX}},
    ),
    (
        COMPLETIONS,
        b'{"Options":{"temperature":-3.4028235e38}}',
        {"Options": {"temperature": -F32_MAX}},
    ),
    # 2**128 - 2**103, the midpoint between the largest float32 and 2**128
    (
        COMPLETIONS,
        b'{"Options":{"temperature":340282356779733661637539395458142568448}}',
        Refused(),
    ),
    (COMPLETIONS, b'{"Options":{"temperature":3.5e38}}', Refused()),
    (COMPLETIONS, b'{"Options":{"top_p":-1e39}}', Refused()),
    (COMPLETIONS, b'{"Options":{"min_p":1e400}}', Refused()),
    (COMPLETIONS, b'{"Options":{"min_p":1' + b"0" * 400 + b"}}", Refused()),
    (COMPLETIONS, b'{"Options":{"temperature":1e-45}}', {"Options": {"temperature": F32_TINIEST}}),
    (COMPLETIONS, b'{"Options":{"temperature":-1e-46,"top_p":1e-999}}', {}),
    (COMPLETIONS, b'{"Options":{"top_p":0.' + b"0" * 400 + b"1}}", {}),
    # []byte: "Array and slice values encode as JSON arrays, except that []byte encodes as a
    # base64-encoded string": base64.StdEncoding (padded), whose decoder skips \r and \n
    # anywhere and nothing else; the bits past the last byte are not checked
    (
        SCORE,
        b'{"media":[{"data":"aGk="},{"data":"a\\nG\\rk=\\r\\n"},{"data":"aGl="}]}',
        {"media": [{"data": "aGk="}] * 3},
    ),
    (SCORE, b'{"media":[{"data":"aGk\\u003d"}]}', {"media": [{"data": "aGk="}]}),
    (
        SCORE,
        b'{"media":[{"data":""},{"data":[]},{"data":null}]}',
        {"media": [{"data": ""}, {"data": ""}, {}]},
    ),
    (SCORE, b'{"media":[{"data":"aGk"}]}', Refused()),
    (SCORE, b'{"media":[{"data":"aGk=\\t"}]}', Refused()),
    (SCORE, b'{"media":[{"data":" aGk="}]}', Refused()),
    (SCORE, b'{"media":[{"data":"aGk=aGk="}]}', Refused()),
    (SCORE, b'{"media":[{"data":"===="}]}', Refused()),
    # ... and, as any slice, an array of its elements (uint8: integers 0-255)
    (
        SCORE,
        b'{"media":[{"data":[104,105],"id":3,"Kind":"image"}]}',
        {"media": [{"data": "aGk=", "id": 3, "Kind": "image"}]},
    ),
    (SCORE, b'{"media":[{"data":[256]}]}', Refused()),
    (SCORE, b'{"media":[{"data":[1.0]}]}', Refused()),
    # Decoder.Decode "reads the next JSON-encoded value from its input": the first value
    # only; what follows it is never read
    (SCORE, b'{"max_tokens":5} trailing', {"max_tokens": 5}),
    (SCORE, b'{"max_tokens":5}{"max_tokens":6}', {"max_tokens": 5}),
    (SCORE, b'{"max_tokens":5}}\xff', {"max_tokens": 5}),
    (SCORE, b" null x", {}),
    (SCORE, b"nullx", {}),
    # Nesting: the scanner's maxNestingDepth is 10000; one level more is a SyntaxError
    # (`invalid character '[' exceeded max depth`), found as the scanner reaches it, before
    # the rest of the body; values that deep under unknown keys are fine
    (SCORE, b'{"x":' + b"[" * 9999 + b"]" * 9999 + b',"max_tokens":1}', {"max_tokens": 1}),
    (SCORE, b'{"x":' + b'{"y":' * 9999 + b"1" + b"}" * 9999 + b"}", {}),
    (
        SCORE,
        b'{"x":' + b"[" * 10000 + b"]" * 10000 + b"}",
        Refused("invalid character '[' exceeded max depth"),
    ),
    (SCORE, b'{"x":' + b'{"y":' * 10000, Refused("invalid character '{' exceeded max depth")),
    (SCORE, b"[" * 10001, Refused("invalid character '[' exceeded max depth")),
    (SCORE, b"[" * 10000 + b"]" * 10000, Refused()),  # a type error: 10000 levels are fine
    # The whole body must be JSON: Decode's error for no value at all is io.EOF (`EOF`), for
    # a value cut short io.ErrUnexpectedEOF (`unexpected EOF`); JSON's whitespace is space,
    # tab, CR and LF
    (SCORE, b"", Refused("EOF")),
    (SCORE, b" \t\r\n", Refused("EOF")),
    (SCORE, b"{", Refused("unexpected EOF")),
    (SCORE, b"nul", Refused("unexpected EOF")),
    (SCORE, b'"abc', Refused("unexpected EOF")),
    (SCORE, b'{"a":tr', Refused("unexpected EOF")),
    (SCORE, b'{"a":"abc', Refused("unexpected EOF")),
    (SCORE, b'{"a":"\\u12', Refused("unexpected EOF")),
    (SCORE, b'{"a":-', Refused("unexpected EOF")),
    (SCORE, b'{"a":1.', Refused("unexpected EOF")),
    (SCORE, b'{"a":1e+', Refused("unexpected EOF")),
    (SCORE, b'{"a"', Refused("unexpected EOF")),
    (SCORE, b'{"a":1,', Refused("unexpected EOF")),
    (SCORE, b"[1,", Refused("unexpected EOF")),
    # ... otherwise the scanner's SyntaxError for the first byte that cannot continue
    (SCORE, b"\x0c{}", Refused("invalid character '\\f' looking for beginning of value")),
    (
        SCORE,
        b"\xef\xbb\xbf{}",
        Refused("invalid character '\u00ef' looking for beginning of value"),
    ),
    (SCORE, b'{"a":01}', Refused("invalid character '1' after object key:value pair")),
    (SCORE, b'{"a":1.x}', Refused("invalid character 'x' after decimal point in numeric literal")),
    (SCORE, b'{"a":1ex}', Refused("invalid character 'x' in exponent of numeric literal")),
    (SCORE, b'{"a":-x}', Refused("invalid character 'x' in numeric literal")),
    (SCORE, b'{"a":tx}', Refused("invalid character 'x' in literal true (expecting 'r')")),
    (SCORE, b'{"a":nulL}', Refused("invalid character 'L' in literal null (expecting 'l')")),
    (SCORE, b'{"a" 1}', Refused("invalid character '1' after object key")),
    (SCORE, b"[1 2]", Refused("invalid character '2' after array element")),
    (SCORE, b"{,}", Refused("invalid character ',' looking for beginning of object key string")),
    (
        SCORE,
        b'{"a":1,}',
        Refused("invalid character '}' looking for beginning of object key string"),
    ),
    (SCORE, b"[1,]", Refused("invalid character ']' looking for beginning of value")),
    (SCORE, b'{"a":"\\x"}', Refused("invalid character 'x' in string escape code")),
    (SCORE, b'{"a":"\\\'"}', Refused("invalid character '\\'' in string escape code")),
    (
        SCORE,
        b'{"a":"\\u12G4"}',
        Refused("invalid character 'G' in \\u hexadecimal character escape"),
    ),
    (SCORE, b'{"a":\xff}', Refused("invalid character '\u00ff' looking for beginning of value")),
    (SCORE, b'{"a":\\}', Refused("invalid character '\\\\' looking for beginning of value")),
    # A value that is not an object: "cannot unmarshal array into Go value of type ..."
    (SCORE, b"[]", Refused()),
    (SCORE, b'"x"', Refused()),
    (SCORE, b"1", Refused()),
    (COMPLETIONS, b"true", Refused()),
    (COMPLETIONS, b'{"Options":[]}', Refused()),
    (COMPLETIONS, b'{"Logprobs":"true"}', Refused()),
    # float32: ParseFloat(s, 32) rounds the decimal once: below the midpoint past the largest
    # float32 is the largest float32, not an error (float64 would round this one up to it)
    (
        COMPLETIONS,
        b'{"Options":{"temperature":3.4028235677973366e38}}',
        {"Options": {"temperature": F32_MAX}},
    ),
    # ... and rounds it once: just above the midpoint between 1 and the next float32 (float64
    # rounds it onto the midpoint, from where float32's ties-to-even goes down to 1)
    (
        COMPLETIONS,
        b'{"Options":{"temperature":1.0000000596046447753906250001}}',
        {"Options": {"temperature": 1 + 2**-23}},
    ),
    # []byte is a slice: a third array decodes into what the first left past the second's
    # length (elements 1 and 2 keep 2 and 3; the runner's are 0)
    (
        SCORE,
        b'{"media":[{"data":[1,2,3],"data":[4],"data":[5,null,null]}]}',
        {"media": [{"data": "BQID"}]},
    ),
]

# docs/PROTOCOL.md §3.1: a /v1/score key also matches with its underscores left out (the
# runner's protocol, folded otherwise as Go folds)
SCORE_KEYS = [
    (SCORE, b'{"MaxTokens":4,"ROWS":[],"_max_tokens_":5}', {"rows": [], "max_tokens": 5}),
    (
        SCORE,
        '{"maxtokenſ":6,"Media":[{"DATA":"aGk=","i_d":2,"kind":"x"}]}'.encode(),
        {"max_tokens": 6, "media": [{"data": "aGk=", "id": 2, "Kind": "x"}]},
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "expected"), GO_RULES + SCORE_KEYS)
def test_the_oracle_decodes_as_go_does(endpoint, body, expected):
    got = decoded(endpoint, body)
    if isinstance(expected, Refused):
        assert isinstance(got, Refused), got
        if expected.message is not None:
            assert got.message == expected.message
    else:
        assert not isinstance(got, Refused), got
        assert got == expected


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b'a\\/b\\"\\\\\\b\\f\\n\\r\\t', 'a/b"\\\b\f\n\r\t'),
        (b"\\u00e9\\u00E9", "\u00e9\u00e9"),
        (b"\xc3\xa9\xc3", "\u00e9" + FFFD),
        (b"\xf8\x88\x80\x80\x80", FFFD * 5),  # no 5-byte UTF-8
        (b"\\udbff\\udfff\\udfff", "\U0010ffff" + FFFD),
    ],
)
def test_strings_unquote_as_go_unquotes_them(raw, text):
    assert go_unquote(raw) == text


def test_the_scan_reports_how_deep_the_first_value_nests():
    assert go_verdict(SCORE, b'{"x":[[{}]]} [[[[[[').depth == 4
    go_scan(b"[" * 10000 + b"]" * 10000)
    assert go_scan.deepest == 10000
    with pytest.raises(GoSyntaxError, match="exceeded max depth"):
        go_scan(b"[" * 10001 + b"]" * 10001)


# --- the runner's decoder against the oracle --------------------------------------------------

DECODE = {SCORE: decode_score_request, COMPLETIONS: decode_completion_request}
KEY = {SCORE: _score_key, COMPLETIONS: fold_key}  # the runner's field names: folded keys


def runner_shape(endpoint: str, value: Any, typ: Any) -> Any:
    """`msgspec.to_builtins` of the runner's request, written as `go_shape` writes the
    oracle's: Go's names, zero values left out (the runner has no nil slice: [] is left out
    too), []byte as the base64 of its bytes, float32 fields rounded to float32 (the runner
    holds the float64 nearest the literal, which MLX rounds so when it computes)."""
    kind = typ[0]
    if kind == "struct":
        out = {}
        for name, ftype in typ[2].items():
            shaped = runner_shape(endpoint, value[KEY[endpoint](name)], ftype)
            if shaped not in ({}, "", 0, []):
                out[name] = shaped
        return out
    if kind == "slice":
        return [runner_shape(endpoint, v, typ[1]) for v in value]
    if kind == "bytes":
        return base64.b64encode(media_bytes(value)).decode()
    if kind == "f32":
        return f32(value)
    return value


def oracle_as_runner(value: Any, typ: Any) -> Any:
    """`go_shape` less what the runner cannot tell apart: a nil slice from an empty one, an
    empty []byte from none."""
    kind = typ[0]
    if kind == "struct":
        out = {}
        for name, ftype in typ[2].items():
            shaped = oracle_as_runner((value or {}).get(name, _zero(ftype)), ftype)
            if shaped not in (None, {}, "", 0, []):
                out[name] = shaped
        return out
    if kind == "slice":
        return [oracle_as_runner(v, typ[1]) for v in value or []]
    if kind == "bytes":
        return base64.b64encode(value or b"").decode()
    return value


def disagreement(endpoint: str, body: bytes) -> str | None:
    """How the runner's decoding of `body` differs from the oracle's (None: it does not)."""
    verdict = go_verdict(endpoint, body)
    try:
        ours = msgspec.to_builtins(DECODE[endpoint](body))
    except DecodeError as e:
        return None if not verdict.ok else f"the runner refuses it ({e}), Go decodes it"
    if not verdict.ok:
        return f"the runner decodes it, Go refuses it ({verdict.error})"
    typ = request_types()[endpoint]
    want, got = oracle_as_runner(verdict.value, typ), runner_shape(endpoint, ours, typ)
    return None if want == got else f"Go decodes {want!r:.400}, the runner {got!r:.400}"


_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")


def _tree_value(node: Any, depth: int = 1, cut: int | None = None) -> Any:
    """A scanned tree as go_json.document gives it: the last of a key, numbers as int or
    Decimal, containers `cut` levels down emptied."""
    tag = node[0]
    if tag in ("obj", "arr"):
        if cut is not None and depth > cut:
            return {} if tag == "obj" else []
        if tag == "obj":
            return {k: _tree_value(v, depth + 1, cut) for k, v in node[1]}
        return [_tree_value(v, depth + 1, cut) for v in node[1]]
    if tag == "num":
        literal = node[1]
        return int(literal) if _INTEGER.fullmatch(literal) else decimal.Decimal(literal)
    return None if tag == "null" else node[1]


def document_disagreement(body: bytes) -> str | None:
    """How go_json.document's reading of `body`'s first value differs from the oracle's scan:
    both refuse what Go's scanner refuses; an object or array reads the same (deeper than
    go_json.SHALLOW levels, `document` empties the containers below that depth)."""
    try:
        node = go_scan(body)
    except GoSyntaxError as e:
        try:
            go_json.document(body, "Request")
        except DecodeError:
            return None
        return f"document reads it; Go's scanner refuses it ({e})"
    deepest = go_scan.deepest  # type: ignore[attr-defined]
    try:
        ours = go_json.document(body, "Request")
    except DecodeError as e:
        return f"document refuses an {node[0]} ({e})" if node[0] in ("obj", "arr") else None
    if node[0] not in ("obj", "arr", "null"):
        return f"document reads a {node[0]} as {ours!r:.100}"
    want = _tree_value(node, cut=go_json.SHALLOW if deepest > go_json.SHALLOW else None)
    return None if want == ours else f"document {ours!r:.300}, Go's scanner {want!r:.300}"


# Bodies beyond GO_RULES: more of the same rules, in other places and combinations
EDGE_BODIES = [
    (COMPLETIONS, '{"OPTIONS":{"TOP_\u212a":2,"\u017ftop":[1]}}'.encode()),
    (COMPLETIONS, b'{"Options":{"stop":["a","b"]},"Options":{"stop":["c",null]}}'),
    (COMPLETIONS, b'{"Media":[{"KIND":"image","Id":3,"DATA":"aGk="}],"Media":[{"id":4}]}'),
    (COMPLETIONS, b'{"Logprobs":true,"TopLogprobs":5,"Logprobs":null,"TopLogprobs":-0}'),
    (COMPLETIONS, b'{"Options":{"temperature":-0,"top_p":1E-1,"use_mmap":true,"seed":-1}}'),
    (COMPLETIONS, b'{"Options":{"temperature":340282346638528859811704183484516925440}}'),
    (COMPLETIONS, b'{"Options":{"temperature":3.4028235e38,"temperature":"x"}}'),
    (COMPLETIONS, b'{"Options":{"top_k":1' + b"0" * 400 + b"}}"),
    (COMPLETIONS, b'{"Media":{}}'),
    (SCORE, b'{"rows":[' + ROW + b"," + ROW + b'],"rows":[{"prompt":"x"}],"rows":[null,null]}'),
    (
        SCORE,
        b'{"rows":[{"candidates":["a","b","c"]}],"rows":[{"candidates":["x"]}],'
        b'"rows":[{"candidates":["y",null,null]}]}',
    ),
    (SCORE, b'{"media":[{"data":"AQIDBA==","data":[9,null,null,null,null]}]}'),
    (SCORE, b'{"media":[{"data":[1,2]},{"data":[3]}],"media":[{"data":[null,null,7]}]}'),
    (SCORE, b'{"media":[{"data":"aGk=","data":null}],"media":[{"data":"!!!!","data":"aGk="}]}'),
    (SCORE, b'{"media":[{"data":"aG=="},{"data":"aG=k"},{"data":"aGk=="},{"data":[-1]}]}'),
    (SCORE, b'{"rows":[{"prompt":"\\ud83d\\\\ude00\\uDBFF\\uDFFF"}],"r\\u006fws":[{}]}'),
    (SCORE, b'{"rows":{"prompt":"a"}}'),
    (SCORE, b'{"rows":[[]]}'),
    (SCORE, b'{"rows":[{"prompt":1}]}'),
    (SCORE, '{"":1,"🙂":2,"max_tokens":2}'.encode()),
    (SCORE, b'{"rows":' + b"[" * 5000 + b"]" * 5000 + b"}"),
    (SCORE, b'{"x":' + b"[" * 300 + b"1," + b"]" * 300 + b"}"),
    (SCORE, b'{"x":' + b"[" * 300 + b'"\xff' + b"]" * 300 + b"}"),
    (SCORE, b'{"x":' + b"[" * 300 + b'{"\\ud800":1e999}' + b"]" * 300 + b',"max_tokens":2}'),
    (SCORE, b'{"x":' + b"[" * 10000 + b"x"),
    (SCORE, b'{"x":' + b"[" * 10000 + b"]" * 9999),
]

GENERATED_BODIES = 400
GENERATED_SEED = 20261205


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, bytes]]:
    """The generated bodies (the fuzz's own generator, a fixed seed; /v1/tokenize's are not
    JSON) and the hand-written ones."""
    cases = generate_cases(
        GENERATED_BODIES, GENERATED_SEED, allow_oversize=False, long_lengths=(1_000, 20_000)
    )
    generated = [(c.endpoint, c.body) for c in cases if c.endpoint != "tokenize"]
    assert len(generated) > GENERATED_BODIES * 3 // 4
    hand = [(e, b) for e, b, _ in GO_RULES + SCORE_KEYS] + EDGE_BODIES
    return generated + hand


def _report(problems: list[tuple[str, bytes, str]]) -> str:
    return "\n".join(f"{e} {b[:160]!r}: {p}" for e, b, p in problems[:10])


def test_the_runner_decodes_as_the_oracle_does(corpus):
    problems = [(e, b, p) for e, b in corpus if (p := disagreement(e, b)) is not None]
    assert not problems, f"{len(problems)} bodies:\n{_report(problems)}"
    # both outcomes are exercised, on both endpoints
    verdicts = {(e, go_verdict(e, b).ok) for e, b in corpus}
    assert verdicts == {(e, ok) for e in (SCORE, COMPLETIONS) for ok in (True, False)}


def test_the_runner_reads_the_first_value_as_the_oracle_scans_it(corpus):
    problems = [(e, b, p) for e, b in corpus if (p := document_disagreement(b)) is not None]
    assert not problems, f"{len(problems)} bodies:\n{_report(problems)}"
