"""Client-facing messages: the requests a client sends and the replies it receives.

Each message is a dataclass with `to_wire()` (a msgpack-ready dict, envelope
included) and `from_wire(dict)` (full validation: unknown fields, wrong types, sizes
and ranges raise `ProtocolError` naming the field). SPEC.md documents the same
fields for implementers in other languages. `SamplingParams` is also what the engine
samples and stops with: the wire rules are the only rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from hybridd.protocol.envelope import check_request_id, check_version, envelope, message_type, open_envelope, peek_request_id
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.fields import FieldReader
from hybridd.protocol.limits import (
    MAX_ABS_PENALTY,
    MAX_CHAT_MESSAGES,
    MAX_CHAT_ROLE_CHARS,
    MAX_ERROR_MESSAGE_CHARS,
    MAX_FINAL_LOGPROB_ENTRIES,
    MAX_N,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TIMEOUT_S,
    MAX_TOKEN_ID,
    MAX_TOKENS_CAP,
    MAX_TOP_LOGPROBS,
    PROTOCOL_VERSION,
)

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "cancelled", "timeout", "error"})


def _envelope(type_: str, request_id: str, version: int = PROTOCOL_VERSION) -> dict[str, Any]:
    return envelope(type_, version) | {"id": request_id}


def _open(data: Mapping[str, Any], *, reply: bool = False) -> tuple[FieldReader, str, int]:
    """Check the envelope of a client message; returns the reader, the id and the version.

    Replies may carry the empty id: an error for a message whose id was unreadable.
    """
    version = check_version(data)
    reader = open_envelope(data)
    request_id = check_request_id(reader.string("id"), allow_empty=reply)
    return reader, request_id, version


# ---------------------------------------------------------------- requests


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to pick tokens, how many sequences, and when to stop. Every field is optional
    on the wire; `n`, `logprobs` and `top_logprobs` exist from version 2 on."""

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
    n: int = 1  # sequences generated from the one prompt
    logprobs: bool = False  # the logprob of each sampled token
    top_logprobs: int = 0  # and of this many most likely alternatives

    def __post_init__(self) -> None:
        # Python callers may give one stop string as OpenAI clients do; the wire needs a list.
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_wire(self, version: int = PROTOCOL_VERSION) -> dict[str, Any]:
        wire = {
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
        if version >= 2:
            wire |= {"n": self.n, "logprobs": self.logprobs, "top_logprobs": self.top_logprobs}
        return wire

    @classmethod
    def read(cls, r: FieldReader, version: int = PROTOCOL_VERSION) -> SamplingParams:
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
        if version >= 2:  # in version 1 these are unknown fields, refused by finish()
            params.n = r.integer("n", 1, lo=1, hi=MAX_N)
            params.logprobs = r.boolean("logprobs", False)
            params.top_logprobs = r.integer("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
            if params.top_logprobs and not params.logprobs:
                raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                    f"{r.path('top_logprobs')}: needs {r.path('logprobs')} to be true",
                                    field=r.path("top_logprobs"))
        r.finish()
        return params

    @property
    def logprob_entries(self) -> int:
        """How many logprob entries the whole output can carry (0 without logprobs)."""
        return self.n * self.max_tokens * (1 + self.top_logprobs) if self.logprobs else 0


@dataclass(slots=True, kw_only=True)
class ChatMessage:
    """One message of a chat: who speaks (`role`, optionally a `name`) and what."""

    role: str  # system, user, assistant, ... as the model's chat template knows them
    content: str
    name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, "name": self.name}

    @classmethod
    def read(cls, r: FieldReader) -> ChatMessage:
        message = cls(
            role=r.string("role", min_chars=1, max_chars=MAX_CHAT_ROLE_CHARS),
            content=r.string("content", max_chars=MAX_PROMPT_CHARS),
            name=r.string("name", None, min_chars=1, max_chars=MAX_CHAT_ROLE_CHARS),
        )
        r.finish()
        return message

    def as_dict(self) -> dict[str, str]:
        """The message as chat templates read it (`name` only when given)."""
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(slots=True, kw_only=True)
class GenerateRequest:
    TYPE: ClassVar[str] = "generate"

    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # version 2: a chat, rendered by the model's template
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    timeout_s: float | None = None
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        wire = _envelope(self.TYPE, self.id, self.v) | {
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": self.sampling.to_wire(self.v),
            "stream": self.stream,
            "timeout_s": self.timeout_s,
        }
        if self.v >= 2:
            wire["messages"] = None if self.messages is None else [m.to_wire() for m in self.messages]
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> GenerateRequest:
        r, request_id, version = _open(data)
        prompt = r.string("prompt", None, min_chars=1, max_chars=MAX_PROMPT_CHARS)
        token_ids = r.integer_list(
            "prompt_token_ids", None, max_items=MAX_PROMPT_TOKEN_IDS, min_items=1, lo=0, hi=MAX_TOKEN_ID
        )
        messages = _read_messages(r) if version >= 2 else None
        given = [name for name, value in (("prompt", prompt), ("prompt_token_ids", token_ids),
                                          ("messages", messages)) if value is not None]
        if len(given) != 1:
            choices = "prompt and prompt_token_ids" if version < 2 else "prompt, prompt_token_ids and messages"
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"prompt: exactly one of {choices} must be given" + (f" (got {', '.join(given)})" if given else ""),
                field="prompt",
            )
        sampling_reader = r.nested_optional("sampling")
        sampling = SamplingParams() if sampling_reader is None else SamplingParams.read(sampling_reader, version)
        stream = r.boolean("stream", True)
        if not stream and sampling.logprob_entries > MAX_FINAL_LOGPROB_ENTRIES:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"sampling.top_logprobs: n x max_tokens x (1 + top_logprobs) = {sampling.logprob_entries} logprob "
                f"entries exceed the {MAX_FINAL_LOGPROB_ENTRIES} one final reply carries; stream the request "
                f"(its chunks carry the logprobs) or ask for fewer",
                field="sampling.top_logprobs",
            )
        request = cls(
            id=request_id,
            prompt=prompt,
            prompt_token_ids=token_ids,
            messages=messages,
            sampling=sampling,
            stream=stream,
            timeout_s=r.number("timeout_s", None, lo=0.0, lo_open=True, hi=MAX_TIMEOUT_S),
            v=version,
        )
        r.finish()
        return request


def _read_messages(r: FieldReader) -> list[ChatMessage] | None:
    items = r.mapping_list("messages", None, max_items=MAX_CHAT_MESSAGES)
    if items is None:
        return None
    if not items:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "messages: needs at least 1 message", field="messages")
    messages = [ChatMessage.read(item) for item in items]
    total = sum(len(m.content) for m in messages)
    if total > MAX_PROMPT_CHARS:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"messages: {total} characters of content exceed the limit of {MAX_PROMPT_CHARS}",
                            field="messages")
    return messages


@dataclass(slots=True, kw_only=True)
class CancelRequest:
    TYPE: ClassVar[str] = "cancel"

    id: str
    target: str
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id, self.v) | {"target": self.target}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CancelRequest:
        r, request_id, version = _open(data)
        target = r.string("target")
        check_request_id(target, "target")
        r.finish()
        return cls(id=request_id, target=target, v=version)


@dataclass(slots=True, kw_only=True)
class StatusRequest:
    TYPE: ClassVar[str] = "status"

    id: str
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id, self.v)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StatusRequest:
        r, request_id, version = _open(data)
        r.finish()
        return cls(id=request_id, v=version)


@dataclass(slots=True, kw_only=True)
class HealthRequest:
    TYPE: ClassVar[str] = "health"

    id: str
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id, self.v)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> HealthRequest:
        r, request_id, version = _open(data)
        r.finish()
        return cls(id=request_id, v=version)


Request = GenerateRequest | CancelRequest | StatusRequest | HealthRequest
REQUEST_TYPES: dict[str, type[Request]] = {
    cls.TYPE: cls for cls in (GenerateRequest, CancelRequest, StatusRequest, HealthRequest)
}


# ---------------------------------------------------------------- replies


@dataclass(slots=True, kw_only=True)
class TopLogprob:
    """One of the most likely tokens at a position, with its logprob."""

    token_id: int
    text: str  # the token decoded alone (may hold U+FFFD for part of a UTF-8 character)
    logprob: float

    def to_wire(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "text": self.text, "logprob": self.logprob}

    @classmethod
    def read(cls, r: FieldReader) -> TopLogprob:
        entry = cls(token_id=r.integer("token_id", lo=0, hi=MAX_TOKEN_ID), text=r.string("text"),
                    logprob=r.number("logprob", hi=0.0))
        r.finish()
        return entry


@dataclass(slots=True, kw_only=True)
class TokenLogprob:
    """A sampled token's logprob and, when asked for, the most likely alternatives
    (`top_logprobs`, most likely first), from the distribution it was sampled from."""

    token_id: int
    text: str
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "text": self.text, "logprob": self.logprob,
                "top_logprobs": [t.to_wire() for t in self.top_logprobs]}

    @classmethod
    def read(cls, r: FieldReader) -> TokenLogprob:
        entry = cls(
            token_id=r.integer("token_id", lo=0, hi=MAX_TOKEN_ID),
            text=r.string("text"),
            logprob=r.number("logprob", hi=0.0),
            top_logprobs=[TopLogprob.read(item) for item in r.mapping_list("top_logprobs", max_items=MAX_TOP_LOGPROBS)],
        )
        r.finish()
        return entry


def _logprobs_to_wire(logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]] | None:
    return None if logprobs is None else [entry.to_wire() for entry in logprobs]


def _read_logprobs(r: FieldReader) -> list[TokenLogprob] | None:
    items = r.mapping_list("logprobs", None)
    return None if items is None else [TokenLogprob.read(item) for item in items]


@dataclass(slots=True, kw_only=True)
class ChunkReply:
    """Incremental output of one sequence of a streaming generate: its new text and new
    token ids (and their logprobs, when asked for).

    On the wire `index` is the sequence (0 … n−1) from version 2 on; version 1 has one
    sequence and writes the running chunk count (`number`) as `index` instead."""

    TYPE: ClassVar[str] = "chunk"

    id: str
    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id when asked for
    number: int = 0  # 0, 1, 2, ... per request id
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        wire = _envelope(self.TYPE, self.id, self.v)
        if self.v < 2:
            return wire | {"index": self.number, "text": self.text, "token_ids": self.token_ids}
        return wire | {"index": self.index, "text": self.text, "token_ids": self.token_ids,
                       "logprobs": _logprobs_to_wire(self.logprobs)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ChunkReply:
        r, request_id, version = _open(data, reply=True)
        index = r.integer("index", lo=0)
        reply = cls(
            id=request_id,
            index=0 if version < 2 else index,
            number=index if version < 2 else 0,
            text=r.string("text"),
            token_ids=r.integer_list("token_ids", lo=0, hi=MAX_TOKEN_ID),
            logprobs=_read_logprobs(r) if version >= 2 else None,
            v=version,
        )
        r.finish()
        return reply


@dataclass(slots=True, kw_only=True)
class Usage:
    prompt_tokens: int  # counted once, however many sequences share the prompt
    completion_tokens: int  # over all sequences

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
class Choice:
    """One sequence's whole output, as OpenAI calls it."""

    index: int
    text: str  # the whole completion (not only the tail)
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # non-streaming requests that asked for them

    def to_wire(self) -> dict[str, Any]:
        return {"index": self.index, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "logprobs": _logprobs_to_wire(self.logprobs)}

    @classmethod
    def read(cls, r: FieldReader) -> Choice:
        choice = cls(
            index=r.integer("index", lo=0, hi=MAX_N - 1),
            text=r.string("text"),
            token_ids=r.integer_list("token_ids", lo=0, hi=MAX_TOKEN_ID),
            finish_reason=r.string("finish_reason", choices=FINISH_REASONS),
            logprobs=_read_logprobs(r),
        )
        r.finish()
        return choice


@dataclass(slots=True, kw_only=True)
class FinalReply:
    """The terminal reply of a generate request that ran: every sequence's output
    (`choices`, by index) and the request's accounting.

    Version 1 has one sequence and writes its fields at the top level."""

    TYPE: ClassVar[str] = "final"

    id: str
    choices: list[Choice]
    usage: Usage
    timings: Timings
    v: int = PROTOCOL_VERSION

    # The first sequence's output: the whole output of a request with n = 1.
    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.choices[0].finish_reason

    def to_wire(self) -> dict[str, Any]:
        wire = _envelope(self.TYPE, self.id, self.v)
        accounting = {"usage": self.usage.to_wire(), "timings": self.timings.to_wire()}
        if self.v < 2:
            if len(self.choices) != 1:
                raise ValueError(f"a version 1 final has one sequence, not {len(self.choices)}")
            choice = self.choices[0]
            return wire | {"text": choice.text, "token_ids": choice.token_ids,
                           "finish_reason": choice.finish_reason} | accounting
        return wire | {"choices": [c.to_wire() for c in self.choices]} | accounting

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> FinalReply:
        r, request_id, version = _open(data, reply=True)
        if version < 2:
            choices = [Choice(
                index=0,
                text=r.string("text"),
                token_ids=r.integer_list("token_ids", lo=0, hi=MAX_TOKEN_ID),
                finish_reason=r.string("finish_reason", choices=FINISH_REASONS),
            )]
        else:
            choices = [Choice.read(item) for item in r.mapping_list("choices", max_items=MAX_N)]
            if [c.index for c in choices] != list(range(len(choices))) or not choices:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "choices: must hold indexes 0, 1, … in order",
                                    field="choices")
        reply = cls(
            id=request_id,
            choices=choices,
            usage=Usage.read(r.nested("usage")),
            timings=Timings.read(r.nested("timings")),
            v=version,
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
    v: int = PROTOCOL_VERSION

    @classmethod
    def from_error(cls, error: ProtocolError, request_id: str | None = None) -> ErrorReply:
        return cls(
            id=request_id if request_id is not None else (error.request_id or ""),
            code=error.code,
            message=error.message[:MAX_ERROR_MESSAGE_CHARS],
            field=error.field,
        )

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id, self.v) | {"code": self.code.value, "message": self.message,
                                                        "field": self.field}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ErrorReply:
        r, request_id, version = _open(data, reply=True)
        code_text = r.string("code")
        message = r.string("message", max_chars=MAX_ERROR_MESSAGE_CHARS)
        try:
            code = ErrorCode(code_text)
        except ValueError:
            # A newer daemon's code: the spec tells clients to treat it as internal.
            code, message = ErrorCode.INTERNAL, f"[{code_text}] {message}"
        reply = cls(id=request_id, code=code, message=message, field=r.string("field", None), v=version)
        r.finish()
        return reply


@dataclass(slots=True, kw_only=True)
class StatusReply:
    TYPE: ClassVar[str] = "status_reply"

    id: str
    status: dict[str, Any]
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id, self.v) | {"status": self.status}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StatusReply:
        r, request_id, version = _open(data, reply=True)
        reply = cls(id=request_id, status=dict(r.mapping("status")), v=version)
        r.finish()
        return reply


@dataclass(slots=True, kw_only=True)
class HealthReply:
    TYPE: ClassVar[str] = "health_reply"

    id: str
    state: str  # the daemon's lifecycle state: starting, loading, capturing, ready, ...
    ok: bool  # true when generate requests are being accepted
    v: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE, self.id, self.v) | {"state": self.state, "ok": self.ok}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> HealthReply:
        r, request_id, version = _open(data, reply=True)
        reply = cls(id=request_id, state=r.string("state", min_chars=1, max_chars=64), ok=r.boolean("ok"), v=version)
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
