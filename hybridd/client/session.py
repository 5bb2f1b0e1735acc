"""The session: one ZeroMQ DEALER connection to the daemon and the requests in flight
on it, in one asyncio event loop (the async face's caller's, or the sync face's own
thread's).

Replies are routed to per-request sinks by request id, read in the loop's callback for
the socket's file descriptor, so that a reply wakes its waiter with no task in between.
Every in-flight request fails with `EngineDeadError` as soon as a socket monitor reports
that the daemon's connection dropped (ZMTP heartbeats catch a peer that vanished without
closing). The DEALER reconnects by itself, so calls made after the daemon is back
succeed.

With a reply ring (ipc/reply_ring.py, hybridd/client_ring.py), each new connection's
first message asks the daemon to attach a fresh ring; its replies then come from
whichever of the ring and the socket brings them first. A thread waiting for a reply
(the sync face) polls the ring and sleeps on its bell itself (`poll_ring`,
`ring_reader`); an event loop cannot sleep on the bell's futex, so for a session whose
waiters are the loop's tasks (`wake_loop`) a thread sleeps on it for the loop and has
the loop take the ring's replies as soon as the daemon rings.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from hybridd.client_ring import RING_SLEEP_S, RingDelivery
from hybridd.errors import (
    DaemonUnreachableError,
    EngineDeadError,
    HandshakeRefusedError,
    HybriddError,
    InvalidRequestError,
    error_for_code,
)
from hybridd.ipc.reply_ring import HEADER_BYTES as RING_HEADER_BYTES
from hybridd.ipc.reply_ring import RingBroken, RingReader
from hybridd.log import get_logger
from hybridd.protocol import codec
from hybridd.protocol.codec import encode
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import MAX_MESSAGE_BYTES
from hybridd.protocol.messages import (
    AttachRingRequest,
    CancelRequest,
    ChunkReply,
    ErrorReply,
    Reply,
    RingAttachedReply,
)

log = get_logger("client")

# ZMTP heartbeats: a daemon host that vanishes without closing the connection (TCP)
# is declared disconnected after HEARTBEAT_TIMEOUT_MS.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000

Sink = Callable[[Reply | HybriddError], None]


def new_request_id() -> str:
    return os.urandom(16).hex()  # 128 random bits, as a uuid4's hex, for less work per request


def seconds(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _release(context: zmq.Context, *sockets: zmq.Socket) -> None:
    """Close a session's sockets and end its context (see `Session.__init__`)."""
    for sock in sockets:
        if not sock.closed:
            sock.close(linger=0)
    context.term()


class Session:
    """One DEALER connection and the requests in flight on it; used from its loop,
    except `poll_ring`, which any thread may call (the lock guards what it touches).
    `wake_loop`: the replies' waiters are tasks of this loop, which a thread sleeping on
    the reply ring wakes (else threads that wait on the ring themselves)."""

    def __init__(self, endpoint: str, *, server_public_key: bytes | None, public_key: bytes | None,
                 secret_key: bytes | None, reply_ring: int | None = None, ring_optional: bool = False,
                 wake_loop: bool = False) -> None:
        self._curve = endpoint.startswith("tcp://")
        if self._curve and not (server_public_key and public_key and secret_key):
            # Before any socket exists: a session that fails half-built must leave none
            # open (a context collected with an unclosed socket blocks in its term).
            raise ValueError("a tcp:// endpoint is served only with CURVE: give server_public_key, "
                             "public_key and secret_key (see `hybridd keygen`)")
        self.endpoint = endpoint
        self._ring_bytes = reply_ring  # attach a ring of this many bytes on each connection
        # A ring asked for by default, not by the caller: going without one is no warning.
        self._ring_log = log.debug if ring_optional else log.warning
        self._ring: RingDelivery | None = None
        self._wake_loop = wake_loop
        self._ring_taking = False  # the loop is asked to take the ring's replies (`_take_ring`)
        self._lock = threading.RLock()  # the pending sinks and the ring, between the loop and pollers
        self._context = zmq.asyncio.Context()
        # Every socket of it (the monitor's too) drops unsent frames at close.
        self._context.setsockopt(zmq.LINGER, 0)
        # A plain socket read from the loop's reader callback (`_readable`); its monitor is
        # an asyncio socket of the same context.
        self._socket = zmq.Socket(self._context, zmq.DEALER)
        try:
            for option, value in (
                (zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES),
                (zmq.LINGER, 0),
                (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
                (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
                (zmq.RECONNECT_IVL, RECONNECT_IVL_MS),
                (zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS),
            ):
                self._socket.setsockopt(option, value)
            if self._curve:
                self._socket.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)
                self._socket.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
                self._socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
            self._monitor = self._socket.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            )
        except BaseException:
            _release(self._context, self._socket)
            raise
        # The sockets are closed and the context ended by `close()`, or by this finalizer
        # when the session is dropped unclosed (its client never closed, or a failure later
        # in this constructor): a context collected with a socket still open would block in
        # its term for ever, in whichever thread the collector happened to run.
        self._release = weakref.finalize(self, _release, self._context, self._monitor, self._socket)
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
                if self._ring is not None and not self._wake_loop:
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
        if not isinstance(reply, ChunkReply):  # the request's last reply
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
                if self._wake_loop:
                    threading.Thread(target=self._sleep_on_ring, args=(reader,), name="hybridd-client-ring",
                                     daemon=True).start()
                return
            reader.close()
            reason = reply.message if isinstance(reply, ErrorReply | HybriddError) else type(reply).__name__
            self._ring_log("the daemon did not attach the reply ring; replies come by the socket", reason=reason)

        with self._lock:
            self.pending[request.id] = answered
        self._send(encode(request))

    def _sleep_on_ring(self, reader: RingReader) -> None:
        """The loop's sleeper on the ring (a thread of its own): whenever the daemon has
        written records, ask the loop to take them, once until it has."""
        try:
            with reader.sleeping():
                while not reader.closing:
                    bell = reader.bell()  # before looking: a record written after it changes it
                    if reader.has_records() and not self._ring_taking:
                        self._ring_taking = True
                        with contextlib.suppress(RuntimeError):  # the loop has closed
                            self._loop.call_soon_threadsafe(self._take_ring)
                    reader.sleep(bell, RING_SLEEP_S)
        except RingBroken:
            pass  # closed before this thread came to sleep on it

    def _take_ring(self) -> None:
        self._ring_taking = False  # first: a record written from here on asks again
        self.poll_ring()

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
                return (f"no daemon at {self.endpoint} within {seconds(timeout)} s: nothing listens on {socket_file} "
                        f"(a stale socket left by a daemon that died?)")
            return (f"no daemon at {self.endpoint} within {seconds(timeout)} s: nothing accepts connections "
                    f"at {self.endpoint}")
        return f"no answer from {self.endpoint} within {seconds(timeout)} s (connected, but no ZeroMQ handshake)"

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
        self._release()

