"""Wire decoding as Go does it: keys case-insensitive (and, for /v1/score, underscore-free),
unknown keys ignored, null as the zero value; Go's %q for messages."""

import base64
from typing import Any

import pytest

from runner.errors import go_quote
from runner.wire import DecodeError, decode_score_request


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
        (b"[1,2]", "cannot unmarshal array"),
        (b"{not json", "malformed"),
        (b'{"max_tokens": 9223372036854775808}', "<= 9223372036854775807"),
        (b'{"max_tokens": -9223372036854775809}', ">= -9223372036854775808"),
        (b"{" * 501 + b"}" * 501, "exceeded max depth (500)"),
        (b'{"x":' + b"[" * 600 + b"]" * 600 + b"}", "exceeded max depth"),
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
    from runner.wire import decode_completion_request

    edge = b'{"options": {"num_predict": -9223372036854775808, "temperature": 3.4e38}}'
    request = decode_completion_request(edge)
    assert request.options.num_predict == -(1 << 63)
    for bad in (b'{"options": {"temperature": 3.5e38}}', b'{"TopLogprobs": 1e19}'):
        with pytest.raises(DecodeError):
            decode_completion_request(bad)


def test_null_body_is_the_zero_request_as_go_decodes_it():
    request = decode_score_request(b"null")
    assert request.rows == [] and request.maxtokens == 0


def test_the_document_scanner_finds_what_the_per_character_pattern_finds():
    """wire._tokens finds the tokens of `"(?:[^"\\\\]|\\\\.)*"|[\\[\\]{}]` (one alternation per
    character, which held the GIL ~200 ms on a 1 MB string) on random bodies of quotes,
    backslashes, brackets and other bytes, whatever the window its regex calls cover."""
    import random
    import re

    from runner import wire

    plain = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
    rng = random.Random(0)
    alphabet = [b'"', b"\\", b"[", b"]", b"{", b"}", b"a", b"\n", b"\xff", b"u"]
    for _ in range(5000):
        body = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        found = [m.span() for m in plain.finditer(body)]
        for window in (1, 2, 3, 7, wire.SCAN_WINDOW):
            assert list(wire._tokens(body, 0, window)) == found, (body, window)


class _Spans:
    """A compiled pattern that records the span each call may cover."""

    def __init__(self, pattern: Any, spans: list[int]):
        self.pattern, self.spans = pattern, spans

    def search(self, body: bytes, pos: int, endpos: int) -> Any:
        self.spans.append(endpos - pos)
        return self.pattern.search(body, pos, endpos)

    def match(self, body: bytes, pos: int, endpos: int) -> Any:
        self.spans.append(endpos - pos)
        return self.pattern.match(body, pos, endpos)


@pytest.mark.parametrize(
    "member",
    [
        b'"' + "\U0001f600".encode() * 300_000 + b'"',  # one long string (held the GIL 111 ms)
        b'"' + "\U0001f600".encode() * 300_000,  # one that never closes (backtracked 96 ms)
        b'"' + b'a\\"' * 200_000 + b'"',  # escaped quotes all along
        b"[" + b"1.5, " * 300_000 + b"1]",  # numbers, no string or bracket inside
    ],
    ids=["string", "unclosed", "escapes", "numbers"],
)
def test_no_regex_call_of_the_scanner_covers_more_than_its_window(monkeypatch, member):
    """The scanner holds the GIL one regex call at a time: a body of megabytes is covered in
    calls of at most SCAN_WINDOW bytes (here 64 KiB), and its tokens are still the ones the
    per-character pattern finds."""
    import re

    from runner import wire

    spans: list[int] = []
    monkeypatch.setattr(wire, "_TOKEN_START", _Spans(wire._TOKEN_START, spans))
    monkeypatch.setattr(wire, "_STRING_PART", _Spans(wire._STRING_PART, spans))
    body = b'{"x":' + member + b"}"
    window = 1 << 16
    found = list(wire._tokens(body, 0, window))
    assert max(spans) <= window and sum(spans) >= len(body) - 2 * window
    plain = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
    assert found == [m.span() for m in plain.finditer(body)]


def _decoded_whole(body: bytes, kind: type, key: Any) -> Any:
    """What decoding gave before members were skipped: the whole document built, then
    normalised and converted (the reference for `_known`)."""
    import msgspec

    from runner import wire

    document = wire.go_document(body, kind.__name__)
    if document is None:
        return kind()
    if not isinstance(document, dict):
        raise DecodeError(f"json: cannot unmarshal array into Go value of type {kind.__name__}")
    info = wire._type_info(kind)
    filled = wire._zero_fill(wire._normalise_keys(document, key), info)
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
    from runner import wire

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
