"""The client sockets of the context generator, and the reading of their messages.

Two ROUTER sockets face the clients: the IPC one, always, and a TCP one when
configured, which only clients holding an allowed CURVE key may reach. Each has its
sessions (`ClientSessions`), tracked from before it binds: a client already waiting
connects the moment the socket exists.

A message is read here, and handed to the part that serves it. One from a connection
that chose its own routing id, or from a session that has ended, is refused unexecuted;
a large frame is screened by its byte counts before it is decoded (the intake refuses a
prompt that cannot fit); one that cannot be decoded is answered with the protocol error
that says why, and counted (`rejected`, SPEC §6). A generate goes to admission, a cancel
to the request endings, status and health to the status report, a ring to the replies.
"""

from __future__ import annotations

import time
from pathlib import Path

from hybridd.config import Config
from hybridd.ipc.channel import CLIENT_SOCKET_MODE, Channel, PeerProtocolError, bind_ipc_endpoint
from hybridd.protocol import codec
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import PROTOCOL_VERSION
from hybridd.protocol.messages import (
    AttachRingRequest, CancelRequest, ErrorReply, GenerateRequest, HealthReply, HealthRequest, Request, StatusReply,
    StatusRequest,
)
from hybridd.runtime.step_trace import mark
from hybridd.workers.admission import Admission
from hybridd.workers.client_requests import attribution, decode_request
from hybridd.workers.client_sessions import ClientSessions, client_chosen, socket_options
from hybridd.workers.intake import Intake
from hybridd.workers.replies import TCP_PREFIX, Replies
from hybridd.workers.request_endings import RequestEndings
from hybridd.workers.status_report import StatusReport

# Frames larger than this are screened by their byte counts before they are decoded
# (decoding a 4 MiB frame of non-ASCII text takes milliseconds of the loop's time).
SCREEN_FRAMES_OVER_BYTES = 64 * 1024
# Messages read from one socket in a turn of the serving loop, at most.
MESSAGES_PER_TURN = 256


class ClientSockets:
    """The client ROUTER sockets (`client`, and `tcp` when configured) and their messages."""

    def __init__(self, intake: Intake, admission: Admission, endings: RequestEndings, report: StatusReport,
                 replies: Replies) -> None:
        self.intake = intake
        self.admission = admission
        self.endings = endings
        self.report = report
        self.replies = replies
        self._auth = None
        self.client: Channel | None = None
        self.tcp: Channel | None = None

    def bind(self, config: Config) -> None:
        """Bind the client sockets, each one's sessions tracked from before it binds."""
        self.client = bind_ipc_endpoint(
            config.client_endpoint.removeprefix("ipc://"), decoder=codec.REQUESTS, name="client",
            options=socket_options("ipc"), mode=CLIENT_SOCKET_MODE,
            before_bind=lambda channel: self.replies.sessions.__setitem__(b"", ClientSessions(channel)),
        )
        if config.tcp_endpoint:
            self.tcp = self._bind_tcp(config)

    def _bind_tcp(self, config: Config) -> Channel:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        channel = Channel(zmq.ROUTER, decoder=codec.REQUESTS, name="client-tcp")
        _, secret = zmq.auth.load_certificate(config.curve_secret_key_file)
        self._auth = ThreadAuthenticator(zmq.Context.instance())
        self._auth.start()
        if config.curve_allow_any:  # validated: only when explicitly configured
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._auth.configure_curve(domain="*", location=str(Path(config.curve_client_keys_dir)))
        channel.use_curve_server(secret)
        for option, value in socket_options("tcp").items():
            channel.socket.setsockopt(option, value)
        self.replies.sessions[TCP_PREFIX] = ClientSessions(channel, TCP_PREFIX)
        channel.bind(config.tcp_endpoint)
        return channel

    def read(self, channel: Channel) -> None:
        """Read the messages waiting on a client socket (at most `MESSAGES_PER_TURN`)."""
        prefix = TCP_PREFIX if channel is self.tcp else b""
        sessions = self.replies.sessions[prefix]
        error = self.replies.error
        self.intake.new_turn()
        for _ in range(MESSAGES_PER_TURN):
            try:
                received = channel.recv_frame_from(timeout_ms=0)
            except PeerProtocolError as exc:
                if client_chosen(exc.identity) or sessions.admit(exc.identity, channel.last_peer_fd):
                    self.replies.send(prefix + exc.identity, ErrorReply.from_error(exc))
                continue
            if received is None:
                return
            mark("frame_received")
            routing_id, frame = received
            identity = prefix + routing_id
            now = time.monotonic()
            request = decode_request(frame) if len(frame) <= SCREEN_FRAMES_OVER_BYTES else None
            if client_chosen(routing_id):
                rid, version = attribution(request)
                error(identity, rid, ErrorCode.INVALID_REQUEST,
                      "ZMQ_ROUTING_ID: this connection chose its own routing id; the daemon names "
                      "sessions itself, so leave ZMQ_ROUTING_ID unset (the message was not executed)",
                      v=version)
                continue
            if not sessions.admit(routing_id, channel.last_peer_fd):
                # A message queued behind its connection's disconnect (the reply is
                # unroutable), or a new connection that set an ended session's id.
                error(identity, "", ErrorCode.INVALID_REQUEST,
                      "ZMQ_ROUTING_ID: this routing id belongs to a session that has ended; "
                      "leave ZMQ_ROUTING_ID unset (the message was not executed)", v=attribution(request)[1])
                continue
            if request is None:  # a large frame: its prompt may be refused from its byte counts
                screened = self.intake.screen(frame)
                if screened is not None:
                    screen_error, version = screened
                    screen_error.version = version
                    request = screen_error
                else:
                    request = decode_request(frame)
            self._on_request(channel, identity, request, now)

    def _on_request(self, channel: Channel, identity: bytes, request: Request | ProtocolError,
                    received: float) -> None:
        if isinstance(request, ProtocolError):
            channel.count_rejected(request)
            # The id only if the message had a valid one (SPEC: "" otherwise, never a prefix).
            self.replies.error(identity, request.request_id or "", request.code, request.message, request.field,
                               v=request.version or PROTOCOL_VERSION)
        elif isinstance(request, GenerateRequest):
            self.admission.generate(identity, request, received)
        elif isinstance(request, CancelRequest):
            self.endings.cancel(identity, request.target)
        elif isinstance(request, StatusRequest):
            self.replies.send(identity, StatusReply(id=request.id, status=self.report.status(), v=request.v))
        elif isinstance(request, HealthRequest):
            # ok only in the supervisor's `ready`: this process serves a moment before the
            # supervisor hears of it, and a client that waited for ok reads the state next.
            state = self.report.lifecycle_state()
            self.replies.send(identity, HealthReply(id=request.id, state=state, ok=state == "ready", v=request.v))
        elif isinstance(request, AttachRingRequest):
            self.replies.attach_ring(channel, identity, request, tcp=channel is self.tcp)

    def rejected(self) -> dict[str, int]:
        """Messages refused while being read (SPEC §6) since the worker started, by code."""
        counts: dict[str, int] = {}
        for channel in (self.client, self.tcp):
            if channel is not None:
                for code, n in channel.stats.rejected.items():
                    counts[code] = counts.get(code, 0) + n
        return {"total": sum(counts.values()), **counts}

    def close(self) -> None:
        for channel in (self.client, self.tcp):
            if channel is not None:
                channel.close(linger_ms=200)
        if self._auth is not None:
            self._auth.stop()  # its thread uses the ZeroMQ context, which the worker destroys on exit
