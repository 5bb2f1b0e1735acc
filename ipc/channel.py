"""ZeroMQ channels that carry protocol messages, one msgpack map per frame.

`Channel` owns one zmq socket: it bounds inbound frames (MAXMSGSIZE, the codec's
limits), decodes them into the typed messages of its family (or plain maps when it
has none), never lingers on close, and turns bad input into `ProtocolError` instead
of crashing the caller's loop. `bind_ipc_endpoint` owns the life of an
`ipc://` socket file: runtime directory (0750), one live server per endpoint, stale
file takeover, removal on close.

A channel is used from one thread (zmq sockets are not thread-safe).
"""

from __future__ import annotations

import errno
import os
import stat
import weakref
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq

from hybridd.ipc import pid_lock
from hybridd.log import get_logger
from hybridd.protocol.codec import MessageDecoder, decode, encode
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import MAX_MESSAGE_BYTES
from hybridd.protocol.envelope import Fields
from hybridd.protocol.messages import ErrorReply, HealthRequest

log = get_logger("hybridd.ipc.channel")

M = TypeVar("M")

# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_IPC_PATH_BYTES = 107
RUNTIME_DIR_MODE = 0o750
# The client socket: its group may connect (which needs write permission on the
# file); who is in the group is decided by the runtime directory's group.
CLIENT_SOCKET_MODE = 0o660
DEFAULT_PROBE_TIMEOUT_MS = 250

_SOCKET_NAMES = {zmq.ROUTER: "ROUTER", zmq.DEALER: "DEALER", zmq.PAIR: "PAIR", zmq.PUSH: "PUSH", zmq.PULL: "PULL"}


class PeerProtocolError(ProtocolError):
    """A bad inbound frame on a ROUTER: `identity` says where to send the error reply."""

    def __init__(self, error: ProtocolError, identity: bytes) -> None:
        super().__init__(error.code, error.message, field=error.field, request_id=error.request_id,
                         version=error.version)
        self.identity = identity


class Delivery(Enum):
    """What became of one frame handed to a ROUTER peer."""

    SENT = "sent"  # taken by the transport
    FULL = "full"  # the peer's send queue is at its high-water mark: it is not reading
    GONE = "gone"  # no connection with that routing id


class EndpointInUseError(RuntimeError):
    """Another live process already serves this endpoint."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"endpoint ipc://{path} is already served by a live process ({reason}); "
                         f"stop it, or configure another runtime directory")
        self.path = path


@dataclass(slots=True)
class ChannelStats:
    received: int = 0
    sent: int = 0
    unroutable: int = 0  # ROUTER replies to peers that are gone or not reading
    rejected: Counter[str] = field(default_factory=Counter)  # inbound ProtocolErrors by code


@dataclass(slots=True)
class _BoundPath:
    """An ipc socket file this process created, and the lock that proves it is ours."""

    path: Path
    inode: int
    lock_fd: int


def _release(socket: zmq.Socket, bound: list[_BoundPath]) -> None:
    socket.close()  # honours the LINGER option: 0 unless close() was given a grace period
    for entry in bound:
        try:
            # Only our own file: a successor may already have replaced it.
            if os.stat(entry.path).st_ino == entry.inode:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass
        # The lock file itself stays: unlinking it would let two successors lock
        # different inodes of the same name.
        os.close(entry.lock_fd)
    bound.clear()


class Channel(Generic[M]):
    """One zmq socket speaking the hybridd protocol; `decoder` is the family of messages it receives."""

    def __init__(
        self,
        socket_type: int,
        *,
        decoder: MessageDecoder[M] | None = None,
        context: zmq.Context | None = None,
        name: str = "",
        send_timeout_ms: int | None = None,
    ) -> None:
        self._type = socket_type
        self._decode = decode if decoder is None else decoder.decode
        self._socket = (context or zmq.Context.instance()).socket(socket_type)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.LINGER, 0)
        if socket_type == zmq.ROUTER:
            # Unroutable replies fail loudly (EHOSTUNREACH) so that the caller learns
            # that a client is gone and can cancel its requests.
            self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if send_timeout_ms is not None:
            self._socket.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        self.name = name or _SOCKET_NAMES.get(socket_type, str(socket_type))
        self.stats = ChannelStats()
        self._bound: list[_BoundPath] = []
        # The file descriptor of the connection the last recv_from() message came in on.
        self.last_peer_fd = -1
        self._closer = weakref.finalize(self, _release, self._socket, self._bound)
        self._log = log.bind(channel=self.name)

    @property
    def socket(self) -> zmq.Socket:
        """The underlying socket, for a `zmq.Poller` in the caller's loop."""
        return self._socket

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    # ------------------------------------------------------------ setup

    def use_curve_server(self, secret_key: bytes) -> None:
        """Encrypt this (TCP) server socket with CURVE; call before bind."""
        self._socket.setsockopt(zmq.CURVE_SERVER, 1)
        self._socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)

    def bind(self, endpoint: str) -> str:
        """Bind to `endpoint`; returns the resolved endpoint (e.g. the port of tcp://*:0).

        For `ipc://` endpoints use `bind_ipc_endpoint`, which guards the socket file.
        """
        self._socket.bind(endpoint)
        return self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, endpoint: str) -> None:
        self._socket.connect(endpoint)

    def _adopt(self, entry: _BoundPath) -> None:
        self._bound.append(entry)

    # ------------------------------------------------------------ send

    def send(self, message: Fields | dict[str, Any]) -> None:
        """Send one message as one frame (DEALER, PAIR, PUSH)."""
        frame = encode(message)
        try:
            self._socket.send(frame)
        except zmq.Again:
            raise TimeoutError(f"send on channel {self.name} timed out") from None
        self.stats.sent += 1

    def send_to(self, identity: bytes, message: Fields | dict[str, Any]) -> bool:
        """Send one message to one ROUTER peer; False when the peer is gone or not reading."""
        return self.deliver(identity, encode(message)) is Delivery.SENT

    def deliver(self, identity: bytes, frame: bytes) -> Delivery:
        """Hand one encoded frame to one ROUTER peer without blocking."""
        try:
            self._socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.stats.unroutable += 1
            return Delivery.FULL
        except zmq.ZMQError as error:
            if error.errno != errno.EHOSTUNREACH:
                raise
            self.stats.unroutable += 1
            return Delivery.GONE
        self.stats.sent += 1
        return Delivery.SENT

    def send_error_to(self, identity: bytes, error: ProtocolError, request_id: str | None = None) -> bool:
        return self.send_to(identity, ErrorReply.from_error(error, request_id))

    # ------------------------------------------------------------ receive

    def _poll(self, timeout_ms: int | None) -> bool:
        return bool(self._socket.poll(timeout_ms, zmq.POLLIN))

    def count_rejected(self, error: ProtocolError) -> None:
        """Count an inbound message refused by the protocol (here or by the caller)."""
        self.stats.rejected[error.code.value] += 1
        self._log.debug("rejected inbound message", code=error.code.value, error=error.message, field=error.field)

    def recv(self, timeout_ms: int | None = None) -> M | None:
        """Next message (DEALER, PAIR, PULL); None on timeout.

        None waits forever, 0 polls. Raises ProtocolError for a bad frame; the
        channel stays usable.
        """
        if self._type == zmq.ROUTER:
            raise TypeError("a ROUTER channel receives with recv_from()")
        if not self._poll(timeout_ms):
            return None
        frames = self._socket.recv_multipart(zmq.NOBLOCK)
        self.stats.received += 1
        try:
            if len(frames) != 1:
                raise ProtocolError(ErrorCode.MALFORMED, f"expected one frame per message, got {len(frames)}")
            return self._decode(frames[0])
        except ProtocolError as error:
            self.count_rejected(error)
            raise

    def recv_from(self, timeout_ms: int | None = None) -> tuple[bytes, M] | None:
        """Next (peer identity, message) on a ROUTER; None on timeout.

        Raises PeerProtocolError (a ProtocolError carrying the identity) for a bad
        frame, so that the caller can route an error reply. `last_peer_fd` then names
        the connection it came in on.
        """
        received = self.recv_frame_from(timeout_ms)
        if received is None:
            return None
        identity, frame = received
        try:
            return identity, self._decode(frame)
        except ProtocolError as error:
            self.count_rejected(error)
            raise PeerProtocolError(error, identity) from None

    def recv_frame_from(self, timeout_ms: int | None = None) -> tuple[bytes, memoryview] | None:
        """Next (peer identity, frame) on a ROUTER, the frame not decoded (the caller
        may screen it first); None on timeout. Raises PeerProtocolError for a message
        that is not exactly one frame."""
        if self._type != zmq.ROUTER:
            raise TypeError("recv_from() is for ROUTER channels")
        if not self._poll(timeout_ms):
            return None
        frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
        identity = frames[0].bytes
        self.last_peer_fd = frames[-1].get(zmq.SRCFD)
        self.stats.received += 1
        if len(frames) != 2:
            error = ProtocolError(
                ErrorCode.MALFORMED,
                f"expected exactly one frame per message, got {len(frames) - 1} "
                "(DEALER clients send no empty delimiter frame)",
            )
            self.count_rejected(error)
            raise PeerProtocolError(error, identity)
        return identity, frames[1].buffer

    # ------------------------------------------------------------ lifetime

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket and remove the socket files it bound; idempotent.

        `linger_ms` > 0 gives messages still queued (a last `Shutdown`) that long to
        reach the peer; by default they are dropped so that close never blocks.
        """
        if self._closer.alive and linger_ms:
            self._socket.setsockopt(zmq.LINGER, linger_ms)
        self._closer()

    def __enter__(self) -> Channel[M]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------- ipc endpoints


def ensure_runtime_dir(directory: Path) -> None:
    """Create the runtime directory with mode 0750; leave an existing one's mode alone."""
    if not directory.exists():
        directory.mkdir(parents=True, mode=RUNTIME_DIR_MODE, exist_ok=True)
        os.chmod(directory, RUNTIME_DIR_MODE)  # mkdir's mode is filtered by the umask
        return
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o007:
        log.warning("runtime directory is accessible to other users", path=str(directory), mode=oct(mode))


def _answers_health(path: Path, context: zmq.Context, timeout_ms: int) -> bool:
    """True when something at `path` answers a health request within `timeout_ms`."""
    probe = context.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    probe.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    try:
        probe.connect(f"ipc://{path}")
        probe.send(encode(HealthRequest(id=f"bind-probe-{os.getpid()}")))
        return bool(probe.poll(timeout_ms, zmq.POLLIN))
    finally:
        probe.close(linger=0)


def bind_ipc_endpoint(
    path: str | os.PathLike[str],
    *,
    socket_type: int = zmq.ROUTER,
    decoder: MessageDecoder[M] | None = None,
    context: zmq.Context | None = None,
    name: str = "",
    probe_timeout_ms: int = DEFAULT_PROBE_TIMEOUT_MS,
    options: dict[int, int] | None = None,
    mode: int | None = None,
    before_bind: Callable[[Channel[M]], None] | None = None,
) -> Channel[M]:
    """Bind a new channel at `ipc://<path>`, refusing when a live process serves it.

    Liveness is decided twice: a lock file next to the socket (held for the channel's
    life, so a hybridd server that is merely slow is never mistaken for a dead one)
    and, for ROUTER endpoints, a `health` probe (catches a server that does not lock).
    A socket file nobody answers on is stale: it is removed and the path rebound.
    `options` are socket options set before the bind; `mode`, when given, is the
    socket file's mode whatever the umask (connecting needs write permission).
    `before_bind` is called with the channel just before it binds: what must see every
    connection (a socket monitor) is attached there.
    """
    path = Path(path).absolute()
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(
            f"ipc socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow at most "
            f"{MAX_IPC_PATH_BYTES}: choose a shorter runtime directory"
        )
    context = context or zmq.Context.instance()
    ensure_runtime_dir(path.parent)
    lock_path = path.with_name(path.name + ".lock")
    try:
        lock_fd = pid_lock.acquire(lock_path)
    except pid_lock.LockHeldError as held:
        raise EndpointInUseError(path, f"lock {lock_path} is held by pid {held.holder}") from None
    try:
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise FileExistsError(f"{path} exists and is not a socket; refusing to remove it")
            if socket_type == zmq.ROUTER and _answers_health(path, context, probe_timeout_ms):
                raise EndpointInUseError(path, "it answered a health probe")
            log.warning("removing stale socket file", path=str(path))
            path.unlink(missing_ok=True)
        channel = Channel(socket_type, decoder=decoder, context=context, name=name or f"{path.name}")
        for option, value in (options or {}).items():
            channel.socket.setsockopt(option, value)
        try:
            if before_bind is not None:
                before_bind(channel)
            channel.bind(f"ipc://{path}")
            if mode is not None:
                os.chmod(path, mode)
        except BaseException:
            channel.close()
            raise
    except BaseException:
        os.close(lock_fd)
        raise
    channel._adopt(_BoundPath(path=path, inode=path.stat().st_ino, lock_fd=lock_fd))
    log.info("bound ipc endpoint", path=str(path), socket=_SOCKET_NAMES.get(socket_type, socket_type))
    return channel
