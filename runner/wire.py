"""Wire types of the runner protocol, spelled as the Go structs are (CONTRACT.md §2-3).

Go decodes JSON keys case-insensitively, ignores unknown keys and turns `null` into the zero
value. `/v1/score` goes further: its keys also match with underscores left out (`max_tokens`,
`MaxTokens`, `maxtokens` are one key). `decode_score_request` gives that behaviour by
normalising every object key before msgspec converts the document into typed structs.
"""

from __future__ import annotations

from typing import Any

import msgspec


class MediaItem(msgspec.Struct):
    data: bytes = b""  # base64 on the wire, as Go's []byte
    id: int = 0
    kind: str = ""


class ScoreRow(msgspec.Struct):
    prompt: str = ""
    candidates: list[str] = msgspec.field(default_factory=list)


class ScoreRequest(msgspec.Struct):
    rows: list[ScoreRow] = msgspec.field(default_factory=list)
    maxtokens: int = 0
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


def _normalise_keys(value: Any) -> Any:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if item is None:  # Go leaves the zero value in place for null
                continue
            out[key.replace("_", "").lower()] = _normalise_keys(item)
        return out
    if isinstance(value, list):
        return [_normalise_keys(v) for v in value]
    return value


def decode_score_request(body: bytes) -> ScoreRequest:
    if not body.strip():
        raise DecodeError("EOF")
    try:
        document = msgspec.json.decode(body)
        if not isinstance(document, dict):
            raise DecodeError(f"expected a JSON object, got {type(document).__name__}")
        return msgspec.convert(_normalise_keys(document), ScoreRequest, strict=True)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(str(e)) from None


_json_encoder = msgspec.json.Encoder()


def encode_json(value: Any) -> bytes:
    """JSON plus the trailing newline that Go's json.Encoder writes."""
    return _json_encoder.encode(value) + b"\n"
