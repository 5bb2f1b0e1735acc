"""One HTTP exchange of the generation routes, spoken in raw ASGI: the request's
headers and body, a JSON answer or a stream of server-sent events, and the client's
disconnect cancelling the work; what the access log reports of it (its id, status,
daemon requests and error code).

The generation routes (`/v1/completions`, `/v1/chat/completions`) are every first
token's path, so they skip the framework's routing, middleware, request and response
objects: the body is read from `receive`, the answer written with `send` (uvicorn
frames and writes each message as it comes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from hybridd.gateway.errors import GatewayError

JSON_HEADERS = ((b"content-type", b"application/json"),)
EVENT_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete."""


class Exchange:
    """The request's side (`scope`, `receive`) and the response's (`send`) of one exchange."""

    __slots__ = ("scope", "receive", "send", "started", "finished", "request_id", "headers", "status", "jobs",
                 "error")

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.started = False  # the status line has been sent: an error can no longer be an HTTP error
        self.finished = False  # the last byte of the answer has been sent
        self.request_id = ""
        self.headers: list[tuple[bytes, bytes]] = []  # every response of the exchange carries these
        self.status = 0
        self.jobs: list[Any] = []  # its daemon requests (openai_output.Job), for the access log
        self.error = ""  # the error code it was answered with

    async def send_with_headers(self, message: dict[str, Any]) -> None:
        """`send` for another ASGI app answering this exchange: its head gets the exchange's headers."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message["headers"] = [*message.get("headers", ()), *self.headers]
        await self.send(message)

    def header(self, name: bytes) -> str:
        for key, value in self.scope["headers"]:
            if key == name:
                return value.decode("latin-1")
        return ""

    async def body(self, limit: int) -> bytes:
        message = await self.receive()
        if not message.get("more_body") and message["type"] == "http.request":
            body = message.get("body", b"")
        else:
            parts = bytearray()
            while True:
                if message["type"] == "http.disconnect":
                    raise ClientDisconnected()
                parts += message.get("body", b"")
                if len(parts) > limit:
                    break
                if not message.get("more_body"):
                    break
                message = await self.receive()
            body = bytes(parts)
        if len(body) > limit:
            raise GatewayError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        return body

    async def json(self, status: int, payload: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        content = msgspec.json.encode(payload)
        self.started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [*JSON_HEADERS, (b"content-length", b"%d" % len(content)), *headers,
                                     *self.headers]})
        self.finished = True
        await self.send({"type": "http.response.body", "body": content})

    async def events(self, events: AsyncGenerator[bytes, None], last: bytes) -> None:
        """A 200 of server-sent events; `last` (compared by identity) ends the response
        in the same write."""
        self.started = True
        self.status = 200
        send = self.send
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [*EVENT_HEADERS, *self.headers]})
            async for event in events:
                if event is last:
                    self.finished = True
                    await send({"type": "http.response.body", "body": event})
                    return
                await send({"type": "http.response.body", "body": event, "more_body": True})
            self.finished = True
            await send({"type": "http.response.body", "body": b""})
        finally:
            await events.aclose()

    def watch(self) -> DisconnectWatch:
        return DisconnectWatch(self)


class DisconnectWatch:
    """`with exchange.watch():` cancels the block (in the calling task, which keeps the
    outcome's way short: no task of its own for the work) as soon as the client
    disconnects, and raises ClientDisconnected out of it."""

    __slots__ = ("exchange", "task", "watcher", "disconnected")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.disconnected = False

    async def _watch(self) -> None:
        receive = self.exchange.receive
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.exchange.finished:  # after the last byte, uvicorn reports the end as a disconnect
            self.disconnected = True
            self.task.cancel()

    def __enter__(self) -> DisconnectWatch:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.watcher = asyncio.ensure_future(self._watch())
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> bool:
        self.watcher.cancel()
        if self.disconnected and kind is asyncio.CancelledError:
            self.task.uncancel()
            raise ClientDisconnected() from None
        return False
