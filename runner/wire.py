"""Wire types of the runner protocol, spelled as the Go structs are (docs/PROTOCOL.md §3).

Go decodes JSON keys case-insensitively, ignores unknown keys and turns `null` into the zero
value. `/v1/score` goes further: its keys also match with underscores left out (`max_tokens`,
`MaxTokens`, `maxtokens` are one key). `decode_score_request` gives that behaviour by
normalising every object key before msgspec converts the document into typed structs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


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


def _normalise_keys(value: Any, key: Callable[[str], str]) -> Any:
    """Keys through `key`, recursively; nulls dropped (Go leaves the zero value for null)."""
    if isinstance(value, dict):
        return {key(k): _normalise_keys(v, key) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normalise_keys(v, key) for v in value]
    return value


def _decode(body: bytes, kind: type[T], key: Callable[[str], str]) -> T:
    """Go's json.Decoder into a zero-valued struct: keys matched through `key`."""
    if not body.strip():
        raise DecodeError("EOF")
    try:
        document = msgspec.json.decode(body)
        if document is None:  # Go decodes `null` into a struct as a no-op
            return kind()
        if not isinstance(document, dict):
            raise DecodeError(f"expected a JSON object, got {type(document).__name__}")
        return msgspec.convert(_normalise_keys(document, key), kind, strict=True)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(str(e)) from None


def _score_key(key: str) -> str:
    return key.replace("_", "").lower()


def decode_score_request(body: bytes) -> ScoreRequest:
    return _decode(body, ScoreRequest, _score_key)


_json_encoder = msgspec.json.Encoder()


def encode_json(value: Any) -> bytes:
    """JSON plus the trailing newline that Go's json.Encoder writes."""
    return _json_encoder.encode(value) + b"\n"


# --- /v1/completions ------------------------------------------------------------------------
# CompletionRequest and CompletionResponse have no JSON tags in Go, so their keys are the Go
# field names; api.Options keys are its snake_case tags. Go matches keys case-insensitively
# but, unlike /v1/score, does not drop underscores: `decode_completion_request` lowercases keys
# only, and these structs spell every field in lowercase.


class Options(msgspec.Struct):
    """api.Options with its embedded Runner options. Fields the runner does not use are
    declared anyway so that a value of the wrong type fails decoding as it does in Go."""

    num_ctx: int = 0
    num_batch: int = 0
    num_gpu: int = 0
    main_gpu: int = 0
    use_mmap: bool = False
    num_thread: int = 0
    draft_num_predict: int = 0
    num_keep: int = 0
    seed: int = 0
    num_predict: int = 0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    typical_p: float = 0.0
    repeat_last_n: int = 0
    temperature: float = 0.0
    repeat_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = msgspec.field(default_factory=list)


class CompletionRequest(msgspec.Struct):
    prompt: str = ""
    media: list[MediaItem] = msgspec.field(default_factory=list)
    options: Options = msgspec.field(default_factory=Options)
    logprobs: bool = False
    toplogprobs: int = 0


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
    return _decode(body, CompletionRequest, str.lower)
