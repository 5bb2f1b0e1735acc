"""Client-facing messages: the requests a client sends and the replies it receives.

Each message is a dataclass with `to_wire()` (a msgpack-ready dict, envelope
included) and `from_wire(dict)` (full validation: unknown fields, wrong types, sizes
and ranges raise `ProtocolError` naming the field). SPEC.md documents the same
fields for implementers in other languages.

The control messages between the two workers live in `protocol.control` and are
re-exported here so that every message type has one import point.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from hybridd.protocol.control import (  # noqa: F401  re-exported, see module docstring
    CONTROL_TYPES,
    ControlMessage,
    Launched,
    Ready,
    ReadyAck,
    Shutdown,
    Stats,
    StatsRequest,
    Step,
    control_from_wire,
)
from hybridd.protocol.envelope import check_request_id, check_version, envelope, message_type, open_envelope, peek_request_id
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.fields import FieldReader
from hybridd.protocol.limits import (
    MAX_ABS_PENALTY,
    MAX_ERROR_MESSAGE_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TIMEOUT_S,
    MAX_TOKEN_ID,
    MAX_TOKENS_CAP,
)

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "cancelled", "timeout", "error"})


def _envelope(type_: str, request_id: str) -> dict[str, Any]:
    return envelope(type_) | {"id": request_id}


def _open(data: Mapping[str, Any], *, reply: bool = False) -> tuple[FieldReader, str]:
    """Check the envelope of a client message; returns the reader and the id.

    Replies may carry the empty id: an error for a message whose id was unreadable.
    """
    reader = open_envelope(data)
    request_id = check_request_id(reader.string("id"), allow_empty=reply)
    return reader, request_id


# ---------------------------------------------------------------- requests


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop. Every field is optional on the wire."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }

    @classmethod
    def read(cls, r: FieldReader) -> SamplingParams:
        top_k = r.integer("top_k", 0, lo=-1, hi=MAX_TOKEN_ID)
        params = cls(
            max_tokens=r.integer("max_tokens", 16, lo=1, hi=MAX_TOKENS_CAP),
            temperature=r.number("temperature", 1.0, lo=0.0),
            top_k=top_k,
            top_p=r.number("top_p", 1.0, lo=0.0, lo_open=True, hi=1.0),
            seed=r.integer("seed", None, lo=0, hi=MAX_SEED),
            repetition_penalty=r.number("repetition_penalty", 1.0, lo=0.0, lo_open=True),
            presence_penalty=r.number("presence_penalty", 0.0, lo=-MAX_ABS_PENALTY, hi=MAX_ABS_PENALTY),
            frequency_penalty=r.number("frequency_penalty", 0.0, lo=-MAX_ABS_PENALTY, hi=MAX_ABS_PENALTY),
            stop=r.string_list("stop", [], max_items=MAX_STOP_STRINGS, min_chars=1, max_chars=MAX_STOP_STRING_CHARS),
            stop_token_ids=r.integer_list("stop_token_ids", [], max_items=MAX_STOP_TOKEN_IDS, lo=0, hi=MAX_TOKEN_ID),
            ignore_eos=r.boolean("ignore_eos", False),
        )
        r.finish()
        return params


@dataclass(slots=True, kw_only=True)
class GenerateRequest:
    TYPE: ClassVar[str] = "generate"

    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    timeout_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id) | {
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": self.sampling.to_wire(),
            "stream": self.stream,
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> GenerateRequest:
        r, request_id = _open(data)
        prompt = r.string("prompt", None, min_chars=1, max_chars=MAX_PROMPT_CHARS)
        token_ids = r.integer_list(
            "prompt_token_ids", None, max_items=MAX_PROMPT_TOKEN_IDS, min_items=1, lo=0, hi=MAX_TOKEN_ID
        )
        if (prompt is None) == (token_ids is None):
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                "prompt: exactly one of prompt and prompt_token_ids must be given",
                field="prompt",
            )
        sampling_reader = r.nested_optional("sampling")
        sampling = SamplingParams() if sampling_reader is None else SamplingParams.read(sampling_reader)
        request = cls(
            id=request_id,
            prompt=prompt,
            prompt_token_ids=token_ids,
            sampling=sampling,
            stream=r.boolean("stream", True),
            timeout_s=r.number("timeout_s", None, lo=0.0, lo_open=True, hi=MAX_TIMEOUT_S),
        )
        r.finish()
        return request


@dataclass(slots=True, kw_only=True)
class CancelRequest:
    TYPE: ClassVar[str] = "cancel"

    id: str
    target: str

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id) | {"target": self.target}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CancelRequest:
        r, request_id = _open(data)
        target = r.string("target")
        check_request_id(target, "target")
        r.finish()
        return cls(id=request_id, target=target)


@dataclass(slots=True, kw_only=True)
class StatusRequest:
    TYPE: ClassVar[str] = "status"

    id: str

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StatusRequest:
        r, request_id = _open(data)
        r.finish()
        return cls(id=request_id)


@dataclass(slots=True, kw_only=True)
class HealthRequest:
    TYPE: ClassVar[str] = "health"

    id: str

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> HealthRequest:
        r, request_id = _open(data)
        r.finish()
        return cls(id=request_id)


Request = GenerateRequest | CancelRequest | StatusRequest | HealthRequest
REQUEST_TYPES: dict[str, type[Request]] = {
    cls.TYPE: cls for cls in (GenerateRequest, CancelRequest, StatusRequest, HealthRequest)
}


# ---------------------------------------------------------------- replies


@dataclass(slots=True, kw_only=True)
class ChunkReply:
    """Incremental output of a streaming generate: new text and the new token ids."""

    TYPE: ClassVar[str] = "chunk"

    id: str
    index: int  # 0, 1, 2, ... per request id
    text: str
    token_ids: list[int]

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id) | {"index": self.index, "text": self.text, "token_ids": self.token_ids}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ChunkReply:
        r, request_id = _open(data, reply=True)
        reply = cls(
            id=request_id,
            index=r.integer("index", lo=0),
            text=r.string("text"),
            token_ids=r.integer_list("token_ids", lo=0, hi=MAX_TOKEN_ID),
        )
        r.finish()
        return reply


@dataclass(slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}

    @classmethod
    def read(cls, r: FieldReader) -> Usage:
        usage = cls(prompt_tokens=r.integer("prompt_tokens", lo=0), completion_tokens=r.integer("completion_tokens", lo=0))
        r.finish()
        return usage


@dataclass(slots=True, kw_only=True)
class Timings:
    """Seconds, measured by the daemon from the moment it received the request."""

    ttft_s: float | None  # None when no token was produced
    total_s: float
    queue_s: float

    def to_wire(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "total_s": self.total_s, "queue_s": self.queue_s}

    @classmethod
    def read(cls, r: FieldReader) -> Timings:
        timings = cls(
            ttft_s=r.number("ttft_s", None, lo=0.0),
            total_s=r.number("total_s", lo=0.0),
            queue_s=r.number("queue_s", lo=0.0),
        )
        r.finish()
        return timings


@dataclass(slots=True, kw_only=True)
class FinalReply:
    """The terminal reply of a generate request that ran: the whole output and its accounting."""

    TYPE: ClassVar[str] = "final"

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id) | {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage.to_wire(),
            "timings": self.timings.to_wire(),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> FinalReply:
        r, request_id = _open(data, reply=True)
        reply = cls(
            id=request_id,
            text=r.string("text"),
            token_ids=r.integer_list("token_ids", lo=0, hi=MAX_TOKEN_ID),
            finish_reason=r.string("finish_reason", choices=FINISH_REASONS),
            usage=Usage.read(r.nested("usage")),
            timings=Timings.read(r.nested("timings")),
        )
        r.finish()
        return reply


@dataclass(slots=True, kw_only=True)
class ErrorReply:
    """A request failed or was refused; terminal for that id. `id` is "" when unattributable."""

    TYPE: ClassVar[str] = "error"

    id: str
    code: ErrorCode
    message: str
    field: str | None = None

    @classmethod
    def from_error(cls, error: ProtocolError, request_id: str | None = None) -> ErrorReply:
        return cls(
            id=request_id if request_id is not None else (error.request_id or ""),
            code=error.code,
            message=error.message[:MAX_ERROR_MESSAGE_CHARS],
            field=error.field,
        )

    def to_error(self) -> ProtocolError:
        return ProtocolError(self.code, self.message, field=self.field, request_id=self.id or None)

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id) | {"code": self.code.value, "message": self.message, "field": self.field}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ErrorReply:
        r, request_id = _open(data, reply=True)
        code_text = r.string("code")
        message = r.string("message", max_chars=MAX_ERROR_MESSAGE_CHARS)
        try:
            code = ErrorCode(code_text)
        except ValueError:
            # A newer daemon's code: the spec tells clients to treat it as internal.
            code, message = ErrorCode.INTERNAL, f"[{code_text}] {message}"
        reply = cls(id=request_id, code=code, message=message, field=r.string("field", None))
        r.finish()
        return reply


@dataclass(slots=True, kw_only=True)
class StatusReply:
    TYPE: ClassVar[str] = "status_reply"

    id: str
    status: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id) | {"status": self.status}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StatusReply:
        r, request_id = _open(data, reply=True)
        reply = cls(id=request_id, status=dict(r.mapping("status")))
        r.finish()
        return reply


@dataclass(slots=True, kw_only=True)
class HealthReply:
    TYPE: ClassVar[str] = "health_reply"

    id: str
    state: str  # the daemon's lifecycle state: starting, loading, capturing, ready, ...
    ok: bool  # true when generate requests are being accepted

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id) | {"state": self.state, "ok": self.ok}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> HealthReply:
        r, request_id = _open(data, reply=True)
        reply = cls(id=request_id, state=r.string("state", min_chars=1, max_chars=64), ok=r.boolean("ok"))
        r.finish()
        return reply


Reply = ChunkReply | FinalReply | ErrorReply | StatusReply | HealthReply
REPLY_TYPES: dict[str, type[Reply]] = {
    cls.TYPE: cls for cls in (ChunkReply, FinalReply, ErrorReply, StatusReply, HealthReply)
}


# ---------------------------------------------------------------- dispatch


def request_from_wire(data: Mapping[str, Any]) -> Request:
    """Validate a decoded client message; errors carry the request id when it is readable."""
    try:
        check_version(data)
        return REQUEST_TYPES[message_type(data, REQUEST_TYPES)].from_wire(data)
    except ProtocolError as error:
        if error.request_id is None:
            error.request_id = peek_request_id(data)
        raise


def reply_from_wire(data: Mapping[str, Any]) -> Reply:
    check_version(data)
    return REPLY_TYPES[message_type(data, REPLY_TYPES)].from_wire(data)
