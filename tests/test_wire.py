"""Wire decoding as Go does it: keys case-insensitive (and, for /v1/score, underscore-free),
unknown keys ignored, null as the zero value; Go's %q for messages."""

import base64

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
    """wire._SCAN is the unrolled form of `"(?:[^"\\\\]|\\\\.)*"|[\\[\\]{}]` (one alternation per
    character held the GIL ~200 ms on a 1 MB string); on random bodies of quotes, backslashes,
    brackets and other bytes both find the same tokens."""
    import random
    import re

    from runner import wire

    plain = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
    rng = random.Random(0)
    alphabet = [b'"', b"\\", b"[", b"]", b"{", b"}", b"a", b"\n", b"\xff", b"u"]
    for _ in range(5000):
        body = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        found = [m.span() for m in wire._SCAN.finditer(body)]
        assert found == [m.span() for m in plain.finditer(body)], body
