"""The gateway's routes: OpenAI's completions, chat completions and models, plus
`/health` and `/metrics`, served by Starlette over one `hybridd.AsyncClient`.

Every generation is one daemon request per prompt (its `n` choices share the prompt's
prefill in the engine); a response streams as server-sent events (`data: {...}`, then
`data: [DONE]`). The daemon's first reply is awaited before the HTTP status is chosen,
so that a refusal (overloaded, draining, invalid) is an HTTP error, not an event in a
200 stream. A client that disconnects has its daemon requests cancelled at once,
streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hybridd.client import AsyncClient, AsyncStream, Chunk, GenerateResult
from hybridd.errors import HybriddError
from hybridd.protocol.errors import ErrorCode
from hybridd.protocol.messages import HealthReply
from hybridd.gateway.api_keys import key_matches
from hybridd.gateway.errors import GatewayError, from_daemon, not_ready
from hybridd.gateway.openai_output import DONE_EVENT, Job, Reply, event
from hybridd.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, parse_body
from hybridd.log import get_logger
from hybridd.metrics import CONTENT_TYPE, render

log = get_logger("gateway")

HEALTH_TIMEOUT_S = 1.0
STATUS_TIMEOUT_S = 5.0
# The largest request body read; a prompt of the protocol's maximum size fits.
MAX_BODY_BYTES = 8 * 1024 * 1024
# Errors that say the daemon does not serve now (rather than that a request was bad).
UNSERVED_CODES = frozenset({ErrorCode.DRAINING, ErrorCode.UNAVAILABLE, ErrorCode.ENGINE_DEAD})


def model_id(model_path: str) -> str:
    """The name `/v1/models` lists: the model directory's name."""
    return Path(model_path).name or model_path


class EventStream(StreamingResponse):
    """Server-sent events that stop (and cancel their daemon requests) as soon as the
    client disconnects, even while no event is being written."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        with contextlib.suppress(OSError):
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    log.debug("client disconnected; cancelling its stream")
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                # The events are written from this task, so the first one (the daemon's
                # first reply is already here) goes out without waiting for a new task's turn.
                await self.stream_response(send)
                group.cancel_scope.cancel()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


class Gateway:
    """The routes' state: the daemon client, the served model's name, the API keys."""

    def __init__(self, client: AsyncClient, model_path: str, api_keys: frozenset[str] | None = None,
                 fallback: AsyncClient | None = None) -> None:
        self.client = client
        self.fallback = fallback
        self.model_path = model_path
        self.model = model_id(model_path)
        self.api_keys = api_keys
        self.created = int(time.time())
        self.serving = False  # the daemon answered the last request (or health check) as serving

    # ------------------------------------------------------------ checks

    def authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(401, "missing API key: send `Authorization: Bearer <key>`",
                               type="authentication_error", code="invalid_api_key")
        if not key_matches(token, self.api_keys):
            raise GatewayError(401, "incorrect API key", type="authentication_error", code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name not in (self.model, self.model_path):
            raise GatewayError(404, f"the model `{name}` does not exist; this server serves `{self.model}`",
                               type="not_found_error", param="model", code="model_not_found")

    async def health_state(self) -> tuple[bool, str]:
        health = await self._health()
        if health is not None and not health.ok and health.state == "ready":
            # The supervisor calls the workers ready, yet they did not answer: ask once
            # more (they may have only just bound), else they are unreachable from here.
            health = await self._health()
            if health is not None and not health.ok and health.state == "ready":
                return False, "unavailable"
        return (health.ok, health.state) if health is not None else (False, "unavailable")

    async def _health(self) -> HealthReply | None:
        try:
            return await self.client.health(timeout=HEALTH_TIMEOUT_S)
        except HybriddError:
            # The workers do not serve (starting, restarting): the supervisor's fallback
            # endpoint knows the lifecycle state.
            if self.fallback is None:
                return None
            try:
                return await self.fallback.health(timeout=HEALTH_TIMEOUT_S)
            except HybriddError:
                return None

    async def ensure_ready(self) -> None:
        """Refuse with 503 and the state unless the daemon serves. Asked only while the
        last word from the daemon was not a success, so that a serving daemon costs no
        extra round trip per request; a request that fails for the daemon's sake (draining,
        unavailable, engine dead) makes the next one ask again."""
        if self.serving:
            return
        ok, state = await self.health_state()
        if not ok:
            raise not_ready(state)
        self.serving = True

    def daemon_failed(self, error: HybriddError) -> None:
        if error.code in UNSERVED_CODES:
            self.serving = False

    async def body(self, request: Request, model: type) -> Any:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise GatewayError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            decoded = json.loads(raw)
        except ValueError as error:
            raise GatewayError(400, f"the request body is not valid JSON: {error}") from None
        return parse_body(model, decoded)

    # ------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        ok, state = await self.health_state()
        self.serving = ok
        if ok:
            return JSONResponse({"status": "ok", "state": state})
        return not_ready(state).response()

    async def metrics(self, request: Request) -> Response:
        try:
            status = await self.client.status(timeout=STATUS_TIMEOUT_S)
        except HybriddError as error:
            return Response(f"# the daemon did not answer: {error}\n", status_code=503, media_type="text/plain")
        return Response(render(status, self.model), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "hybridd",
             "root": self.model_path},
        ]})

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        body: CompletionRequest = await self.body(request, CompletionRequest)
        self.check_model(body.model)
        prompts = body.prompts()
        sampling = body.sampling()
        jobs = [Job(base=i * body.n, prompt=prompt, sampling=sampling,
                    echo=prompt if body.echo and isinstance(prompt, str) else "")
                for i, prompt in enumerate(prompts)]
        reply = Reply(id=f"cmpl-{uuid.uuid4().hex}", model=body.model, chat=False)
        return await self.generate(request, jobs, reply, stream=body.stream, include_usage=body.include_usage)

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        body: ChatCompletionRequest = await self.body(request, ChatCompletionRequest)
        self.check_model(body.model)
        jobs = [Job(base=0, prompt=None, messages=body.chat_messages(), sampling=body.sampling())]
        reply = Reply(id=f"chatcmpl-{uuid.uuid4().hex}", model=body.model, chat=True)
        return await self.generate(request, jobs, reply, stream=body.stream, include_usage=body.include_usage)

    # ------------------------------------------------------------ generation

    def _stream(self, job: Job) -> AsyncStream:
        if job.messages is not None:
            return self.client.chat_stream(job.messages, **job.sampling)
        return self.client.stream(job.prompt, **job.sampling)

    async def generate(self, request: Request, jobs: list[Job], reply: Reply, *, stream: bool,
                       include_usage: bool) -> Response:
        await self.ensure_ready()
        if not stream and not jobs[0].sampling.get("logprobs"):
            await _unless_disconnected(request, self._run_whole(jobs))
            return JSONResponse(reply.whole(jobs))
        # Logprobs travel in the daemon's chunks (a final reply holds only so many), so a
        # whole answer with logprobs is streamed from the daemon and gathered here.
        streams = [self._stream(job) for job in jobs]
        try:
            firsts = await _unless_disconnected(request, _first_replies(streams))
        except BaseException:
            for s in streams:
                s.close()
            raise
        if not stream:
            await _unless_disconnected(request, _drain(jobs, streams, firsts))
            return JSONResponse(reply.whole(jobs))
        return EventStream(_events(reply, jobs, streams, firsts, include_usage, self.daemon_failed))

    async def _run_whole(self, jobs: list[Job]) -> None:
        async def one(job: Job) -> GenerateResult:
            if job.messages is not None:
                return await self.client.chat(job.messages, **job.sampling)
            return await self.client.generate(job.prompt, **job.sampling)

        tasks = [asyncio.ensure_future(one(job)) for job in jobs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for job, result in zip(jobs, results, strict=True):
            job.result = result


async def _drain(jobs: list[Job], streams: list[AsyncStream], firsts: list[Any]) -> None:
    """Read whole streams (their results gather the chunks' logprobs)."""
    try:
        for job, stream, first in zip(jobs, streams, firsts, strict=True):
            if first is not _END:
                async for _ in stream:
                    pass
            job.result = stream.result
    finally:
        for stream in streams:
            stream.close()


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """Await `work` unless the HTTP client disconnects first (then it is cancelled).

    `work` runs in the calling task, and a watcher cancels that task on a disconnect:
    the outcome reaches the caller without the extra turns of the loop that a task of
    its own and a wait on both would cost (this is the first token's path)."""
    task = asyncio.current_task()
    assert task is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        await _until_disconnected(request)
        disconnected = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not disconnected:
            raise
        task.uncancel()
        raise ClientDisconnected() from None
    finally:
        watcher.cancel()


_END = object()


async def _first_reply(stream: AsyncStream) -> Chunk | object:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


async def _first_replies(streams: list[AsyncStream]) -> list[Chunk | object]:
    if len(streams) == 1:
        return [await _first_reply(streams[0])]
    outcomes = await asyncio.gather(*(_first_reply(s) for s in streams), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


async def _events(reply: Reply, jobs: list[Job], streams: list[AsyncStream], firsts: list[Any],
                  include_usage: bool, on_error: Callable[[HybriddError], None]) -> AsyncIterator[bytes]:
    try:
        for job in jobs:
            for sequence in range(job.sampling.get("n", 1)):
                if (start := reply.start(job.base + sequence)) is not None:
                    yield start
                if job.echo:
                    yield reply.delta(job.base + sequence, job.echo)
        if len(streams) == 1:
            source = _one(jobs[0], streams[0], firsts[0])
        else:
            source = _merged(jobs, streams, firsts)
        async for item in source(reply):
            yield item
        if include_usage:
            yield reply.usage_event(jobs)
        yield DONE_EVENT
    except HybriddError as error:
        log.warning("generation failed mid-stream", code=error.code.value, error=error.message)
        on_error(error)
        yield event(from_daemon(error).body())
    finally:
        for stream in streams:
            stream.close()


def _one(job: Job, stream: AsyncStream, first: Any) -> Callable[[Reply], AsyncIterator[bytes]]:
    def delta(reply: Reply, chunk: Chunk) -> bytes | None:
        if not chunk.text and chunk.logprobs is None:
            return None  # text held back (a partial character, a possible stop string)
        return reply.delta(job.base + chunk.index, chunk.text, reply.logprobs(job, chunk.index, chunk.logprobs))

    async def events(reply: Reply) -> AsyncIterator[bytes]:
        if first is not _END:
            if (item := delta(reply, first)) is not None:
                yield item
            async for chunk in stream:
                if (item := delta(reply, chunk)) is not None:
                    yield item
        job.result = stream.result
        assert job.result is not None
        for choice in job.result.choices:
            yield reply.finish(job.base + choice.index, choice.finish_reason)

    return events


def _merged(jobs: list[Job], streams: list[AsyncStream], firsts: list[Any]) -> Callable[[Reply], AsyncIterator[bytes]]:
    async def events(reply: Reply) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: Job, stream: AsyncStream, first: Any) -> None:
            try:
                async for item in _one(job, stream, first)(reply):
                    queue.put_nowait(item)
            except BaseException as error:  # noqa: BLE001  handed to the response
                queue.put_nowait(error)
                return
            queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(*args)) for args in zip(jobs, streams, firsts, strict=True)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    return events


def create_app(gateway: Gateway) -> Starlette:
    """The OpenAI-compatible application over `gateway`."""

    async def gateway_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, GatewayError)
        return error.response()

    async def daemon_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HybriddError)
        gateway.daemon_failed(error)
        return from_daemon(error).response()

    async def disconnected(request: Request, error: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it

    async def internal(request: Request, error: Exception) -> Response:
        log.error("internal error", path=request.url.path, error=repr(error))
        return GatewayError(500, f"internal error: {type(error).__name__}", type="internal_error").response()

    routes = [
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.metrics, methods=["GET"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={
        GatewayError: gateway_error, HybriddError: daemon_error, ClientDisconnected: disconnected, Exception: internal,
    })


def create_metrics_app(gateway: Gateway) -> Starlette:
    """`/metrics` alone, for the `metrics_endpoint` served without the API."""
    return Starlette(routes=[Route("/metrics", gateway.metrics, methods=["GET"]),
                             Route("/health", gateway.health, methods=["GET"])])
