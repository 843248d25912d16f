"""Request errors and their HTTP statuses, with Go's text conventions.

A `RequestError` raised anywhere while serving a request becomes `http.Error(w, msg, code)`:
a text/plain body of the message plus a newline. Anything else is a 500 with its text.
"""

from __future__ import annotations

import unicodedata


class RequestError(Exception):
    status = 500

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(RequestError):
    status = 400


class Cancelled(Exception):
    """The client went away or the runner is stopping; nothing is sent back."""


_GO_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}


def go_quote(text: str) -> str:
    """The string as Go's %q writes it (strconv.Quote): printable runes kept, others escaped."""
    out = ['"']
    for ch in text:
        if ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif _go_printable(ch):
            out.append(ch)
        elif 0xD800 <= ord(ch) <= 0xDFFF:  # a lone surrogate is invalid UTF-8 to Go
            out.append("\\ufffd")
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def _go_printable(ch: str) -> bool:
    """Go's unicode.IsPrint: letters, marks, numbers, punctuation, symbols and ASCII space."""
    if ch == " ":
        return True
    return unicodedata.category(ch)[0] in "LMNPS"
