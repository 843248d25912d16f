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
    assert request.media[0].data == b"\x89PNG"
    assert request.media[0].id == 3
    assert request.media[0].kind == "image"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "EOF"),
        (b"   ", "EOF"),
        (b"{", "truncated"),
        (b"[1,2]", "expected a JSON object"),
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


def test_null_body_is_the_zero_request_as_go_decodes_it():
    request = decode_score_request(b"null")
    assert request.rows == [] and request.maxtokens == 0
