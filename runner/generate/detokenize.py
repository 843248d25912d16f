"""Streaming detokenization with the Go runner's UTF-8 rules (docs/PROTOCOL.md §5.3).

Each token's raw bytes join a buffer; the longest valid UTF-8 prefix is flushed. A trailing
*incomplete* sequence waits for the next token, while an *invalid* byte is flushed as part of
the prefix so the stream always progresses (it reaches the client as U+FFFD, one per byte, as
Go's JSON encoder writes it). A token that flushes nothing keeps its logprob queued until the
next chunk with text; whatever is still buffered when generation ends is dropped.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def _one_per_byte(error: UnicodeError) -> tuple[str, int]:
    assert isinstance(error, UnicodeDecodeError)
    return "\ufffd", error.start + 1


codecs.register_error("runner.go-replace", _one_per_byte)


def go_string(data: bytes) -> str:
    """`data` as Go's encoding/json writes a string: each invalid byte becomes U+FFFD."""
    return data.decode("utf-8", "runner.go-replace")


def _sequence_length(lead: int) -> int:
    """Bytes of the sequence a lead byte starts; 0 when it cannot start one."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _second_byte_range(lead: int) -> tuple[int, int]:
    """Go's accept ranges: no overlongs, surrogates or code points above U+10FFFF."""
    return {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(
        lead, (0x80, 0xBF)
    )


def _is_incomplete(tail: bytes | bytearray) -> bool:
    """Go's !utf8.FullRune: `tail` is a valid but unfinished start of a multi-byte rune."""
    n = _sequence_length(tail[0])
    if n < 2 or len(tail) >= n:
        return False
    if len(tail) > 1:
        lo, hi = _second_byte_range(tail[0])
        if not lo <= tail[1] <= hi:
            return False
    return all(0x80 <= b <= 0xBF for b in tail[2:])


def valid_prefix_length(data: bytes | bytearray) -> int:
    """Go's validUTF8PrefixLen: the bytes to flush, stopping only at an incomplete rune."""
    i = 0
    while i < len(data):
        n = _sequence_length(data[i])
        if n == 1:
            i += 1
            continue
        if n and i + n <= len(data):
            try:
                bytes(data[i : i + n]).decode("utf-8")
                i += n
                continue
            except UnicodeDecodeError:
                pass
        if _is_incomplete(data[i:]):
            break
        i += 1  # an invalid byte: consumed, so the stream always moves on
    return i


class Detokenizer(Generic[T]):
    """Turns token ids into text chunks; each chunk carries the items (logprobs) of the
    tokens that produced it."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self.token_bytes = token_bytes
        self.buffer = bytearray()
        self.pending: list[T] = []

    def add(self, token: int, item: T | None = None) -> tuple[str, list[T]] | None:
        """Feed one token; the flushed text and its queued items, or None when nothing shows."""
        self.buffer += self.token_bytes(token)
        if item is not None:
            self.pending.append(item)
        n = valid_prefix_length(self.buffer)
        if n == 0:
            return None
        text = go_string(bytes(self.buffer[:n]))
        del self.buffer[:n]
        items, self.pending = self.pending, []
        return text, items
