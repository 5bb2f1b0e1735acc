"""The supervisor's own client socket: what the daemon says while it cannot serve.

The context generator binds the client endpoint only once it serves, and loses it
when it dies. From the supervisor's start to its exit a second ROUTER socket answers
in its place, next to the client endpoint: `ipc://<client socket path>.supervisor`
(`ipc:///run/hybridd/hybridd.sock.supervisor` by default; protocol/SPEC.md §1). Same
framing and messages as the client endpoint:

- `health` → `health_reply` with the lifecycle state, `ok` false (a client that asks here
  did not reach the client endpoint, which alone serves: even when the supervisor
  still says `ready`, its context generator may have just died);
- `status` → `status_reply` with what the supervisor knows: state, phases and their
  progress, workers, restarts and the last failure, version, endpoints;
- `generate` → `error` `unavailable`, the message saying the state and why;
- `cancel` → nothing (nothing runs here).

The SDK and `hybridd status` fall back to it when the client endpoint does not answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hybridd.ipc.channel import CLIENT_SOCKET_MODE, MAX_IPC_PATH_BYTES, Channel, PeerProtocolError, bind_ipc_endpoint
from hybridd.log import get_logger
from hybridd.protocol.endpoints import fallback_endpoint
from hybridd.protocol import codec
from hybridd.protocol.errors import ErrorCode
from hybridd.protocol.messages import (
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    StatusReply,
    StatusRequest,
    Request,
)

log = get_logger("fallback_endpoint")

# Messages answered per wake-up, so that a flood cannot starve the supervisor's loop.
MAX_MESSAGES_PER_POLL = 64


class FallbackEndpoint:
    """Answers health, status and generate from the supervisor's state."""

    def __init__(self, client_endpoint: str, status: Callable[[], dict[str, Any]], explain: Callable[[], str]) -> None:
        self._status = status
        self._explain = explain
        self.channel: Channel | None = None
        endpoint = fallback_endpoint(client_endpoint)
        if endpoint is None:
            return
        path = endpoint.removeprefix("ipc://")
        if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            log.warning("no fallback endpoint: its path is too long for a Unix socket", path=path)
            return
        self.channel = bind_ipc_endpoint(path, decoder=codec.REQUESTS, name="fallback", mode=CLIENT_SOCKET_MODE)

    @property
    def socket(self):
        return None if self.channel is None else self.channel.socket

    def answer(self) -> None:
        """Answer what is waiting (never blocks)."""
        if self.channel is None:
            return
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                received = self.channel.recv_from(timeout_ms=0)
            except PeerProtocolError as error:
                self.channel.send_error_to(error.identity, error)
                continue
            if received is None:
                return
            identity, request = received
            self._answer(identity, request)

    def _answer(self, identity: bytes, request: Request) -> None:
        if isinstance(request, HealthRequest):
            state = self._status()["state"]
            self.channel.send_to(identity, HealthReply(id=request.id, state=state, ok=False, v=request.v))
        elif isinstance(request, StatusRequest):
            self.channel.send_to(identity, StatusReply(id=request.id, status=self._status(), v=request.v))
        elif isinstance(request, GenerateRequest):
            self.channel.send_to(identity, ErrorReply(id=request.id, code=ErrorCode.UNAVAILABLE,
                                                      message=self._explain(), v=request.v))
        # A cancel has no reply of its own, and nothing runs here to cancel.

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
