"""Streaming detokenization: Go's UTF-8 buffer rules (utf8_buffer_test.go) and logprob riding."""

from __future__ import annotations

import pytest

from runner.generate.detokenize import Detokenizer, go_string, valid_prefix_length
from runner.text.tokenizer import Tokenizer
from tests.tiny import TOKENIZER_CONFIG, tokenizer_json


def feed(pieces: list[bytes], items: list | None = None) -> list:
    """Each piece is one token's bytes; the detokenizer's answer after each."""
    detokenizer = Detokenizer(lambda t: pieces[t])
    items = items or [None] * len(pieces)
    return [detokenizer.add(i, item) for i, item in enumerate(items)]


def test_incomplete_rune_is_held_back_across_flushes():
    """Go's test: E3 81 -> "", + 93 E3 -> "こ" keeping E3, + 82 93 -> "ん"."""
    out = feed([b"\xe3\x81", b"\x93\xe3", b"\x82\x93"])
    assert out == [None, ("こ", []), ("ん", [])]


def test_valid_text_flushes_whole():
    assert feed([b"Hello", b" w\xc3\xa9rld"]) == [("Hello", []), (" wérld", [])]


@pytest.mark.parametrize(
    ("data", "n"),
    [
        (b"", 0),
        (b"abc", 3),
        (b"a\xe3\x81", 1),  # incomplete 3-byte rune waits
        (b"a\xf0\x9f\x98", 1),  # incomplete 4-byte rune waits
        (b"\xff", 1),  # never valid: consumed
        (b"\xe3\x41", 2),  # bad continuation: the lead is invalid, then "A"
        (b"\xed\xa0", 2),  # a surrogate can never complete: both bytes go
        (b"\xed\x9f", 0),  # ... but U+D7C0.. can: it waits
        (b"\xc0\xaf", 2),  # overlong: both bytes invalid
        (b"\x80abc", 4),
    ],
)
def test_valid_prefix_length_as_go(data, n):
    assert valid_prefix_length(data) == n


def test_invalid_bytes_become_one_replacement_each_and_the_stream_moves_on():
    assert feed([b"\xff", b"a\xe3A"]) == [("\ufffd", []), ("a\ufffdA", [])]
    assert go_string(b"\xe3\x81A") == "\ufffd\ufffdA"  # Go's JSON: per invalid byte
    assert go_string(b"\xf0\x9f\x98\x80") == "😀"


def test_items_of_tokens_without_text_ride_with_the_next_chunk():
    out = feed([b"\xf0\x9f", b"\x98", b"\x80!", b"?"], items=["a", "b", "c", "d"])
    assert out == [None, None, ("😀!", ["a", "b", "c"]), ("?", ["d"])]


def test_bytes_left_at_the_end_are_kept_back():
    detokenizer: Detokenizer[str] = Detokenizer(lambda t: b"\xe3\x81")
    assert detokenizer.add(0, "x") is None
    assert bytes(detokenizer.buffer) == b"\xe3\x81" and detokenizer.pending == ["x"]


def test_a_real_byte_level_tokenizer_splits_a_character_and_it_arrives_whole():
    tokenizer = Tokenizer(tokenizer_json(), tokenizer_config=TOKENIZER_CONFIG)
    ids = tokenizer.encode("é€")
    assert len(ids) >= 2
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert not any(_decodes(p) for p in pieces)  # every token holds a piece of a character
    detokenizer = Detokenizer(tokenizer.token_bytes)
    chunks = [c[0] for t in ids if (c := detokenizer.add(t)) is not None]
    assert "".join(chunks) == "é€"
    assert all(chunk in ("é", "€", "é€") for chunk in chunks)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
