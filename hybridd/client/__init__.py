"""The client SDK: `Client` (threads) and `AsyncClient` (asyncio) for a running hybridd.

Both speak protocol/SPEC.md over one ZeroMQ DEALER socket (one session, `session.py`)
and are two faces of one core (`core.py`): the same options, requests, replies,
outcomes and reply ring; the sync face (`sync.py`) runs the session in a private loop
thread and its callers' threads wait for replies themselves, the async face (`aio.py`)
runs it in the caller's loop.

Every call first waits for the connection (the ZeroMQ handshake) for at most its
connect timeout (`CONNECT_TIMEOUT_S` unless the client or the call says otherwise), then
fails with `DaemonUnreachableError` saying what was found at the endpoint: no socket
file (at once), a socket nobody listens on, a listener that never completes the
handshake; a refused CURVE handshake is `HandshakeRefusedError`, as soon as the socket
monitor reports it. While the daemon's endpoint does not answer, health and status are
asked of the supervisor's fallback endpoint. Requests are sent only over an established
connection. Calls that answer at once (`health`, `status`) wait for their reply for at
most the same connect timeout unless given a `timeout`; a `generate` runs as long as it
runs, bounded by its `timeout` if any, while ZMTP heartbeats watch the daemon.
"""

from __future__ import annotations

from hybridd.client.aio import AsyncClient, AsyncStream
from hybridd.client.core import CONNECT_TIMEOUT_S, load_curve_keys
from hybridd.client.sync import Client, Stream
from hybridd.errors import (
    DaemonUnreachableError, DrainingError, EngineDeadError, HandshakeRefusedError, HybriddError, InternalError,
    InvalidRequestError, NotFoundError, OverloadedError, RequestCancelledError, RequestTimeoutError, UnavailableError,
)
from hybridd.protocol.messages import (
    ChatMessage, Choice, SamplingParams, StructuredOutput, TokenLogprob, ToolCall, ToolSpec, TopLogprob,
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
    "StructuredOutput",
    "TokenLogprob",
    "ToolCall",
    "ToolSpec",
    "TopLogprob",
    "UnavailableError",
    "load_curve_keys",
]
