"""uvicorn's httptools protocol, writing a response's head together with its first body
bytes.

uvicorn writes the status line and headers as soon as the application sends
`http.response.start`, and the body with each `http.response.body`: two writes, two
segments (TCP_NODELAY), and a client that parses the head before it reads on to the
first event — time on every first token's way. Here the head waits for the body bytes
that follow it in the same turn of the event loop and leaves with them in one write;
a head not followed by body bytes in that turn is written at the end of it. The order
of the bytes on the connection is never changed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/1."


class _HeadWithBody:
    """The connection's transport, holding a response head until the next write."""

    __slots__ = ("_transport", "_loop", "_head")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data.startswith(_HEAD) and data.endswith(b"\r\n\r\n"):
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HeadWithBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over `_HeadWithBody` (give it as `uvicorn.Config(http=...)`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
