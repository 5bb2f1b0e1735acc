"""The client core that both faces use (`Client`, threads; `AsyncClient`, asyncio): the
options every client takes and their checks, the requests built and checked before
they leave, and one request's state machine (`Call`): reached over a connected session
or answered by the fallback endpoint, its replies turned into chunks and an outcome
(a result, or the exception for an error), its deadline, and its end, which cancels
the daemon's work when the caller stops waiting.

The faces differ only in how a caller waits: a sync caller's thread sleeps on the
reply ring or a queue, an async caller's task awaits a future in its loop.
"""

from __future__ import annotations

import asyncio
import time
from types import EllipsisType
from typing import Any

from msgspec.structs import replace

from hybridd import client_fallback
from hybridd.client.session import Session, new_request_id
from hybridd.client_ring import AUTO_RING, DEFAULT_RING_BYTES
from hybridd.errors import DaemonUnreachableError, HybriddError, InternalError, RequestCancelledError
from hybridd.errors import RequestTimeoutError, error_for_code
from hybridd.ipc.reply_ring import supported as ring_supported
from hybridd.protocol import codec
from hybridd.protocol.codec import encode
from hybridd.protocol.errors import ProtocolError
from hybridd.protocol.limits import MAX_REPLY_RING_BYTES, MAX_TIMEOUT_S, MIN_REPLY_RING_BYTES, PROTOCOL_VERSION
from hybridd.protocol.messages import (
    ChatMessage,
    ChunkReply,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Reply,
    SamplingParams,
    StatusReply,
    StatusRequest,
    TokenLogprob,
    ToolSpec,
)
from hybridd.results import Chunk, GenerateResult, Health

# How long a call waits to reach the daemon (and, for health and status, for the reply)
# unless the client or the call sets `connect_timeout`.
CONNECT_TIMEOUT_S = 10.0
SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
Messages = list[ChatMessage | dict[str, Any]]
Tools = list[ToolSpec | dict[str, Any]]
Sampling = SamplingParams | dict[str, Any] | None
Timeout = float | None | EllipsisType


def load_curve_keys(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret) Z85 keys from a certificate file written by `hybridd keygen`."""
    import zmq.auth

    return zmq.auth.load_certificate(path)


# ---------------------------------------------------------------- one request's state


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Call:
    """One request from its sending to its end. `take` turns each reply into what the
    caller gets: a chunk, or None once the call ended with `result` (a generation's) or
    `reply` (health, status); an error reply, or a final one that says the generation
    failed, raises its exception instead."""

    __slots__ = ("request", "id", "deadline", "connect_timeout", "sent", "done", "result", "reply", "_logprobs")

    def __init__(self, request: Any, timeout: float | None, connect_timeout: float) -> None:
        self.request = request
        self.id: str = request.id
        self.deadline = deadline_after(timeout)
        self.connect_timeout = connect_timeout
        self.sent = False
        self.done = False
        self.result: GenerateResult | None = None
        self.reply: Reply | None = None
        self._logprobs: dict[int, list[TokenLogprob]] = {}  # what a stream's chunks carried, by sequence

    def connect_wait(self) -> float:
        """The connect timeout, or less when the call's own deadline comes first."""
        left = remaining(self.deadline)
        return self.connect_timeout if left is None else min(self.connect_timeout, left)

    def take(self, reply: Reply | HybriddError) -> Chunk | None:
        if isinstance(reply, ChunkReply):
            if reply.logprobs is not None:
                self._logprobs.setdefault(reply.index, []).extend(reply.logprobs)
            return Chunk(id=reply.id, index=reply.index, text=reply.text, token_ids=reply.token_ids,
                         logprobs=reply.logprobs)
        self.done = True
        raise_for(reply)
        self.reply = reply
        if isinstance(reply, FinalReply):
            self.result = result_of(reply, self._logprobs)
        return None

    def expired(self) -> RequestTimeoutError:
        """End the call at its deadline: the exception to raise (the caller cancels the
        daemon's work)."""
        self.done = True
        return RequestTimeoutError("the call's timeout expired", request_id=self.id)

    def stop(self) -> bool:
        """End the call before its last reply; True when the daemon has it and must be
        told to stop."""
        working = self.sent and not self.done
        self.done = True
        return working


async def reach(session: Session, call: Call) -> None:
    """Return once `session` is connected, for `call` to be sent. Else ask the fallback
    endpoint: its reply ends the call (health and status answered, a generation refused
    `unavailable`); where none answers, DaemonUnreachableError says what was found."""
    if session.connected:
        return
    wait = call.connect_wait()
    try:
        await session.reach(wait)
    except DaemonUnreachableError:
        call.done = True
        reply = await asyncio.to_thread(client_fallback.ask, session.endpoint, call.request, wait)
        if reply is None:
            raise
        call.take(reply)
        if call.result is None and call.reply is None:
            raise  # no answer the call can end with
    except BaseException:
        call.done = True
        raise


# ---------------------------------------------------------------- replies → outcomes


def result_of(reply: FinalReply, streamed: dict[int, list[TokenLogprob]] | None = None) -> GenerateResult:
    """The outcome of a final reply; `streamed`: logprobs that a stream's chunks carried
    (its final does not repeat them), by sequence index."""
    choices = reply.choices
    if streamed:
        choices = [replace(c, logprobs=streamed.get(c.index, [])) if c.logprobs is None else c for c in choices]
    first = choices[0]
    return GenerateResult(id=reply.id, text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
                          usage=reply.usage, timings=reply.timings, logprobs=first.logprobs, choices=list(choices),
                          prompt_logprobs=reply.prompt_logprobs)


def raise_for(reply: Reply | HybriddError) -> None:
    """Raise the exception for an error outcome; return for a successful reply."""
    if isinstance(reply, HybriddError):
        raise reply
    if isinstance(reply, ErrorReply):
        raise error_for_code(reply.code, reply.message, field=reply.field, request_id=reply.id or None)
    if not isinstance(reply, FinalReply):
        return
    # The first sequence that ended otherwise than by stop or length says why it failed.
    reason = next((c.finish_reason for c in reply.choices if c.finish_reason not in ("stop", "length")), None)
    if reason is None:
        return
    partial = result_of(reply)
    if reason == "cancelled":
        raise RequestCancelledError("the request was cancelled", request_id=reply.id, partial=partial)
    if reason == "timeout":
        raise RequestTimeoutError("the request's timeout expired in the daemon", request_id=reply.id, partial=partial)
    raise InternalError("the generation failed after output began", request_id=reply.id, partial=partial)


def status_of(call: Call) -> dict[str, Any]:
    assert isinstance(call.reply, StatusReply)
    return call.reply.status


def health_of(call: Call) -> Health:
    assert isinstance(call.reply, HealthReply)
    return Health(state=call.reply.state, ok=call.reply.ok)


def generated(call: Call) -> GenerateResult:
    assert call.result is not None
    return call.result


# ---------------------------------------------------------------- requests


def build_generate(prompt: str | list[int] | None, messages: Messages | None, sampling: Sampling,
                   options: dict[str, Any], *, request_id: str | None, stream: bool,
                   timeout: float | None, cache_salt: str | None = None, tools: Tools | None = None,
                   speculative: bool | None = None) -> GenerateRequest:
    """A generate request, checked by the daemon's own decoder, so that a bad one fails
    here, naming its field. `cache_salt`: requests share prefix-cache blocks only under
    the same salt (None: the unsalted share). `speculative`: False turns speculative
    decoding off for this request (None: the daemon's setting)."""
    if isinstance(sampling, SamplingParams):
        if options:
            raise TypeError("give sampling options either as `sampling` or as keywords, not both")
        fields: SamplingParams | dict[str, Any] = sampling
    else:
        fields = (sampling or {}) | options
        unknown = set(fields) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
    text, ids = (prompt, None) if isinstance(prompt, str) or prompt is None else (None, list(prompt))
    request_id = request_id or new_request_id()
    wire = {
        "v": PROTOCOL_VERSION, "type": "generate", "id": request_id, "prompt": text, "prompt_token_ids": ids,
        "messages": None if messages is None else list(messages), "sampling": fields, "stream": stream,
        "timeout_s": None if timeout is None else min(timeout, MAX_TIMEOUT_S), "cache_salt": cache_salt,
        "tools": None if tools is None else list(tools), "speculative": speculative,
    }
    try:
        request = codec.REQUESTS.decode(encode(wire))
    except ProtocolError as error:
        raise error_for_code(error.code, error.message, field=error.field, request_id=request_id) from None
    assert isinstance(request, GenerateRequest)
    return request


# ---------------------------------------------------------------- the options of a client


class ClientCore:
    """What both clients take: the endpoint (default: the configured daemon's), the
    default timeout of their calls (none: a generation takes what it takes), the
    connect timeout of their calls (`CONNECT_TIMEOUT_S`), the CURVE keys for a TCP
    endpoint, and the reply ring (`reply_ring`: "auto", True, False or its size in
    bytes; see `Client`). The faces turn their calls into `Call`s here."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        server_public_key: str | bytes | None = None,
        public_key: str | bytes | None = None,
        secret_key: str | bytes | None = None,
        reply_ring: bool | int | str = AUTO_RING,
    ) -> None:
        if endpoint is None:
            from hybridd.config import load_config

            endpoint = load_config().client_endpoint
        self.endpoint = endpoint
        self.timeout = _positive(timeout, "timeout")
        self.connect_timeout = _positive(connect_timeout, "connect_timeout")
        self._keys = {"server_public_key": _as_key(server_public_key, "server_public_key"),
                      "public_key": _as_key(public_key, "public_key"), "secret_key": _as_key(secret_key, "secret_key")}
        self._ring_bytes = ring_bytes(reply_ring, endpoint)
        self._ring_optional = reply_ring == AUTO_RING

    def _new_session(self, *, wake_loop: bool) -> Session:
        """The session of this client (call in its loop)."""
        return Session(self.endpoint, **self._keys, reply_ring=self._ring_bytes, ring_optional=self._ring_optional,
                       wake_loop=wake_loop)

    def _generate_call(self, prompt: str | list[int] | None, messages: Messages | None, sampling: Sampling,
                       options: dict[str, Any], request_id: str | None, timeout: Timeout,
                       connect_timeout: float | None, *, stream: bool, cache_salt: str | None,
                       tools: Tools | None = None, speculative: bool | None = None) -> Call:
        timeout = self._timeout(timeout)
        request = build_generate(prompt, messages, sampling, options, request_id=request_id, stream=stream,
                                 timeout=timeout, cache_salt=cache_salt, tools=tools, speculative=speculative)
        return Call(request, timeout, self._connect_timeout(connect_timeout))

    def _status_call(self, timeout: Timeout, connect_timeout: float | None) -> Call:
        return Call(StatusRequest(id=new_request_id()), self._reply_timeout(timeout, connect_timeout),
                    self._connect_timeout(connect_timeout))

    def _health_call(self, timeout: Timeout, connect_timeout: float | None) -> Call:
        return Call(HealthRequest(id=new_request_id()), self._reply_timeout(timeout, connect_timeout),
                    self._connect_timeout(connect_timeout))

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if timeout is ... else _positive(timeout, "timeout")

    def _connect_timeout(self, connect_timeout: float | None) -> float:
        return self.connect_timeout if connect_timeout is None else _positive(connect_timeout, "connect_timeout")

    def _reply_timeout(self, timeout: Timeout, connect_timeout: float | None) -> float:
        """Health and status answer at once: without a timeout of their own, the connect
        timeout bounds their reply too."""
        timeout = self._timeout(timeout)
        return self._connect_timeout(connect_timeout) if timeout is None else timeout


def ring_bytes(reply_ring: bool | int | str, endpoint: str) -> int | None:
    """The bytes of the reply ring `reply_ring` asks for, None for none; ValueError when
    this client cannot have the ring it asks for. "auto" asks for one only where it can be
    had: an ipc:// endpoint on an x86-64 host."""
    if reply_ring is False:
        return None
    if reply_ring == AUTO_RING:
        return DEFAULT_RING_BYTES if endpoint.startswith("ipc://") and ring_supported() else None
    nbytes = DEFAULT_RING_BYTES if reply_ring is True else reply_ring
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not (
            MIN_REPLY_RING_BYTES <= nbytes <= MAX_REPLY_RING_BYTES) or nbytes % 8:
        raise ValueError(f"reply_ring: expected {AUTO_RING!r}, False, True or a multiple of 8 bytes from "
                         f"{MIN_REPLY_RING_BYTES} to {MAX_REPLY_RING_BYTES}, got {reply_ring!r}")
    if not endpoint.startswith("ipc://"):
        raise ValueError(f"reply_ring: only a daemon on this host (an ipc:// endpoint) can share memory, "
                         f"not {endpoint}")
    if not ring_supported():
        raise ValueError("reply_ring: needs an x86-64 host (the ring relies on its memory ordering)")
    return nbytes


def _as_key(value: str | bytes | None, name: str) -> bytes | None:
    if value is None:
        return None
    key = value.encode() if isinstance(value, str) else value
    if len(key) != 40:
        raise ValueError(f"{name}: a CURVE key is 40 Z85 characters, got {len(key)}")
    return key


def _positive(value: float | None, name: str) -> float | None:
    if value is not None and not (isinstance(value, int | float) and 0 < value < float("inf")):
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    return value
