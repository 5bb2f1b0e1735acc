"""The client side of the fallback endpoint (protocol/SPEC.md §1).

When the client endpoint does not answer (no socket file while the daemon starts or
restarts its workers, or a socket nobody serves yet), the supervisor beside it still
does: `ask` sends one request there and returns the reply, or None when no supervisor
answers either. One short-lived DEALER per question: this runs only on the failure
path, and must not disturb the session of the main endpoint.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

from hybridd.protocol import codec
from hybridd.protocol.codec import encode
from hybridd.protocol.endpoints import fallback_endpoint
from hybridd.protocol.errors import ProtocolError
from hybridd.protocol.limits import MAX_MESSAGE_BYTES
from hybridd.protocol.messages import Reply

# The supervisor answers between two turns of its loop (0.1 s), unless it is busy
# stopping a worker pair (about a second).
MAX_WAIT_S = 3.0


def ask(client_endpoint: str, request: Any, timeout: float | None = None) -> Reply | None:
    endpoint = fallback_endpoint(client_endpoint)
    if endpoint is None or not os.path.exists(endpoint.removeprefix("ipc://")):
        return None
    wait_s = MAX_WAIT_S if timeout is None else max(0.0, min(timeout, MAX_WAIT_S))
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(endpoint)
        sock.send(encode(request))
        if not sock.poll(int(wait_s * 1000)):
            return None
        try:
            return codec.REPLIES.decode(sock.recv())
        except ProtocolError:
            return None
    finally:
        context.destroy(linger=0)
