"""Wire types of the runner protocol, spelled as the Go structs are (docs/PROTOCOL.md §3).

Request bodies decode as Go's `json.Decoder.Decode` decodes them into these structs
(`go_json`, which says how); encoding follows Go's `json.Encoder`: a non-finite float cannot
be written (`go_encodable`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

from runner.protocol.go_json import GoBytes, decode, fold_key, media_bytes

# Halfway between float32's largest value and the next power of two: what rounds below it is
# finite in float32 (Go's ParseFloat(s, 32)), what reaches it rounds to infinity.
FLOAT32_LIMIT = 3.4028235677973366e38
GoInt = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
# A Go float32 field: the literal rounded once to float32 (runner/protocol/go_json.py
# `go_float32`), then within float32's range.
GoFloat32 = Annotated[
    float, msgspec.Meta(gt=-FLOAT32_LIMIT, lt=FLOAT32_LIMIT, extra={"go": "float32"})
]


class MediaItem(msgspec.Struct):
    data: GoBytes = ""  # base64 on the wire, as Go's []byte; `media_bytes` decodes it
    id: GoInt = 0
    kind: str = ""

    def __post_init__(self) -> None:
        media_bytes(self.data)  # a body with bad base64 does not decode, as in Go

    @property
    def raw(self) -> bytes:
        """The item's bytes."""
        return media_bytes(self.data)


class ScoreRow(msgspec.Struct):
    prompt: str = ""
    candidates: list[str] = msgspec.field(default_factory=list)


class ScoreRequest(msgspec.Struct):
    rows: list[ScoreRow] = msgspec.field(default_factory=list)
    maxtokens: GoInt = 0
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


def _score_key(key: str) -> str:
    return fold_key(key.replace("_", ""))


def decode_score_request(body: bytes) -> ScoreRequest:
    return decode(body, ScoreRequest, _score_key)


_json_encoder = msgspec.json.Encoder()


def encode_json(value: Any) -> bytes:
    """JSON plus the trailing newline that Go's json.Encoder writes."""
    return _json_encoder.encode(value) + b"\n"


def go_encodable(value: Any) -> bool:
    """Whether Go's json.Encoder could write `value`: it refuses NaN and infinities (and
    then writes nothing at all), where msgspec would write `null`, which a Go client reads
    as 0 without an error."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(go_encodable(v) for v in value)
    if isinstance(value, msgspec.Struct):
        return all(go_encodable(getattr(value, f)) for f in value.__struct_fields__)
    return True


# --- /v1/completions ------------------------------------------------------------------------
# CompletionRequest and CompletionResponse have no JSON tags in Go, so their keys are the Go
# field names; api.Options keys are its snake_case tags. Go matches keys case-insensitively
# but, unlike /v1/score, does not drop underscores: `decode_completion_request` lowercases keys
# only, and these structs spell every field in lowercase.


class Options(msgspec.Struct):
    """api.Options with its embedded Runner options. Fields the runner does not use are
    declared anyway so that a value of the wrong type fails decoding as it does in Go."""

    num_ctx: GoInt = 0
    num_batch: GoInt = 0
    num_gpu: GoInt = 0
    main_gpu: GoInt = 0
    use_mmap: bool = False
    num_thread: GoInt = 0
    draft_num_predict: GoInt = 0
    num_keep: GoInt = 0
    seed: GoInt = 0
    num_predict: GoInt = 0
    top_k: GoInt = 0
    top_p: GoFloat32 = 0.0
    min_p: GoFloat32 = 0.0
    typical_p: GoFloat32 = 0.0
    repeat_last_n: GoInt = 0
    temperature: GoFloat32 = 0.0
    repeat_penalty: GoFloat32 = 0.0
    presence_penalty: GoFloat32 = 0.0
    frequency_penalty: GoFloat32 = 0.0
    stop: list[str] = msgspec.field(default_factory=list)


class CompletionRequest(msgspec.Struct):
    prompt: str = ""
    media: list[MediaItem] = msgspec.field(default_factory=list)
    options: Options = msgspec.field(default_factory=Options)
    logprobs: bool = False
    toplogprobs: GoInt = 0


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
    return decode(body, CompletionRequest, fold_key)
