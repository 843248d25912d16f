"""Wire decoding as Go does it: keys case-insensitive (and, for /v1/score, underscore-free),
unknown keys ignored, null as the zero value; Go's %q for messages."""

import base64
from typing import Any

import msgspec
import numpy as np
import pytest

from runner.protocol.errors import go_quote
from runner.protocol.go_json import DecodeError
from runner.protocol.wire import decode_score_request


def test_score_keys_match_any_case_and_underscores():
    for key in ("max_tokens", "MaxTokens", "maxtokens", "MAX_TOKENS", "Max_Tokens"):
        request = decode_score_request(
            f'{{"Rows":[{{"PROMPT":"a","Candidates":[" b"]}}],"{key}":7}}'.encode()
        )
        assert request.maxtokens == 7
        assert request.rows[0].prompt == "a"
        assert request.rows[0].candidates == [" b"]


def test_unknown_keys_ignored_and_null_is_zero_value():
    request = decode_score_request(
        b'{"rows":[{"prompt":null,"candidates":[" b"],"extra":1}],"max_tokens":null,"x":{}}'
    )
    assert request.rows[0].prompt == ""
    assert request.maxtokens == 0
    assert request.media == []


def test_media_items_decode_base64():
    data = base64.b64encode(b"\x89PNG").decode()
    request = decode_score_request(
        f'{{"rows":[],"media":[{{"data":"{data}","id":3,"Kind":"image"}}]}}'.encode()
    )
    assert request.media[0].raw == b"\x89PNG"
    assert request.media[0].id == 3
    assert request.media[0].kind == "image"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "EOF"),
        (b"   ", "EOF"),
        (b"{", "unexpected EOF"),
        # a value cut short by the end of the body, whatever its kind: Go's unexpected EOF
        (b'"abc', "unexpected EOF"),
        (b"tru", "unexpected EOF"),
        (b"-", "unexpected EOF"),
        (b"1.", "unexpected EOF"),
        (b'{"a":1.', "unexpected EOF"),
        (b'"abc"', "cannot unmarshal string into Go value of type ScoreRequest"),
        (b"[1,2]", "cannot unmarshal array"),
        (b"{not json", "malformed"),
        (b'{"max_tokens": 9223372036854775808}', "<= 9223372036854775807"),
        (b'{"max_tokens": -9223372036854775809}', ">= -9223372036854775808"),
        (b"[" * 10_001 + b"]" * 10_001, "invalid character '[' exceeded max depth"),
        (b'{"x":' + b"[" * 9_999 + b"{" + b"}" + b"]" * 9_999 + b"}", "character '{' exceeded"),
        # malformed deep down, where msgspec alone could not look
        (b'{"x":' + b"[" * 5_000 + b"1 2" + b"]" * 5_000 + b"}", "malformed"),
        (b'{"x":' + b"[" * 5_000 + b"}" + b"]" * 4_999 + b"}", "malformed"),
        (b'{"x":' + b"[" * 700 + b'{"a" 1}' + b"]" * 700 + b"}", "malformed"),
        (b'{"x":' + b"[" * 5_000 + b"1", "unexpected EOF"),
        # deep under a field: a type error, as Go's
        (b'{"rows":[{"candidates":' + b"[" * 3_000 + b"]" * 3_000 + b"}]}", "Expected `str`"),
        (b'{"rows":"x"}', "Expected `array`"),
        (b'{"rows":[{"prompt":3}]}', "Expected `str`"),
        (b'{"max_tokens":"9"}', "Expected `int`"),
        (b'{"max_tokens":1.5}', "Expected `int`"),
        (b'{"rows":[{"candidates":[1]}]}', "Expected `str`"),
    ],
)
def test_bad_bodies_raise_decoder_message(body, fragment):
    with pytest.raises(DecodeError) as e:
        decode_score_request(body)
    assert fragment in str(e.value)


@pytest.mark.parametrize("depth", [199, 200, 201, 202, 401, 1_000, 10_000])
def test_unknown_values_nest_as_deep_as_go_allows(depth: int) -> None:
    """Go's decoder takes 10,000 levels (the body's own included) and skips unknown keys;
    the request is the one without them, whichever container kinds nest where."""
    plain = b'{"rows":[{"prompt":"a","candidates":[" x"]}],"max_tokens":9}'
    deep = b"[" * (depth - 4) + b'{"k":[1,"]}",{}]}' + b"]" * (depth - 4)  # depth levels in all
    body = plain[:-1] + b',"Unknown":' + deep + b',"MAX_TOKENS":7}'
    assert decode_score_request(body) == decode_score_request(plain[:-1] + b',"max_tokens":7}')


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        (" Yes", '" Yes"'),
        ('say "hi"\n', '"say \\"hi\\"\\n"'),
        ("tab\there\\", '"tab\\there\\\\"'),
        ("\x00\x7f", '"\\x00\\x7f"'),
        ("é 日本", '"é 日本"'),
        ("\u200b", '"\\u200b"'),
        ("\U0001f600", '"\U0001f600"'),
        ("\U000e0001", '"\\U000e0001"'),
    ],
)
def test_go_quote_matches_strconv_quote(text, quoted):
    assert go_quote(text) == quoted


def test_what_follows_the_first_value_is_ignored_as_go_decoder_does():
    request = decode_score_request(b' {"max_tokens": 7} {"max_tokens": 9} trailing ] junk')
    assert request.maxtokens == 7


@pytest.mark.parametrize(
    ("raw", "prompt"),
    [
        (b'"a\xffb"', "a\ufffdb"),  # an invalid byte: one U+FFFD
        (b'"a\xe2\x82b"', "a\ufffd\ufffdb"),  # a cut sequence: one U+FFFD a byte, as Go
        (b'"\\ud800x"', "\ufffdx"),  # a lone high surrogate escape
        (b'"x\\udc00"', "x\ufffd"),  # a lone low surrogate escape
        (b'"\\ud83d\\ude00"', "\U0001f600"),  # a pair stays a pair
        (b'"\\\\ud800"', "\\ud800"),  # an escaped backslash, then plain text
    ],
)
def test_invalid_utf8_and_lone_surrogates_become_replacement_characters(raw, prompt):
    body = b'{"rows": [{"prompt": ' + raw + b', "candidates": ["x"]}]}'
    assert decode_score_request(body).rows[0].prompt == prompt


def test_go_int_and_float32_bounds_hold_in_completions():
    from runner.protocol.wire import decode_completion_request

    edge = b'{"options": {"num_predict": -9223372036854775808, "temperature": 3.4e38}}'
    request = decode_completion_request(edge)
    assert request.options.num_predict == -(1 << 63)
    for bad in (b'{"options": {"temperature": 3.5e38}}', b'{"TopLogprobs": 1e19}'):
        with pytest.raises(DecodeError):
            decode_completion_request(bad)


def test_null_body_is_the_zero_request_as_go_decodes_it():
    request = decode_score_request(b"null")
    assert request.rows == [] and request.maxtokens == 0


PER_CHARACTER = rb'"(?:[^"\\]|\\.)*"|[\[\]{}]'  # a string, or a bracket


def _brackets_by_finditer(body: bytes) -> list[int]:
    """The brackets outside strings as one alternation per character finds them (which held
    the GIL ~200 ms on a 1 MB string), up to a quote it passes over: a string that never
    closes, which all the rest is inside."""
    import re

    found, pos = [], 0
    for m in re.finditer(PER_CHARACTER, body, re.DOTALL):
        if b'"' in body[pos : m.start()]:
            break
        if body[m.start()] != 0x22:
            found.append(m.start())
        pos = m.end()
    return found


def test_the_document_scanner_finds_what_the_per_character_pattern_finds():
    """go_json._brackets finds the brackets outside strings that the per-character pattern
    finds, on random bodies of quotes, backslashes, brackets and other bytes, whatever the
    window its regex calls cover; where a string never closes, it stops (Go reads the rest
    as inside that string)."""
    import random

    from runner.protocol import go_json

    rng = random.Random(0)
    alphabet = [b'"', b"\\", b"[", b"]", b"{", b"}", b"a", b"\n", b"\xff", b"u"]
    for _ in range(5000):
        body = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        found = _brackets_by_finditer(body)
        for window in (1, 2, 3, 7, go_json.SCAN_WINDOW):
            assert list(go_json._brackets(body, 0, window)) == found, (body, window)


class _Spans:
    """A compiled pattern that records the span each call may cover."""

    def __init__(self, pattern: Any, spans: list[int]):
        self.pattern, self.spans = pattern, spans

    def match(self, body: bytes, pos: int, endpos: int) -> Any:
        self.spans.append(endpos - pos)
        return self.pattern.match(body, pos, endpos)


@pytest.mark.parametrize(
    ("member", "closed"),
    [
        (b'"' + "\U0001f600".encode() * 300_000 + b'"', True),  # a long string: 111 ms
        (b'"' + "\U0001f600".encode() * 300_000, False),  # never closed: backtracked 96 ms
        (b'"' + b'a\\"' * 200_000 + b'"', True),  # escaped quotes all along
        (b'"' + b'a\\"' * 200_000, False),  # never closed: no escaped quote opens one
        (b"[" + b"1.5, " * 300_000 + b"1]", True),  # numbers, no string or bracket inside
        (b"[" + b'"ab", ' * 200_000 + b"1]", True),  # many short strings
    ],
    ids=["string", "unclosed", "escapes", "escapes-unclosed", "numbers", "strings"],
)
def test_no_regex_call_of_the_scanner_covers_more_than_its_window(monkeypatch, member, closed):
    """The scanner holds the GIL one regex call at a time: a body of megabytes is covered in
    calls of at most SCAN_WINDOW bytes (here 64 KiB), in a number of calls that grows with
    the body, not with its strings; its brackets are the ones the per-character pattern
    finds."""
    from runner.protocol import go_json

    spans: list[int] = []
    monkeypatch.setattr(go_json, "_TO_BRACKET", _Spans(go_json._TO_BRACKET, spans))
    monkeypatch.setattr(go_json, "_STRING_PART", _Spans(go_json._STRING_PART, spans))
    body = b'{"x":' + member + b"}"
    window = 1 << 16
    found = list(go_json._brackets(body, 0, window))
    assert max(spans) <= window and len(spans) <= 4 * len(body) // window + 8
    n = len(body)
    if closed:  # the member's own brackets, and the body's
        assert found == [0, *([5, n - 2] if member.startswith(b"[") else []), n - 1]
    else:  # a string that never closes: the closing brace is inside it
        assert found == [0]


def _decoded_whole(body: bytes, kind: type, key: Any) -> Any:
    """What decoding gave before members were skipped: the whole document built, then
    normalised and converted (the reference for the walk over known members)."""
    import msgspec

    from runner.protocol import go_json

    document = go_json.document(body, kind.__name__)
    if document is None:
        return kind()
    if not isinstance(document, dict):
        raise DecodeError(f"json: cannot unmarshal array into Go value of type {kind.__name__}")
    info = go_json._place(kind).info
    filled = go_json._zero_fill(go_json._normalise_keys(document, key), info)
    try:
        return msgspec.convert(filled, kind, strict=True)
    except (msgspec.ValidationError, ValueError) as e:
        raise DecodeError(str(e)) from None


ROW = b'{"prompt":"Is it?","candidates":[" Yes"," No"]}'
SKIPPED_MEMBER_BODIES = [
    b'{"rows":[' + ROW + b'],"max_tokens":8,"junk":[1,2,{"a":[null,1e400,"x"]}]}',
    b'{"junk":{"deep":[[[[]]]]},"rows":[' + ROW + b'],"MAX_TOKENS":3}',
    b'{"rows":[{"prompt":"a","candidates":[" b"],"extra":[1,{"z":null}]}],"max_tokens":1}',
    b'{"rows":[null,' + ROW + b'],"maxTokens":2,"media":[{"id":1,"data":"","other":[1]}]}',
    b'{"rows":[' + ROW + b'],"max_tokens":null,"Max_Tokens":5,"maxtokens":null}',
    b'{"rows":' + ROW + b',"max_tokens":1}',  # an object where a list goes
    b'{"rows":[[1]],"max_tokens":1}',  # a list where a row goes
    b'{"rows":[{"prompt":5}],"max_tokens":1}',
    b'{"rows":[' + ROW + b'],"max_tokens":1,"junk":[1,}',  # a syntax error in a skipped value
    b'{"rows":[' + ROW + b'],"max_tokens":1,"junk":"\\q"}',
    b'{"rows":[' + ROW + b'],"max_tokens":99999999999999999999,"junk":1}',
    b'[{"rows":[]}]',
    b'{"rows":[' + ROW + b'],"max_tokens":1.5}',
    b'{"media":[{"data":"!!","kind":"image"}],"junk":[]}',
]
COMPLETION_BODIES = [
    b'{"prompt":"hi","options":{"num_predict":3,"unknown":[1,2,3],"TOP_K":2},"x":{"y":[]}}',
    b'{"Prompt":"hi","Options":{"top_p":1e39},"junk":[null]}',
    b'{"prompt":"hi","options":[1],"logprobs":true}',
    b'{"prompt":"hi","options":null,"toplogprobs":2,"junk":{"a":tru}}',
    b'{"prompt":"hi","options":{"num_ctx":null,"seed":-1},"media":null}',
]


@pytest.mark.parametrize(
    "body, decode, kind, key",
    [
        *((b, "score", "ScoreRequest", "_score_key") for b in SKIPPED_MEMBER_BODIES),
        *((b, "completion", "CompletionRequest", "fold_key") for b in COMPLETION_BODIES),
    ],
)
def test_skipping_unknown_members_decodes_what_the_whole_document_decodes(body, decode, kind, key):
    """Members no field takes are only syntax-checked, never built: every body decodes to
    the same request, or fails with the same message, as the whole document did."""
    from runner.protocol import wire

    decoder = {"score": decode_score_request, "completion": wire.decode_completion_request}[decode]
    want: Any
    try:
        want = _decoded_whole(body, getattr(wire, kind), getattr(wire, key))
    except DecodeError as e:
        with pytest.raises(DecodeError) as got:
            decoder(body)
        assert str(got.value) == str(e)
        return
    assert decoder(body) == want


def test_a_huge_unknown_member_is_never_built():
    """A body with a 200,000-element array under an unknown key: decoding it allocates
    a few MB (its rows), not the tens of MB of Python objects that building it took (the
    event loop could not answer /v1/status for 7-8 s while a 45 MB one was built)."""
    import tracemalloc

    junk = b",".join([b'{"a":1.5}'] * 200_000)
    body = b'{"rows":[' + ROW + b'],"max_tokens":8,"junk":[' + junk + b"]}"
    tracemalloc.start()
    try:
        request = decode_score_request(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert request.maxtokens == 8 and request.rows[0].candidates == [" Yes", " No"]
    assert peak < 4 * len(body), peak  # the document's text, decoded once, and little else


# --- duplicate keys, as Go's json.Decoder decodes them ---------------------------------------


@pytest.mark.parametrize(
    ("body", "rows"),
    [
        # a later array decodes into the earlier one's elements: members merge
        (b'{"rows":[{"prompt":"a","candidates":[" x"]}],"rows":[{"prompt":"b"}]}', [("b", [" x"])]),
        # the same key spelled twice, one of them escaped
        (b'{"rows":[{"prompt":"a"}],"\\u0072ows":[{"candidates":[" y"]}]}', [("a", [" y"])]),
        # a null member empties a slice; a null element keeps the element it lands on
        (b'{"rows":[{"prompt":"a"}],"ROWS":null}', []),
        (
            b'{"rows":[{"prompt":"a"},{"prompt":"b"}],"rows":[null,{"candidates":[" z"]}]}',
            [("a", []), ("b", [" z"])],
        ),
        # elements past a shorter array's length are still there for a longer one
        (
            b'{"rows":[{"prompt":"a"},{"prompt":"b"}],"rows":[{"prompt":"c"}],"rows":[{},{}]}',
            [("c", []), ("b", [])],
        ),
        # an empty array is a new slice: nothing earlier survives it
        (
            b'{"rows":[{"prompt":"a"},{"prompt":"b"}],"rows":[],"rows":[{},{}]}',
            [("", []), ("", [])],
        ),
        # a member of an object in two spellings: the last one's value, the first one's place
        (b'{"rows":[{"prompt":"a","PROMPT":"b","Prompt":null}]}', [("b", [])]),
    ],
)
def test_a_key_given_twice_decodes_into_the_same_value_as_in_go(body, rows):
    request = decode_score_request(body)
    assert [(r.prompt, r.candidates) for r in request.rows] == rows


@pytest.mark.parametrize(
    "body",
    [
        # a type error in an occurrence that a later one overwrites still fails, as in Go
        b'{"rows":[{"prompt":"a","candidates":true,"candidates":[" x"]}]}',
        b'{"max_tokens":"5","max_tokens":5}',
        b'{"rows":[{"prompt":5}],"rows":[]}',
        b'{"media":[{"data":"aGk"}],"media":[{"data":"aGk="}]}',
        b'{"media":[{"data":[256]}]}',
    ],
)
def test_an_occurrence_go_cannot_decode_fails_the_body_whatever_follows(body):
    with pytest.raises(DecodeError):
        decode_score_request(body)


def test_media_data_is_a_go_byte_slice():
    """Go's []byte: base64, or an array of numbers 0-255; null is none."""
    (item,) = decode_score_request(b'{"media":[{"data":[104,105],"id":1}]}').media
    assert item.raw == b"hi" and item.id == 1
    (item,) = decode_score_request(b'{"media":[{"data":"aGk=","DATA":null}]}').media
    assert item.raw == b""


def _duplicate_heavy_body(rng: Any, endpoint: str) -> bytes:
    """A body of keys given in several spellings and twice, with values of right and wrong
    types, nulls and empty arrays, at every level of the request."""

    def pick(*options: str) -> str:
        return rng.choice(options)

    def obj(members: list[tuple[str, str]]) -> str:
        space = pick("", " ", "\n ")
        return "{" + ("," + space).join(f'"{k}":{space}{v}' for k, v in members) + "}"

    def text() -> str:
        return pick('"Is it"', '"x"', "null", "5", "true", '""', '"a\\u0041"', "[]")

    def texts() -> str:
        items = [pick('" the"', '" a"', "null", text()) for _ in range(rng.randint(0, 3))]
        return pick("[" + ",".join(items) + "]", "null", '"x"', "{}", "[]")

    def number() -> str:
        return pick("5", "8", "0", "null", '"5"', "1.5", "9223372036854775808", "-1", "true")

    def media() -> str:
        keys = ("data", "DATA", "id", "ID", "kind")
        values = ('"aGk="', '"aGk"', "null", "5", '"image"', "[104,105]", "[]", "[300]")
        items = [
            obj([(pick(*keys), pick(*values)) for _ in range(rng.randint(0, 4))]),
            "null",
        ]
        return pick("[" + ",".join(rng.choice(items) for _ in range(3)) + "]", "null", "{}")

    if endpoint == "score":
        row_keys = ("prompt", "PROMPT", "candidates", "CANDIDATES", "cand_idates", "x")

        def row() -> str:
            keys = [pick(*row_keys) for _ in range(rng.randint(0, 5))]
            return obj([(k, text() if "rom" in k.lower() else texts()) for k in keys])

        def rows() -> str:
            items = [pick(row(), row(), "null", "5") for _ in range(rng.randint(0, 4))]
            return pick("[" + ",".join(items) + "]", "null", "{}", "[]")

        top = ("rows", "ROWS", "\\u0072ows", "max_tokens", "MaxTokens", "media", "Media", "x")
        keys = [pick(*top) for _ in range(rng.randint(0, 6))]
        values = {"r": rows, "m": media, "x": lambda: pick("1", '[1,{"rows":2}]', "null")}
        return obj([(k, values.get(k.lower()[-4:-3], number)()) for k in keys]).encode()
    option_keys = ("top_k", "TOP_K", "seed", "stop", "STOP", "temperature", "num_predict", "zz")

    def options() -> str:
        keys = [pick(*option_keys) for _ in range(rng.randint(0, 5))]
        floats = ("0.5", "1", "null", '"x"', "1e39")
        members = [
            (
                k,
                texts()
                if "stop" in k.lower()
                else pick(*floats)
                if k[0] == "t" and k[1] == "e"
                else number(),
            )
            for k in keys
        ]
        return pick(obj(members), "null", "[0]", "5")

    top = ("prompt", "PROMPT", "options", "OPTIONS", "logprobs", "toplogprobs", "media", "x")
    values = {
        "prompt": text,
        "options": options,
        "media": media,
        "x": lambda: "1",
        "logprobs": lambda: pick("true", "false", "null", "1"),
        "toplogprobs": number,
    }
    keys = [pick(*top) for _ in range(rng.randint(0, 6))]
    return obj([(k, values[k.lower()]()) for k in keys]).encode()


def test_duplicate_heavy_bodies_decode_as_the_go_model_decodes_them():
    """bench/fuzz/go_oracle.py's model of Go's json.Decoder (an independent decoder, node by
    node) says whether Go accepts each body and what it decodes to, written plainly: the
    runner refuses what Go refuses and decodes the rest to what it decodes the plain form
    to."""
    import random

    from bench.fuzz.go_oracle import go_verdict
    from runner.protocol.wire import decode_completion_request

    rng = random.Random(7)
    accepted = 0
    for _ in range(1500):
        endpoint = rng.choice(["score", "completions"])
        body = _duplicate_heavy_body(rng, endpoint)
        decode = decode_score_request if endpoint == "score" else decode_completion_request
        verdict = go_verdict(endpoint, body)
        try:
            ours = msgspec.to_builtins(decode(body))
        except DecodeError as e:
            assert not verdict.ok, (body, str(e))
            continue
        assert verdict.ok, (body, verdict.error)
        assert ours == msgspec.to_builtins(decode(verdict.canonical)), (body, verdict.canonical)
        accepted += 1
    assert 300 < accepted < 1200  # both outcomes are exercised


@pytest.mark.parametrize(
    ("literal", "value"),
    [
        # Go's ParseFloat(s, 32) rounds the exact literal once; float64 first would differ:
        (b"1e-46", 0.0),  # under half the smallest subnormal: 0 (greedy), not 1e-46
        (b"1.00000001", 1.0),  # min_p exactly 1, not above it
        (b"1.0000000596046447753906250001", 1 + 2**-23),  # float64 lands on the midpoint
        (b"3.4028235677973366e38", float(np.finfo(np.float32).max)),  # not past the limit
        (b"340282356779733661637539395458142568447", float(np.finfo(np.float32).max)),
        (b"0.1", float(np.float32(0.1))),
        (b"-0.0", -0.0),
    ],
)
def test_float32_options_are_the_literal_rounded_once_as_go_does(literal, value):
    from runner.protocol.wire import decode_completion_request

    for key in (b"temperature", b"min_p"):
        request = decode_completion_request(b'{"Options":{"' + key + b'":' + literal + b"}}")
        got = getattr(request.options, key.decode())
        assert got == value and np.copysign(1, got) == np.copysign(1, value)


def test_a_byte_slice_given_thrice_keeps_its_backing_array():
    """Go decodes each occurrence into the same slice: a shorter array leaves the bytes past
    its length in the backing array, which a later null element keeps."""
    media = b'"media":[{"data":[1,2,3],"data":[4],"data":[5,null,null]}]'
    body = b'{"rows":[{"prompt":"a","candidates":[" x"]}],' + media + b"}"
    assert decode_score_request(body).media[0].data == "BQID"  # [5, 2, 3]
