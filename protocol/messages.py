"""Client-facing messages: the requests a client sends and the replies it receives.

Each message is a `Message` struct (see `protocol.envelope`): its field types and
constraints are the validation the codec applies when it decodes a frame, and every
violation names the field. SPEC.md documents the same fields for implementers in
other languages. `SamplingParams` is also what the engine samples and stops with:
the wire rules are the only rules.

Version 2 added chat `messages`, `n` sequences and logprobs; version 3 a request's
`cache_salt` and the final's `usage.cached_tokens`; version 4 structured output
(`sampling.structured`), tools (a chat's `tools`, a message's `tool_calls` and
`tool_call_id`), a request's `speculative` and the prompt's logprobs
(`sampling.prompt_logprobs`, the final's `prompt_logprobs`). A message keeps its version in
`v` and is written in that version's shape (`wire_form`); the older shapes are the `_V1`,
`_V2` and `_V3` structs, read back into the current classes (`current`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hybridd.protocol.envelope import MAX_FLOAT, Count, Fields, Message, ReplyId, RequestId, Seconds
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import (
    MAX_ABS_PENALTY,
    MAX_CACHE_SALT_CHARS,
    MAX_CHAT_MESSAGES,
    MAX_CHAT_ROLE_CHARS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_ERROR_MESSAGE_CHARS,
    MAX_FINAL_LOGPROB_ENTRIES,
    MAX_N,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_REPLY_RING_BYTES,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_CHARS,
    MAX_TIMEOUT_S,
    MAX_TOKEN_ID,
    MAX_TOKENS_CAP,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOL_NAME_CHARS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    MIN_REPLY_RING_BYTES,
    PROTOCOL_VERSION,
)

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Penalty = Annotated[float, Meta(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Logprob = Annotated[float, Meta(ge=-MAX_FLOAT, le=0.0)]


# ---------------------------------------------------------------- requests


class SamplingParamsV1(Fields):
    """The sampling fields of version 1 (see `SamplingParams`)."""

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_CAP)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_FLOAT)] = 1.0  # 0 = greedy
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOKEN_ID)] = 0  # 0 or -1 = off; >= vocab size is off as well
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED)] | None = None  # None = nondeterministic
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_FLOAT)] = 1.0  # HF semantics, prompt + output
    presence_penalty: Penalty = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: Penalty = 0.0
    stop: Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False

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


class SamplingParamsV3(SamplingParamsV1):
    """The sampling fields of versions 2 and 3 (see `SamplingParams`)."""

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # sequences generated from the one prompt
    logprobs: bool = False  # the logprob of each sampled token
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # and of this many alternatives

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")

    @property
    def logprob_entries(self) -> int:
        """How many logprob entries the whole output can carry (0 without logprobs)."""
        return self.n * self.max_tokens * (1 + self.top_logprobs) if self.logprobs else 0

    def v1(self) -> SamplingParamsV1:
        return SamplingParamsV1(**{name: getattr(self, name) for name in SamplingParamsV1.__struct_fields__})


StructuredText = Annotated[str, Meta(min_length=1, max_length=MAX_STRUCTURED_CHARS)]


class StructuredOutput(Fields):
    """Version 4: what the output must be, exactly one of: a JSON document valid against
    the JSON Schema `json` (JSON text), any JSON object (`json_object`), a match of the
    regular expression `regex`, a sentence of the Lark grammar `grammar`, or one of the
    strings `choice`."""

    json: StructuredText | None = None
    json_object: bool = False
    regex: StructuredText | None = None
    grammar: StructuredText | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                      Meta(min_length=1, max_length=MAX_CHOICES)] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "grammar", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("exactly one of json, json_object, regex, grammar and choice must be given"
                             + (f" (got {', '.join(given)})" if given else ""))

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "grammar", "choice") if getattr(self, name) is not None)


class SamplingParams(SamplingParamsV3):
    """How to pick tokens, how many sequences, and when to stop. Every field is optional
    on the wire; `n`, `logprobs` and `top_logprobs` exist from version 2 on, `structured`
    and `prompt_logprobs` from version 4."""

    structured: StructuredOutput | None = None  # version 4: constrain the output
    # Version 4: the logprobs of the prompt's tokens (each one's, under the model's
    # distribution at the position before it, with this many most likely alternatives).
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def v3(self) -> SamplingParamsV3:
        if self.structured is not None:
            raise ValueError("sampling.structured needs protocol version 4")
        return SamplingParamsV3(**{name: getattr(self, name) for name in SamplingParamsV3.__struct_fields__})


class ChatMessageV3(Fields):
    """A chat message of versions 2 and 3 (see `ChatMessage`)."""

    role: Annotated[str, Meta(min_length=1, max_length=MAX_CHAT_ROLE_CHARS)]  # system, user, ...
    content: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
    name: Annotated[str, Meta(min_length=1, max_length=MAX_CHAT_ROLE_CHARS)] | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as chat templates read it (`name` only when given)."""
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


ToolName = Annotated[str, Meta(min_length=1, max_length=MAX_TOOL_NAME_CHARS, pattern="^[A-Za-z0-9_.-]+$")]


class ToolCall(Fields):
    """Version 4: a function call an assistant's message made: its id, the function's
    name and its arguments (JSON text, as the model wrote them)."""

    id: Annotated[str, Meta(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]
    name: ToolName
    arguments: Annotated[str, Meta(max_length=MAX_STRUCTURED_CHARS)]


class ToolSpec(Fields):
    """Version 4: a function the model may call: its name, what it does, and the JSON
    Schema of its parameters (JSON text; nil: none)."""

    name: ToolName
    description: Annotated[str, Meta(max_length=MAX_STRUCTURED_CHARS)] | None = None
    parameters: StructuredText | None = None

    def as_dict(self) -> dict[str, Any]:
        """The tool as chat templates read it: OpenAI's `{"type": "function", "function": ...}`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = _json_or_text(self.parameters)
        return {"type": "function", "function": function}


class ChatMessage(ChatMessageV3):
    """One message of a chat: who speaks (`role`, optionally a `name`) and what; from
    version 4, the tool calls an assistant's message made, and the call a `tool`
    message answers (`tool_call_id`)."""

    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Meta(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: OpenAI's shape, a call's arguments a
        map when they are a JSON object (templates write them with `tojson`)."""
        message: dict[str, Any] = super().as_dict()
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": _json_or_text(call.arguments)}} for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def v3(self) -> ChatMessageV3:
        if self.tool_calls is not None or self.tool_call_id is not None:
            raise ValueError("a message's tool_calls and tool_call_id need protocol version 4")
        return ChatMessageV3(role=self.role, content=self.content, name=self.name)


def _json_or_text(text: str) -> Any:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
    return value if isinstance(value, dict) else text


Prompt = Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
PromptTokenIds = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class GenerateRequest(Message, tag="generate"):
    id: RequestId
    prompt: Prompt | None = None
    prompt_token_ids: PromptTokenIds | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_CHAT_MESSAGES)] | None = None  # version 2: a chat
    sampling: SamplingParams | None = None  # nil: all defaults; never None once built
    stream: bool | None = True  # nil: the default; never None once built
    timeout_s: Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    # Version 3: requests share cached KV blocks only under the same salt (nil: the unsalted share).
    cache_salt: CacheSalt | None = None
    # Version 4: the functions a chat's model may call, written into its prompt by its chat template.
    tools: Annotated[list[ToolSpec], Meta(max_length=MAX_TOOLS)] | None = None
    # Version 4: false turns speculative decoding off for this request (nil: the daemon's setting).
    speculative: bool | None = None

    def __post_init__(self) -> None:
        if self.sampling is None:
            self.sampling = SamplingParams()
        if self.stream is None:
            self.stream = True
        given = [name for name, value in (("prompt", self.prompt), ("prompt_token_ids", self.prompt_token_ids),
                                          ("messages", self.messages)) if value is not None]
        if len(given) != 1:
            choices = "prompt and prompt_token_ids" if self.v < 2 else "prompt, prompt_token_ids and messages"
            raise _invalid("prompt", f"exactly one of {choices} must be given"
                           + (f" (got {', '.join(given)})" if given else ""))
        if self.messages is not None:
            if not self.messages:
                raise _invalid("messages", "needs at least 1 message")
            total = sum(len(m.content) for m in self.messages)
            if total > MAX_PROMPT_CHARS:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"messages: {total} characters of content exceed the "
                                    f"limit of {MAX_PROMPT_CHARS}", field="messages")
        if self.tools is not None and self.messages is None:
            raise _invalid("tools", "tools are offered to a chat: give messages")
        if not self.stream and self.sampling.logprob_entries > MAX_FINAL_LOGPROB_ENTRIES:
            raise _invalid("sampling.top_logprobs",
                           f"n x max_tokens x (1 + top_logprobs) = {self.sampling.logprob_entries} logprob entries "
                           f"exceed the {MAX_FINAL_LOGPROB_ENTRIES} one final reply carries; stream the request "
                           f"(its chunks carry the logprobs) or ask for fewer")

    def wire_form(self) -> Message:
        if self.v >= 4:
            return self
        if self.speculative is not None:
            raise ValueError(f"speculative needs protocol version 4, this request is version {self.v}")
        if self.tools is not None:
            raise ValueError(f"tools need protocol version 4, this request is version {self.v}")
        if self.sampling.prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs needs protocol version 4, this request is version {self.v}")
        sampling = self.sampling.v3()
        messages = None if self.messages is None else [m.v3() for m in self.messages]
        if self.v == 3:
            return _GenerateRequestV3(id=self.id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                                      messages=messages, sampling=sampling, stream=self.stream,
                                      timeout_s=self.timeout_s, cache_salt=self.cache_salt, v=self.v)
        if self.cache_salt is not None:
            raise ValueError(f"cache_salt needs protocol version 3, this request is version {self.v}")
        if self.v == 2:
            return _GenerateRequestV2(id=self.id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                                      messages=messages, sampling=sampling, stream=self.stream,
                                      timeout_s=self.timeout_s, v=self.v)
        return _GenerateRequestV1(id=self.id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                                  sampling=self.sampling.v1(), stream=self.stream, timeout_s=self.timeout_s, v=self.v)


def _current_sampling(sampling: SamplingParamsV3 | None) -> SamplingParams | None:
    return None if sampling is None else SamplingParams(**msgspec.structs.asdict(sampling))


def _current_messages(messages: list[ChatMessageV3] | None) -> list[ChatMessage] | None:
    return None if messages is None else [ChatMessage(**msgspec.structs.asdict(m)) for m in messages]


class _GenerateRequestV2(Message, tag="generate"):
    id: RequestId
    prompt: Prompt | None = None
    prompt_token_ids: PromptTokenIds | None = None
    messages: Annotated[list[ChatMessageV3], Meta(max_length=MAX_CHAT_MESSAGES)] | None = None
    sampling: SamplingParamsV3 | None = None
    stream: bool | None = True
    timeout_s: Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)] | None = None

    def current(self) -> GenerateRequest:
        return GenerateRequest(id=self.id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                               messages=_current_messages(self.messages), sampling=_current_sampling(self.sampling),
                               stream=self.stream, timeout_s=self.timeout_s, v=self.v)


class _GenerateRequestV3(_GenerateRequestV2, tag="generate"):
    """Version 3: version 2's generate and its `cache_salt`."""

    cache_salt: CacheSalt | None = None

    def current(self) -> GenerateRequest:
        return msgspec.structs.replace(super().current(), cache_salt=self.cache_salt)


class _GenerateRequestV1(Message, tag="generate"):
    id: RequestId
    prompt: Prompt | None = None
    prompt_token_ids: PromptTokenIds | None = None
    sampling: SamplingParamsV1 | None = None
    stream: bool | None = True
    timeout_s: Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)] | None = None

    def current(self) -> GenerateRequest:
        sampling = None if self.sampling is None else SamplingParams(**msgspec.structs.asdict(self.sampling))
        return GenerateRequest(id=self.id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                               sampling=sampling, stream=self.stream, timeout_s=self.timeout_s, v=self.v)


class CancelRequest(Message, tag="cancel"):
    id: RequestId
    target: RequestId  # the id of the generate to cancel


class StatusRequest(Message, tag="status"):
    id: RequestId


class HealthRequest(Message, tag="health"):
    id: RequestId


class AttachRingRequest(Message, tag="attach_ring"):
    """Version 2: a same-host client's reply ring (ipc/reply_ring.py), a memfd the
    daemon opens as `/proc/<the session's peer pid>/fd/<fd>`."""

    id: RequestId
    fd: Annotated[int, Meta(ge=0, le=2**31 - 1)]
    bytes: Annotated[int, Meta(ge=MIN_REPLY_RING_BYTES, le=MAX_REPLY_RING_BYTES)]


Request = GenerateRequest | CancelRequest | StatusRequest | HealthRequest | AttachRingRequest
REQUEST_FORMS = {
    4: Request,
    3: _GenerateRequestV3 | CancelRequest | StatusRequest | HealthRequest | AttachRingRequest,
    2: _GenerateRequestV2 | CancelRequest | StatusRequest | HealthRequest | AttachRingRequest,
    1: _GenerateRequestV1 | CancelRequest | StatusRequest | HealthRequest,
}
"""The structs a frame of each version decodes into."""


# ---------------------------------------------------------------- replies


class TopLogprob(Fields):
    """One of the most likely tokens at a position, with its logprob."""

    token_id: TokenId
    text: str  # the token decoded alone (may hold U+FFFD for part of a UTF-8 character)
    logprob: Logprob


class TokenLogprob(Fields):
    """A sampled token's logprob and, when asked for, the most likely alternatives
    (`top_logprobs`, most likely first), from the distribution it was sampled from."""

    token_id: TokenId
    text: str
    logprob: Logprob
    top_logprobs: Annotated[list[TopLogprob], Meta(max_length=MAX_TOP_LOGPROBS)] = []


class PromptLogprob(TokenLogprob):
    """Version 4: a prompt token's logprob under the model's distribution at the position
    before it (the raw log-softmax: no sampling parameter applies to a prompt), its rank
    there (1: the most likely), and the most likely alternatives."""

    rank: Annotated[int, Meta(ge=1)] = 1


class ChunkReply(Fields):
    """Incremental output of one sequence of a streaming generate: its new text and new
    token ids (and their logprobs, when asked for).

    On the wire `index` is the sequence (0 … n−1) from version 2 on; version 1 has one
    sequence and writes the running chunk count (`number`) as `index` instead."""

    id: str
    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id when asked for
    number: int = 0  # 0, 1, 2, ... per request id
    v: int = PROTOCOL_VERSION

    def wire_form(self) -> Message:
        if self.v >= 2:
            return _Chunk(id=self.id, index=self.index, text=self.text, token_ids=self.token_ids,
                          logprobs=self.logprobs, v=self.v)
        return _ChunkV1(id=self.id, index=self.number, text=self.text, token_ids=self.token_ids, v=self.v)


class _Chunk(Message, tag="chunk"):
    id: ReplyId
    index: Annotated[int, Meta(ge=0, le=MAX_N - 1)]
    text: str
    token_ids: list[TokenId]
    logprobs: list[TokenLogprob] | None = None

    def current(self) -> ChunkReply:
        return ChunkReply(id=self.id, index=self.index, text=self.text, token_ids=self.token_ids,
                          logprobs=self.logprobs, v=self.v)


class _ChunkV1(Message, tag="chunk"):
    id: ReplyId
    index: Count  # the running chunk count
    text: str
    token_ids: list[TokenId]

    def current(self) -> ChunkReply:
        return ChunkReply(id=self.id, index=0, number=self.index, text=self.text, token_ids=self.token_ids, v=self.v)


class UsageV2(Fields):
    """The usage of versions 1 and 2 (see `Usage`)."""

    prompt_tokens: Count  # counted once, however many sequences share the prompt
    completion_tokens: Count  # over all sequences


class Usage(UsageV2):
    cached_tokens: Count = 0  # version 3: prompt tokens whose KV the prefix cache held (not prefilled)

    def v2(self) -> UsageV2:
        return UsageV2(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)


class Timings(Fields):
    """Seconds, measured by the daemon from the moment it received the request."""

    ttft_s: Seconds | None  # None when no token was produced
    total_s: Seconds
    queue_s: Seconds


class Choice(Fields):
    """One sequence's whole output, as OpenAI calls it."""

    index: Annotated[int, Meta(ge=0, le=MAX_N - 1)]
    text: str  # the whole completion (not only the tail)
    token_ids: list[TokenId]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # non-streaming requests that asked for them


class FinalReply(Message, tag="final"):
    """The terminal reply of a generate request that ran: every sequence's output
    (`choices`, by index) and the request's accounting.

    Version 1 has one sequence and writes its fields at the top level."""

    id: ReplyId
    choices: Annotated[list[Choice], Meta(min_length=1, max_length=MAX_N)]
    usage: Usage
    timings: Timings
    # Version 4: one entry per prompt token when `prompt_logprobs` was asked for (the
    # first token's is nil: nothing precedes it), else nil.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    def __post_init__(self) -> None:
        if [c.index for c in self.choices] != list(range(len(self.choices))):
            raise ValueError("choices: must hold indexes 0, 1, … in order")

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

    def wire_form(self) -> Message:
        if self.v >= 4:
            return self
        if self.v == 3:
            return _FinalV3(id=self.id, choices=self.choices, usage=self.usage, timings=self.timings, v=self.v)
        if self.v == 2:
            return _FinalV2(id=self.id, choices=self.choices, usage=self.usage.v2(), timings=self.timings, v=self.v)
        if len(self.choices) != 1:
            raise ValueError(f"a version 1 final has one sequence, not {len(self.choices)}")
        choice = self.choices[0]
        return _FinalV1(id=self.id, text=choice.text, token_ids=choice.token_ids, finish_reason=choice.finish_reason,
                        usage=self.usage.v2(), timings=self.timings, v=self.v)


class _FinalV3(Message, tag="final"):
    id: ReplyId
    choices: Annotated[list[Choice], Meta(min_length=1, max_length=MAX_N)]
    usage: Usage
    timings: Timings

    def current(self) -> FinalReply:
        return FinalReply(id=self.id, choices=self.choices, usage=self.usage, timings=self.timings, v=self.v)


class _FinalV2(Message, tag="final"):
    id: ReplyId
    choices: Annotated[list[Choice], Meta(min_length=1, max_length=MAX_N)]
    usage: UsageV2
    timings: Timings

    def current(self) -> FinalReply:
        return FinalReply(id=self.id, choices=self.choices, usage=Usage(**msgspec.structs.asdict(self.usage)),
                          timings=self.timings, v=self.v)


class _FinalV1(Message, tag="final"):
    id: ReplyId
    text: str
    token_ids: list[TokenId]
    finish_reason: FinishReason
    usage: UsageV2
    timings: Timings

    def current(self) -> FinalReply:
        choice = Choice(index=0, text=self.text, token_ids=self.token_ids, finish_reason=self.finish_reason)
        return FinalReply(id=self.id, choices=[choice], usage=Usage(**msgspec.structs.asdict(self.usage)),
                          timings=self.timings, v=self.v)


class ErrorReply(Message, tag="error"):
    """A request failed or was refused; terminal for that id. `id` is "" when unattributable."""

    id: ReplyId
    code: str  # an ErrorCode once built
    message: Annotated[str, Meta(max_length=MAX_ERROR_MESSAGE_CHARS)]
    field: str | None = None

    def __post_init__(self) -> None:
        try:
            self.code = ErrorCode(self.code)
        except ValueError:
            # A newer daemon's code: the spec tells clients to treat it as internal.
            self.message = f"[{self.code}] {self.message}"
            self.code = ErrorCode.INTERNAL

    @classmethod
    def from_error(cls, error: ProtocolError, request_id: str | None = None) -> ErrorReply:
        extra = {} if error.version is None else {"v": error.version}
        return cls(
            id=request_id if request_id is not None else (error.request_id or ""),
            code=error.code,
            message=error.message[:MAX_ERROR_MESSAGE_CHARS],
            field=error.field,
            **extra,
        )


class StatusReply(Message, tag="status_reply"):
    id: ReplyId
    status: dict[str, Any]  # informative keys, see SPEC.md; may grow without a version change


class HealthReply(Message, tag="health_reply"):
    id: ReplyId
    state: Annotated[str, Meta(min_length=1, max_length=64)]  # the lifecycle state: starting, loading, ready, ...
    ok: bool  # true when generate requests are being accepted


class RingAttachedReply(Message, tag="ring_attached"):
    """The ring is attached: every later reply of the session is numbered from 1 and
    written to it as well."""

    id: ReplyId


Reply = ChunkReply | FinalReply | ErrorReply | StatusReply | HealthReply | RingAttachedReply
REPLY_FORMS = {
    4: _Chunk | FinalReply | ErrorReply | StatusReply | HealthReply | RingAttachedReply,
    3: _Chunk | _FinalV3 | ErrorReply | StatusReply | HealthReply | RingAttachedReply,
    2: _Chunk | _FinalV2 | ErrorReply | StatusReply | HealthReply | RingAttachedReply,
    1: _ChunkV1 | _FinalV1 | ErrorReply | StatusReply | HealthReply,
}
"""The structs a frame of each version decodes into."""


def _invalid(field: str, reason: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, f"{field}: {reason}", field=field)
