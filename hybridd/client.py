"""The client SDK: `Client` (threads) and `AsyncClient` (asyncio) for a running hybridd.

Both speak protocol/SPEC.md over one ZeroMQ DEALER socket (one session). The socket
lives in one asyncio event loop, in `_Session`: it routes replies to per-request sinks
by request id (read in the loop's callback for the socket's file descriptor, so that a
reply wakes its waiter with no task in between), and fails every in-flight request with
`EngineDeadError` as soon as
a socket monitor reports that the daemon's connection dropped (ZMTP heartbeats catch
a peer that vanished without closing). The DEALER reconnects by itself, so calls made
after the daemon is back succeed.

Every call first waits for the connection (the ZeroMQ handshake) for at most its
connect timeout (`CONNECT_TIMEOUT_S` unless the client or the call says otherwise), then
fails with `DaemonUnreachableError` saying what was found at the endpoint: no socket
file (at once), a socket nobody listens on, a listener that never completes the
handshake; a refused CURVE handshake is `HandshakeRefusedError`, as soon as the socket
monitor reports it. Requests are sent only over an established connection. Calls that
answer at once (`health`, `status`) wait for their reply for at most the same connect
timeout unless given a `timeout`; a `generate` runs as long as it runs, bounded by its
`timeout` if any, while ZMTP heartbeats watch the daemon.

`AsyncClient` runs its session in the caller's loop. `Client` runs one in a private
background thread (the only thread that touches the socket, as ZeroMQ requires);
callers' threads hand requests over with `call_soon_threadsafe` and wait on their own
queue, so any number of threads can share one `Client`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import EllipsisType
from typing import Any

import zmq
import zmq.asyncio
from msgspec.structs import replace
from zmq.utils.monitor import parse_monitor_message

from hybridd import client_fallback
from hybridd.client_ring import (
    AUTO_RING, DEFAULT_RING_BYTES, MAX_RING_FIRST_POLL_S, MAX_RING_PACE_S, MAX_RING_SPIN_S, RING_FIRST_POLL_S,
    RING_PACE_S, RING_SLEEP_S, RING_SPIN_S, ReplyPacer, RingDelivery,
)
from hybridd.errors import (
    DaemonUnreachableError,
    DrainingError,
    EngineDeadError,
    HandshakeRefusedError,
    HybriddError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    RequestCancelledError,
    RequestTimeoutError,
    UnavailableError,
    error_for_code,
)
from hybridd.ipc.reply_ring import HEADER_BYTES as RING_HEADER_BYTES
from hybridd.ipc.reply_ring import RingBroken, RingReader
from hybridd.ipc.reply_ring import supported as ring_supported
from hybridd.log import get_logger
from hybridd.protocol import codec
from hybridd.protocol.codec import encode
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import (
    MAX_MESSAGE_BYTES,
    MAX_REPLY_RING_BYTES,
    MAX_TIMEOUT_S,
    MIN_REPLY_RING_BYTES,
    PROTOCOL_VERSION,
)
from hybridd.protocol.messages import (
    AttachRingRequest,
    CancelRequest,
    ChatMessage,
    Choice,
    ChunkReply,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Reply,
    RingAttachedReply,
    SamplingParams,
    StatusReply,
    StatusRequest,
    TokenLogprob,
    TopLogprob,
)
from hybridd.results import Chunk, GenerateResult, Health

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "ChatMessage",
    "Choice",
    "Chunk",
    "CONNECT_TIMEOUT_S",
    "Client",
    "DaemonUnreachableError",
    "DrainingError",
    "EngineDeadError",
    "GenerateResult",
    "HandshakeRefusedError",
    "Health",
    "HybriddError",
    "InternalError",
    "InvalidRequestError",
    "NotFoundError",
    "OverloadedError",
    "RequestCancelledError",
    "RequestTimeoutError",
    "SamplingParams",
    "Stream",
    "TokenLogprob",
    "TopLogprob",
    "UnavailableError",
    "load_curve_keys",
]

log = get_logger("client")

# wait_ready(): how often it asks, and how long each question may take.
_READY_POLL_S = 0.2
_READY_POLL_TIMEOUT_S = 2.0

# How long a call waits to reach the daemon (and, for health and status, for the reply)
# unless the client or the call sets `connect_timeout`.
CONNECT_TIMEOUT_S = 10.0

# ZMTP heartbeats: a daemon host that vanishes without closing the connection (TCP)
# is declared disconnected after HEARTBEAT_TIMEOUT_MS.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000
SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
Messages = list[ChatMessage | dict[str, str]]


def load_curve_keys(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret) Z85 keys from a certificate file written by `hybridd keygen`."""
    import zmq.auth

    return zmq.auth.load_certificate(path)


def _as_key(value: str | bytes | None, name: str) -> bytes | None:
    if value is None:
        return None
    key = value.encode() if isinstance(value, str) else value
    if len(key) != 40:
        raise ValueError(f"{name}: a CURVE key is 40 Z85 characters, got {len(key)}")
    return key


def new_request_id() -> str:
    return os.urandom(16).hex()  # 128 random bits, as a uuid4's hex, for less work per request


# ---------------------------------------------------------------- replies → outcomes


def _result(reply: FinalReply, streamed: dict[int, list[TokenLogprob]] | None = None) -> GenerateResult:
    """The outcome of a final reply; `streamed`: logprobs that a stream's chunks carried
    (its final does not repeat them), by sequence index."""
    choices = reply.choices
    if streamed:
        choices = [replace(c, logprobs=streamed.get(c.index, [])) if c.logprobs is None else c for c in choices]
    first = choices[0]
    return GenerateResult(id=reply.id, text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
                          usage=reply.usage, timings=reply.timings, logprobs=first.logprobs, choices=list(choices))


def _chunk(reply: ChunkReply, streamed: dict[int, list[TokenLogprob]]) -> Chunk:
    if reply.logprobs is not None:
        streamed.setdefault(reply.index, []).extend(reply.logprobs)
    return Chunk(id=reply.id, index=reply.index, text=reply.text, token_ids=reply.token_ids, logprobs=reply.logprobs)


def _failure(reply: FinalReply) -> str | None:
    """The reason a request did not complete: the first sequence's that ended otherwise
    than by stop or length, else None."""
    return next((c.finish_reason for c in reply.choices if c.finish_reason not in ("stop", "length")), None)


def _raise_for(reply: Reply | HybriddError) -> None:
    """Raise the exception for an error outcome; return for a successful reply."""
    if isinstance(reply, HybriddError):
        raise reply
    if isinstance(reply, ErrorReply):
        raise error_for_code(reply.code, reply.message, field=reply.field, request_id=reply.id or None)
    reason = _failure(reply) if isinstance(reply, FinalReply) else None
    if reason is not None:
        partial = _result(reply)
        if reason == "cancelled":
            raise RequestCancelledError("the request was cancelled", request_id=reply.id, partial=partial)
        if reason == "timeout":
            raise RequestTimeoutError("the request's timeout expired in the daemon", request_id=reply.id,
                                      partial=partial)
        raise InternalError("the generation failed after output began", request_id=reply.id, partial=partial)


def _is_terminal(reply: Reply | HybriddError) -> bool:
    return not isinstance(reply, ChunkReply)


def _build_generate(
    prompt: str | list[int] | None,
    sampling: SamplingParams | dict[str, Any] | None,
    options: dict[str, Any],
    *,
    request_id: str | None,
    stream: bool,
    timeout: float | None,
    messages: Messages | None = None,
) -> GenerateRequest:
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
        "timeout_s": None if timeout is None else min(timeout, MAX_TIMEOUT_S),
    }
    try:  # the daemon's own decoder, so that a bad request fails here, naming its field
        request = codec.REQUESTS.decode(encode(wire))
    except ProtocolError as error:
        raise error_for_code(error.code, error.message, field=error.field, request_id=request_id) from None
    assert isinstance(request, GenerateRequest)
    return request


# ---------------------------------------------------------------- the session (one event loop)

Sink = Callable[[Reply | HybriddError], None]


class _Session:
    """One DEALER connection and the requests in flight on it; used from its loop,
    except `poll_ring`, which any thread may call (the lock guards what it touches)."""

    def __init__(self, endpoint: str, *, server_public_key: bytes | None, public_key: bytes | None,
                 secret_key: bytes | None, reply_ring: int | None = None, ring_optional: bool = False) -> None:
        self.endpoint = endpoint
        self._ring_bytes = reply_ring  # attach a ring of this many bytes on each connection
        # A ring asked for by default, not by the caller: going without one is no warning.
        self._ring_log = log.debug if ring_optional else log.warning
        self._ring: RingDelivery | None = None
        self._lock = threading.RLock()  # the pending sinks and the ring, between the loop and pollers
        self._context = zmq.asyncio.Context()
        # A plain socket read from the loop's reader callback (`_readable`); its monitor is
        # an asyncio socket of the same context.
        self._socket = zmq.Socket(self._context, zmq.DEALER)
        for option, value in (
            (zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES),
            (zmq.LINGER, 0),
            (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
            (zmq.RECONNECT_IVL, RECONNECT_IVL_MS),
            (zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS),
        ):
            self._socket.setsockopt(option, value)
        self._curve = endpoint.startswith("tcp://")
        if self._curve:
            if not (server_public_key and public_key and secret_key):
                raise ValueError("a tcp:// endpoint is served only with CURVE: give server_public_key, "
                                 "public_key and secret_key (see `hybridd keygen`)")
            self._socket.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)
            self._socket.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        self._socket.connect(endpoint)
        self.connected = False
        self._transport: str | None = None  # what the last connection attempt found: "refused", "accepted"
        self._refused: str | None = None  # why the daemon refused the last handshake
        self._changed = asyncio.Event()
        self.pending: dict[str, Sink] = {}
        self._outbox: collections.deque[bytes] = collections.deque()  # frames the socket could not take yet
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._fd = self._socket.get(zmq.FD)
        self._loop.add_reader(self._fd, self._readable)
        self._tasks = [asyncio.ensure_future(self._watch())]

    def _readable(self) -> None:
        """The socket's descriptor signalled: take every reply it holds and hand each to
        its request's sink, and send what waited for room. ZeroMQ's descriptor is edge-
        triggered (it signals a change, not a level), so the socket's events are read
        until nothing is left."""
        socket = self._socket
        while not self.closed:
            events = socket.get(zmq.EVENTS)
            if self._outbox and events & zmq.POLLOUT:
                self._flush()
            if not events & zmq.POLLIN:
                return
            frame = socket.recv(zmq.NOBLOCK, copy=False)
            with self._lock:
                if self._ring is not None and not self._ring.from_socket():
                    continue  # the ring brought it
                self._deliver(frame.buffer)
                if self._ring is not None:
                    self._ring.reader.ring_bell()  # a thread asleep on the ring may wait for it

    def _deliver(self, payload: memoryview | bytes) -> None:
        """Hand one reply to its request's sink (the lock held)."""
        try:
            reply = codec.REPLIES.decode(payload)
        except ProtocolError as error:
            log.warning("undecodable reply from the daemon", error=str(error))
            return
        sink = self.pending.get(reply.id)
        if sink is None:
            if isinstance(reply, ErrorReply) and not reply.id:
                log.warning("unattributed error from the daemon", code=reply.code.value, message=reply.message)
            return  # a reply for a request that already ended (timed out, dropped)
        if _is_terminal(reply):
            del self.pending[reply.id]
        sink(reply)

    @property
    def ring_attached(self) -> bool:
        return self._ring is not None

    def ring_reader(self) -> RingReader | None:
        """The attached ring's reader, for a thread to sleep on; None without a ring."""
        with self._lock:
            return None if self._ring is None else self._ring.reader

    def poll_ring(self) -> bool:
        """Deliver the replies the ring holds that are next in order; True if any. Called
        by the threads that wait for a reply, instead of sleeping until the socket's."""
        with self._lock:
            ring = self._ring
            if ring is None:
                return False
            delivered = False
            try:
                for payload in ring.from_ring():
                    self._deliver(payload)
                    delivered = True
            except RingBroken as error:
                log.warning("reply ring dropped; replies come by the socket", error=str(error))
                self._drop_ring()
            return delivered

    def _attach_ring(self) -> None:
        """Ask the daemon of a new connection to attach a fresh ring (it is the first
        message on the connection, so every reply after its answer is numbered)."""
        try:
            reader = RingReader(self._ring_bytes - RING_HEADER_BYTES)
        except OSError as error:
            self._ring_log("no reply ring (memory for it refused); replies come by the socket", error=str(error))
            return
        request = AttachRingRequest(id=new_request_id(), fd=reader.fd, bytes=reader.nbytes)

        def answered(reply: Reply | HybriddError) -> None:
            if isinstance(reply, RingAttachedReply):
                reader.release_fd()
                self._ring = RingDelivery(reader)
                return
            reader.close()
            reason = reply.message if isinstance(reply, ErrorReply | HybriddError) else type(reply).__name__
            self._ring_log("the daemon did not attach the reply ring; replies come by the socket", reason=reason)

        with self._lock:
            self.pending[request.id] = answered
        self._send(encode(request))

    def _drop_ring(self) -> None:
        with self._lock:
            if self._ring is not None:
                self._ring.close()
                self._ring = None

    def _send(self, frame: bytes) -> None:
        if not self._outbox:
            try:
                self._socket.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # no room (high-water mark) or no connection yet: sent when there is
                self._outbox.append(frame)
        else:
            self._outbox.append(frame)
        # A send can consume the descriptor's signal of replies that arrived meanwhile.
        if self._socket.get(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._readable)

    def _flush(self) -> None:
        while self._outbox:
            try:
                self._socket.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self._refused = True, None
                if self._ring_bytes:
                    self._attach_ring()
            elif kind == zmq.EVENT_DISCONNECTED and self.connected:
                # Only a session that was established can lose the daemon.
                self.connected = False
                self._drop_ring()  # a new connection is a new session, numbered afresh
                self.fail_all(EngineDeadError(f"the daemon's socket {self.endpoint} disconnected"))
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self._transport = "refused"
            elif kind == zmq.EVENT_CONNECTED:
                self._transport = "accepted"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused = "it does not authorise this client's public key"
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL) and self._curve:
                # Over ipc (no CURVE) a failed handshake is a daemon dying mid-way: transient.
                self._refused = "the CURVE handshake failed: is server_public_key the daemon's public key?"
            self._changed.set()

    async def reach(self, timeout: float) -> None:
        """Return once the daemon is connected; otherwise raise, at the latest after
        `timeout` seconds, what was found at the endpoint."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.connected:
            if self.closed:
                raise HybriddError("the client is closed")
            socket_file = self._socket_file()
            if socket_file is not None and not socket_file.exists():
                raise DaemonUnreachableError(f"no daemon at {self.endpoint} (no socket file {socket_file})")
            if self._refused is not None:
                raise HandshakeRefusedError(f"the daemon at {self.endpoint} refused the connection: {self._refused}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DaemonUnreachableError(self._unanswered(timeout))
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _socket_file(self) -> Path | None:
        if not self.endpoint.startswith("ipc://") or self.endpoint.startswith("ipc://@"):
            return None  # tcp, or a Linux abstract socket (no file)
        return Path(self.endpoint.removeprefix("ipc://"))

    def _unanswered(self, timeout: float) -> str:
        if self._transport == "refused":
            socket_file = self._socket_file()
            if socket_file is not None:
                return (f"no daemon at {self.endpoint} within {_seconds(timeout)} s: nothing listens on {socket_file} "
                        f"(a stale socket left by a daemon that died?)")
            return (f"no daemon at {self.endpoint} within {_seconds(timeout)} s: nothing accepts connections "
                    f"at {self.endpoint}")
        return f"no answer from {self.endpoint} within {_seconds(timeout)} s (connected, but no ZeroMQ handshake)"

    def fail_all(self, error: HybriddError) -> None:
        with self._lock:
            pending, self.pending = self.pending, {}
        for request_id, sink in pending.items():
            sink(type(error)(error.message, code=error.code, request_id=request_id))

    def submit(self, request: Any, sink: Sink) -> None:
        if self.closed:
            raise HybriddError("the client is closed")
        if request.id in self.pending:
            raise InvalidRequestError(f"id: request id {request.id!r} is already in flight on this client",
                                      field="id", request_id=request.id)
        try:
            frame = encode(request)
        except ProtocolError as error:  # over MAX_MESSAGE_BYTES: the daemon would drop the connection
            raise error_for_code(error.code, error.message, field=error.field, request_id=request.id) from None
        with self._lock:
            self.pending[request.id] = sink
        self._send(frame)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.pending.pop(request_id, None)

    def cancel(self, target: str) -> None:
        """Fire and forget: a valid cancel has no reply of its own; the target's waiter
        receives its terminal `final` (`cancelled`) as usual."""
        if not self.closed:
            self._send(encode(CancelRequest(id=new_request_id(), target=target)))

    def abandon(self, target: str) -> None:
        """A caller stopped waiting (timeout, dropped stream): free the daemon's work too."""
        with self._lock:
            abandoned = self.pending.pop(target, None) is not None
        if abandoned:
            self.cancel(target)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.fail_all(HybriddError("the client was closed", code=ErrorCode.CANCELLED))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._drop_ring()
        self._loop.remove_reader(self._fd)
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f}".rstrip("0").rstrip(".")


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _connect_wait(connect_timeout: float, deadline: float | None) -> float:
    """The connect timeout, or less when the call's own deadline comes first."""
    remaining = _remaining(deadline)
    return connect_timeout if remaining is None else min(connect_timeout, remaining)


# ---------------------------------------------------------------- sync client


class _LoopThread:
    """A private event loop in a daemon thread; the home of one `_Session`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hybridd-client-io", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` in the loop thread and return its result (or raise its exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001  handed to the calling thread
                future.set_exception(error)

        self.loop.call_soon_threadsafe(run)
        return future.result()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def _close_sync(io: _LoopThread, session: _Session) -> None:
    with contextlib.suppress(RuntimeError):
        io.run(session.close())
    io.stop()


def _wait_ring(client: Client, replies: queue.SimpleQueue, deadline: float | None,
               pacer: ReplyPacer | None = None) -> Reply | HybriddError | None:
    """The next reply in `replies` by way of the session's reply ring: polled for the
    client's `ring_spin_s`, and polled again in the `pacer`'s window around the time the
    reply is due; slept for on the ring's bell otherwise, which the daemon rings after
    writing records and the session after a reply only the socket brought. None when the
    session has no ring (any more) or the deadline passed."""
    session = client._session
    reader = session.ring_reader()
    if reader is None:
        return None
    spin_until = time.monotonic() + client.ring_spin_s
    poll_from, poll_until = (pacer.window() if pacer is not None else None) or (0.0, 0.0)
    polling = False
    try:
        with reader.sleeping():
            while not reader.closing:
                bell = reader.bell()  # before looking: a record written after it changes it
                session.poll_ring()
                if not replies.empty():
                    if polling and pacer is not None and poll_from <= time.monotonic():
                        pacer.caught += 1
                    return replies.get_nowait()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                if now < spin_until or poll_from <= now < poll_until:
                    polling = True
                    os.sched_yield()  # lets the client's I/O thread run; no sleep
                    continue
                polling = False
                sleep = RING_SLEEP_S if deadline is None else min(RING_SLEEP_S, deadline - now)
                if now < poll_from:
                    sleep = min(sleep, poll_from - now)
                reader.sleep(bell, sleep)
    except RingBroken:
        pass  # closed before this thread came to sleep on it
    return None


class Stream:
    """Chunks of one streaming `generate`, as they arrive; `result` once it ended.

    Closing it (or dropping it: garbage collection) before the end cancels the request.
    """

    def __init__(self, client: Client, request: GenerateRequest, timeout: float | None, connect_timeout: float) -> None:
        self.id = request.id
        self.result: GenerateResult | None = None
        self._client = client
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._deadline = _deadline(timeout)
        self._done = True  # until submitted: nothing to cancel
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self.pacer = ReplyPacer(client.ring_pace_s, client.ring_first_poll_s, time.monotonic())
        client._reach(connect_timeout, self._deadline, request)
        client._io.call(client._session.submit, request, self._queue.put)
        self._done = False

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            reply = _wait_ring(self._client, self._queue, self._deadline, self.pacer)
            if reply is None:
                reply = self._queue.get(timeout=_remaining(self._deadline))
        except queue.Empty:
            self.close()
            raise RequestTimeoutError("the call's timeout expired", request_id=self.id) from None
        self.pacer.arrived(time.monotonic())
        if isinstance(reply, ChunkReply):
            return _chunk(reply, self._logprobs)
        self._done = True
        _raise_for(reply)
        self.result = _result(reply, self._logprobs)
        raise StopIteration

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._client._io.post(self._client._session.abandon, self.id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _ClientOptions:
    """What both clients take: the endpoint (default: the configured daemon's), the
    default timeout of their calls (none: a generation takes what it takes), the
    connect timeout of their calls (`CONNECT_TIMEOUT_S`), and the CURVE keys for a
    TCP endpoint."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        server_public_key: str | bytes | None = None,
        public_key: str | bytes | None = None,
        secret_key: str | bytes | None = None,
    ) -> None:
        if endpoint is None:
            from hybridd.config import load_config

            endpoint = load_config().client_endpoint
        self.endpoint = endpoint
        self.timeout = _positive(timeout, "timeout")
        self.connect_timeout = _positive(connect_timeout, "connect_timeout")
        self._keys = {"server_public_key": _as_key(server_public_key, "server_public_key"),
                      "public_key": _as_key(public_key, "public_key"), "secret_key": _as_key(secret_key, "secret_key")}

    def _timeout(self, timeout: float | None | EllipsisType) -> float | None:
        return self.timeout if timeout is ... else _positive(timeout, "timeout")

    def _connect_timeout(self, connect_timeout: float | None) -> float:
        return self.connect_timeout if connect_timeout is None else _positive(connect_timeout, "connect_timeout")

    def _reply_timeout(self, timeout: float | None | EllipsisType, connect_timeout: float | None) -> float:
        """Health and status answer at once: without a timeout of their own, the connect
        timeout bounds their reply too."""
        timeout = self._timeout(timeout)
        return self._connect_timeout(connect_timeout) if timeout is None else timeout


def _positive(value: float | None, name: str) -> float | None:
    if value is not None and not (isinstance(value, int | float) and 0 < value < float("inf")):
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    return value


def _seconds_up_to(value: float, most: float, name: str) -> float:
    """A number of seconds from 0 to `most`, as a float; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= most:
        raise ValueError(f"{name}: expected seconds from 0 to {most}, got {value!r}")
    return float(value)


class Client(_ClientOptions):
    """A thread-safe client for one daemon. Use as a context manager, or call `close()`.

    A client of a daemon on this host (an ipc:// endpoint, x86-64) asks it, by default
    (`reply_ring="auto"`), to write the session's replies into shared memory as well as
    on the socket (ipc/reply_ring.py): a thread waiting for a reply (iterating a
    `Stream`, or in a call with one answer) sleeps on that memory until the daemon
    itself wakes it after writing the reply, so the reply arrives
    without the socket's I/O threads and the client's event loop in between. With
    `ring_spin_s` > 0 the thread first polls the memory for that long (keeping a CPU
    busy). A stream's thread also wakes by itself `ring_pace_s` before its next chunk is
    due (by the stream's recent gaps) and polls until that long after, so that the chunk
    finds it awake (0: asleep until woken); for its first chunk it polls from the
    request's submission for up to `ring_first_poll_s` (0: not at all). Where the
    daemon cannot attach the ring (another user, a limit), replies come
    by the socket alone, and the client's log says why: a debug line, or a warning where
    the caller asked for the ring (`reply_ring=True` or a size in bytes, which a client
    of a daemon elsewhere cannot have). `reply_ring=False` asks for none.
    """

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
        ring_spin_s: float = RING_SPIN_S,
        ring_pace_s: float = RING_PACE_S,
        ring_first_poll_s: float = RING_FIRST_POLL_S,
    ) -> None:
        super().__init__(endpoint, timeout=timeout, connect_timeout=connect_timeout,
                         server_public_key=server_public_key, public_key=public_key, secret_key=secret_key)
        ring_bytes = _ring_bytes(reply_ring, self.endpoint)
        self.ring_spin_s = _seconds_up_to(ring_spin_s, MAX_RING_SPIN_S, "ring_spin_s")
        self.ring_pace_s = _seconds_up_to(ring_pace_s, MAX_RING_PACE_S, "ring_pace_s")
        self.ring_first_poll_s = _seconds_up_to(ring_first_poll_s, MAX_RING_FIRST_POLL_S, "ring_first_poll_s")
        self._io = _LoopThread()
        try:
            self._session: _Session = self._io.run(
                _create_session(self.endpoint, self._keys, ring_bytes, ring_optional=reply_ring == AUTO_RING))
        except BaseException:
            self._io.stop()
            raise
        self._finalizer = weakref.finalize(self, _close_sync, self._io, self._session)

    def _reach(self, connect_timeout: float, deadline: float | None, request: Any) -> Reply | None:
        """None once connected; else the fallback endpoint's reply to `request` (health and
        status answered, generate refused `unavailable`), or DaemonUnreachableError."""
        if self._session.connected:
            return None
        wait = _connect_wait(connect_timeout, deadline)
        try:
            self._io.run(self._session.reach(wait))
        except DaemonUnreachableError:
            reply = client_fallback.ask(self.endpoint, request, wait)
            if reply is None:
                raise
            _raise_for(reply)
            return reply
        return None

    def _request(self, request: Any, timeout: float | None, connect_timeout: float) -> Reply:
        deadline = _deadline(timeout)
        if (fallback := self._reach(connect_timeout, deadline, request)) is not None:
            return fallback
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._io.call(self._session.submit, request, replies.put)
        try:
            reply = _wait_ring(self, replies, deadline)
            if reply is None:
                reply = replies.get(timeout=_remaining(deadline))
        except queue.Empty:
            self._io.post(self._session.abandon, request.id)
            raise RequestTimeoutError("the call's timeout expired", request_id=request.id) from None
        _raise_for(reply)
        return reply

    def generate(self, prompt: str | list[int], sampling: SamplingParams | dict[str, Any] | None = None, *,
                 request_id: str | None = None, timeout: float | None | EllipsisType = ...,
                 connect_timeout: float | None = None, **sampling_options: Any) -> GenerateResult:
        """Run one completion and return it whole. Sampling options as keywords or `sampling`."""
        timeout = self._timeout(timeout)
        request = _build_generate(prompt, sampling, sampling_options, request_id=request_id, stream=False,
                                  timeout=timeout)
        return _result(self._request(request, timeout, self._connect_timeout(connect_timeout)))

    def stream(self, prompt: str | list[int], sampling: SamplingParams | dict[str, Any] | None = None, *,
               request_id: str | None = None, timeout: float | None | EllipsisType = ...,
               connect_timeout: float | None = None, **sampling_options: Any) -> Stream:
        """Start one completion; iterate the returned `Stream` for its chunks."""
        timeout = self._timeout(timeout)
        request = _build_generate(prompt, sampling, sampling_options, request_id=request_id, stream=True,
                                  timeout=timeout)
        return Stream(self, request, timeout, self._connect_timeout(connect_timeout))

    def chat(self, messages: Messages, sampling: SamplingParams | dict[str, Any] | None = None, *,
             request_id: str | None = None, timeout: float | None | EllipsisType = ...,
             connect_timeout: float | None = None, **sampling_options: Any) -> GenerateResult:
        """The model's answer to a chat (`[{"role": "user", "content": "..."}]`), rendered by
        its chat template in the daemon, returned whole."""
        timeout = self._timeout(timeout)
        request = _build_generate(None, sampling, sampling_options, request_id=request_id, stream=False,
                                  timeout=timeout, messages=messages)
        return _result(self._request(request, timeout, self._connect_timeout(connect_timeout)))

    def chat_stream(self, messages: Messages, sampling: SamplingParams | dict[str, Any] | None = None, *,
                    request_id: str | None = None, timeout: float | None | EllipsisType = ...,
                    connect_timeout: float | None = None, **sampling_options: Any) -> Stream:
        """Start the model's answer to a chat; iterate the returned `Stream` for its chunks."""
        timeout = self._timeout(timeout)
        request = _build_generate(None, sampling, sampling_options, request_id=request_id, stream=True,
                                  timeout=timeout, messages=messages)
        return Stream(self, request, timeout, self._connect_timeout(connect_timeout))

    def cancel(self, request_id: str) -> None:
        """Cancel a request of this client; idempotent, no-op for an unknown or finished id."""
        self._io.call(self._session.cancel, request_id)

    def status(self, *, timeout: float | None | EllipsisType = ...,
               connect_timeout: float | None = None) -> dict[str, Any]:
        reply = self._request(StatusRequest(id=new_request_id()), self._reply_timeout(timeout, connect_timeout),
                              self._connect_timeout(connect_timeout))
        assert isinstance(reply, StatusReply)
        return reply.status

    def health(self, *, timeout: float | None | EllipsisType = ..., connect_timeout: float | None = None) -> Health:
        reply = self._request(HealthRequest(id=new_request_id()), self._reply_timeout(timeout, connect_timeout),
                              self._connect_timeout(connect_timeout))
        assert isinstance(reply, HealthReply)
        return Health(state=reply.state, ok=reply.ok)

    def wait_ready(self, timeout: float) -> Health:
        """Block until the daemon serves (health `ok`), at most `timeout` seconds; then
        UnavailableError naming the last state seen (through the fallback endpoint while
        the daemon starts or restarts its workers)."""
        deadline = time.monotonic() + timeout
        seen = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(f"the daemon at {self.endpoint} was not ready within {_seconds(timeout)} s "
                                       f"(last seen: {seen})")
            try:
                health = self.health(timeout=min(remaining, _READY_POLL_TIMEOUT_S),
                                     connect_timeout=min(remaining, _READY_POLL_TIMEOUT_S))
                if health.ok:
                    return health
                seen = health.state
            except (DaemonUnreachableError, RequestTimeoutError) as error:
                seen = str(error)
            time.sleep(min(_READY_POLL_S, max(0.0, deadline - time.monotonic())))

    @property
    def connected(self) -> bool:
        return self._session.connected

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _ring_bytes(reply_ring: bool | int | str, endpoint: str) -> int | None:
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


async def _create_session(endpoint: str, keys: dict[str, bytes | None], reply_ring: int | None = None,
                          ring_optional: bool = False) -> _Session:
    return _Session(endpoint, **keys, reply_ring=reply_ring, ring_optional=ring_optional)


# ---------------------------------------------------------------- async client


class _Inbox:
    """The replies of one request, in order, for the one task that awaits them (leaner
    than an asyncio.Queue on every token's way)."""

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._loop = loop

    def put(self, item: Reply | HybriddError) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Reply | HybriddError:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    async def get_until(self, deadline: float | None) -> Reply | HybriddError:
        """The next reply; TimeoutError once `deadline` (time.monotonic) has passed."""
        if self._items:
            return self._items.popleft()
        if deadline is None:
            return await self.get()
        return await asyncio.wait_for(self.get(), _remaining(deadline))


class AsyncStream:
    """Async counterpart of `Stream`: `async for chunk in stream`; `aclose()` or GC cancels."""

    def __init__(self, client: AsyncClient, request: GenerateRequest, timeout: float | None,
                 connect_timeout: float) -> None:
        self.id = request.id
        self.result: GenerateResult | None = None
        self._session = client._session_now()
        self._loop = asyncio.get_running_loop()
        self._inbox = _Inbox(self._loop)
        self._deadline = _deadline(timeout)
        self._done = False
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        # Sent at once over an established connection, else on the first iteration,
        # once the connection is made within the connect timeout.
        self._unsent: tuple[GenerateRequest, float] | None = (request, connect_timeout)
        if self._session.connected:
            self._send()

    def _send(self) -> None:
        assert self._unsent is not None
        request, self._unsent = self._unsent[0], None
        self._session.submit(request, self._inbox.put)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        if self._unsent is not None:
            wait = _connect_wait(self._unsent[1], self._deadline)
            try:
                await self._session.reach(wait)
            except DaemonUnreachableError:
                self._done = True
                reply = await asyncio.to_thread(client_fallback.ask, self._session.endpoint, self._unsent[0], wait)
                if reply is None:
                    raise
                _raise_for(reply)  # the fallback endpoint refuses a generate: `unavailable`
                raise
            except BaseException:
                self._done = True
                raise
            self._send()
        try:
            reply = await self._inbox.get_until(self._deadline)
        except TimeoutError:
            self.close()
            raise RequestTimeoutError("the call's timeout expired", request_id=self.id) from None
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(reply, ChunkReply):
            return _chunk(reply, self._logprobs)
        self._done = True
        _raise_for(reply)
        self.result = _result(reply, self._logprobs)
        raise StopAsyncIteration

    def close(self) -> None:
        if not self._done:
            self._done = True
            if self._unsent is None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._session.abandon, self.id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class AsyncClient(_ClientOptions):
    """An asyncio client for one daemon, bound to the event loop of its first call."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        server_public_key: str | bytes | None = None,
        public_key: str | bytes | None = None,
        secret_key: str | bytes | None = None,
    ) -> None:
        super().__init__(endpoint, timeout=timeout, connect_timeout=connect_timeout,
                         server_public_key=server_public_key, public_key=public_key, secret_key=secret_key)
        self._session: _Session | None = None

    def _session_now(self) -> _Session:
        if self._session is None:
            self._session = _Session(self.endpoint, **self._keys)
        return self._session

    async def _request(self, request: Any, timeout: float | None, connect_timeout: float) -> Reply:
        deadline = _deadline(timeout)
        session = self._session_now()
        replies = _Inbox(asyncio.get_running_loop())
        if not session.connected:
            wait = _connect_wait(connect_timeout, deadline)
            try:
                await session.reach(wait)
            except DaemonUnreachableError:
                reply = await asyncio.to_thread(client_fallback.ask, self.endpoint, request, wait)
                if reply is None:
                    raise
                _raise_for(reply)
                return reply
        session.submit(request, replies.put)
        try:
            reply = await replies.get_until(deadline)
        except TimeoutError:
            session.abandon(request.id)
            raise RequestTimeoutError("the call's timeout expired", request_id=request.id) from None
        except asyncio.CancelledError:
            session.abandon(request.id)
            raise
        _raise_for(reply)
        return reply

    async def generate(self, prompt: str | list[int], sampling: SamplingParams | dict[str, Any] | None = None, *,
                       request_id: str | None = None, timeout: float | None | EllipsisType = ...,
                       connect_timeout: float | None = None, **sampling_options: Any) -> GenerateResult:
        timeout = self._timeout(timeout)
        request = _build_generate(prompt, sampling, sampling_options, request_id=request_id, stream=False,
                                  timeout=timeout)
        return _result(await self._request(request, timeout, self._connect_timeout(connect_timeout)))

    def stream(self, prompt: str | list[int], sampling: SamplingParams | dict[str, Any] | None = None, *,
               request_id: str | None = None, timeout: float | None | EllipsisType = ...,
               connect_timeout: float | None = None, **sampling_options: Any) -> AsyncStream:
        """Start one completion (call inside the loop); `async for` over the returned stream."""
        timeout = self._timeout(timeout)
        request = _build_generate(prompt, sampling, sampling_options, request_id=request_id, stream=True,
                                  timeout=timeout)
        return AsyncStream(self, request, timeout, self._connect_timeout(connect_timeout))

    async def chat(self, messages: Messages, sampling: SamplingParams | dict[str, Any] | None = None, *,
                   request_id: str | None = None, timeout: float | None | EllipsisType = ...,
                   connect_timeout: float | None = None, **sampling_options: Any) -> GenerateResult:
        """The model's answer to a chat, whole (see `Client.chat`); `chat_stream` streams it."""
        timeout = self._timeout(timeout)
        request = _build_generate(None, sampling, sampling_options, request_id=request_id, stream=False,
                                  timeout=timeout, messages=messages)
        return _result(await self._request(request, timeout, self._connect_timeout(connect_timeout)))

    def chat_stream(self, messages: Messages, sampling: SamplingParams | dict[str, Any] | None = None, *,
                    request_id: str | None = None, timeout: float | None | EllipsisType = ...,
                    connect_timeout: float | None = None, **sampling_options: Any) -> AsyncStream:
        """Start the model's answer to a chat (call inside the loop); `async for` over it."""
        timeout = self._timeout(timeout)
        request = _build_generate(None, sampling, sampling_options, request_id=request_id, stream=True,
                                  timeout=timeout, messages=messages)
        return AsyncStream(self, request, timeout, self._connect_timeout(connect_timeout))

    async def cancel(self, request_id: str) -> None:
        self._session_now().cancel(request_id)

    async def status(self, *, timeout: float | None | EllipsisType = ...,
                     connect_timeout: float | None = None) -> dict[str, Any]:
        reply = await self._request(StatusRequest(id=new_request_id()), self._reply_timeout(timeout, connect_timeout),
                                    self._connect_timeout(connect_timeout))
        assert isinstance(reply, StatusReply)
        return reply.status

    async def health(self, *, timeout: float | None | EllipsisType = ...,
                     connect_timeout: float | None = None) -> Health:
        reply = await self._request(HealthRequest(id=new_request_id()), self._reply_timeout(timeout, connect_timeout),
                                    self._connect_timeout(connect_timeout))
        assert isinstance(reply, HealthReply)
        return Health(state=reply.state, ok=reply.ok)

    @property
    def connected(self) -> bool:
        return self._session is not None and self._session.connected

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
