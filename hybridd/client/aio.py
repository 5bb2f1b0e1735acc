"""The asyncio face of the client core: `AsyncClient` and its `AsyncStream`.

The session runs in the caller's event loop (that of the client's first call). With a
reply ring, a thread of the session sleeps on the ring's bell and has the loop take
each reply from the ring as soon as the daemon rings (hybridd/client/session.py), so
that a reply reaches the awaiting task without the socket's I/O threads in between.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

from hybridd.client.core import (
    Call, ClientCore, Messages, Sampling, Timeout, Tools, generated, health_of, reach, remaining,
    status_of,
)
from hybridd.client.session import Session
from hybridd.errors import HybriddError
from hybridd.protocol.messages import Reply
from hybridd.results import Chunk, GenerateResult, Health


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

    async def _get(self) -> Reply | HybriddError:
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
            return await self._get()
        return await asyncio.wait_for(self._get(), remaining(deadline))


class AsyncStream:
    """Async counterpart of `Stream`: `async for chunk in stream`; `aclose()` or GC cancels."""

    def __init__(self, client: AsyncClient, call: Call) -> None:
        self.id = call.id
        self._call = call
        self._session = client._session_now()
        self._loop = asyncio.get_running_loop()
        self._inbox = _Inbox(self._loop)
        # Sent at once over an established connection, else on the first iteration,
        # once the connection is made within the connect timeout.
        if self._session.connected:
            self._send()

    def _send(self) -> None:
        self._session.submit(self._call.request, self._inbox.put)
        self._call.sent = True

    @property
    def result(self) -> GenerateResult | None:
        return self._call.result

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        call = self._call
        if call.done:
            raise StopAsyncIteration
        if not call.sent:
            await reach(self._session, call)
            if call.done:  # answered by the fallback endpoint
                raise StopAsyncIteration
            self._send()
        try:
            reply = await self._inbox.get_until(call.deadline)
        except TimeoutError:
            self.close()
            raise call.expired() from None
        except asyncio.CancelledError:
            self.close()
            raise
        chunk = call.take(reply)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    def close(self) -> None:
        if self._call.stop() and not self._loop.is_closed():
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


class AsyncClient(ClientCore):
    """An asyncio client for one daemon, bound to the event loop of its first call.

    Like `Client`, it asks a daemon on this host for a reply ring by default
    (`reply_ring`, see `Client`); its waiting tasks are woken through the loop.
    """

    _session: Session | None = None  # made in the loop of the first call

    def _session_now(self) -> Session:
        if self._session is None:
            self._session = self._new_session(wake_loop=True)
        return self._session

    async def _complete(self, call: Call) -> Call:
        """Run a call with one answer to its end."""
        async for _ in AsyncStream(self, call):
            pass
        return call

    async def generate(self, prompt: str | list[int], sampling: Sampling = None, *, request_id: str | None = None,
                       timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
                       speculative: bool | None = None, **sampling_options: Any) -> GenerateResult:
        return generated(await self._complete(self._generate_call(
            prompt, None, sampling, sampling_options, request_id, timeout, connect_timeout, stream=False,
            cache_salt=cache_salt, speculative=speculative)))

    def stream(self, prompt: str | list[int], sampling: Sampling = None, *, request_id: str | None = None,
               timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
               speculative: bool | None = None, **sampling_options: Any) -> AsyncStream:
        """Start one completion (call inside the loop); `async for` over the returned stream."""
        return AsyncStream(self, self._generate_call(prompt, None, sampling, sampling_options, request_id, timeout,
                                                     connect_timeout, stream=True, cache_salt=cache_salt,
                                                     speculative=speculative))

    async def chat(self, messages: Messages, sampling: Sampling = None, *, request_id: str | None = None,
                   timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
                   tools: Tools | None = None,
                   speculative: bool | None = None, **sampling_options: Any) -> GenerateResult:
        """The model's answer to a chat, whole (see `Client.chat`); `chat_stream` streams it."""
        return generated(await self._complete(self._generate_call(
            None, messages, sampling, sampling_options, request_id, timeout, connect_timeout, stream=False,
            cache_salt=cache_salt, tools=tools, speculative=speculative)))

    def chat_stream(self, messages: Messages, sampling: Sampling = None, *, request_id: str | None = None,
                    timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
                    tools: Tools | None = None,
                   speculative: bool | None = None, **sampling_options: Any) -> AsyncStream:
        """Start the model's answer to a chat (call inside the loop); `async for` over it."""
        return AsyncStream(self, self._generate_call(None, messages, sampling, sampling_options, request_id, timeout,
                                                     connect_timeout, stream=True, cache_salt=cache_salt,
                                                     tools=tools, speculative=speculative))

    async def cancel(self, request_id: str) -> None:
        self._session_now().cancel(request_id)

    async def status(self, *, timeout: Timeout = ..., connect_timeout: float | None = None) -> dict[str, Any]:
        return status_of(await self._complete(self._status_call(timeout, connect_timeout)))

    async def health(self, *, timeout: Timeout = ..., connect_timeout: float | None = None) -> Health:
        return health_of(await self._complete(self._health_call(timeout, connect_timeout)))

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
