"""The gateway's routes: OpenAI's completions, chat completions and models, plus
`/health` and `/metrics`, served by Starlette over one `hybridd.AsyncClient`.

Every generation is one or more daemon requests (one per prompt and choice); a
response streams as server-sent events (`data: {...}`, then `data: [DONE]`). The
daemon's first reply is awaited before the HTTP status is chosen, so that a refusal
(overloaded, draining, invalid) is an HTTP error, not an event in a 200 stream. A
client that disconnects has its daemon requests cancelled at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hybridd.client import AsyncClient, AsyncStream, Chunk, GenerateResult
from hybridd.client_errors import HybriddError
from hybridd.protocol.errors import ErrorCode
from hybridd.gateway.api_keys import key_matches
from hybridd.gateway.errors import GatewayError, from_daemon, not_ready
from hybridd.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, parse_body
from hybridd.log import get_logger
from hybridd.metrics import CONTENT_TYPE, render

log = get_logger("gateway")

HEALTH_TIMEOUT_S = 1.0
STATUS_TIMEOUT_S = 5.0
# The largest request body read; a prompt of the protocol's maximum size fits.
MAX_BODY_BYTES = 8 * 1024 * 1024
DONE_EVENT = b"data: [DONE]\n\n"
# Errors that say the daemon does not serve now (rather than that a request was bad).
UNSERVED_CODES = frozenset({ErrorCode.DRAINING, ErrorCode.UNAVAILABLE, ErrorCode.ENGINE_DEAD})


def model_id(model_path: str) -> str:
    """The name `/v1/models` lists: the model directory's name."""
    return Path(model_path).name or model_path


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass
class Job:
    """One daemon request: a choice of a prompt."""

    index: int
    prompt: str | list[int]
    sampling: dict[str, Any]
    echo: str = ""
    result: GenerateResult | None = None


@dataclass
class Reply:
    """How one endpoint writes its objects (completion or chat completion)."""

    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}

    def start(self, index: int) -> bytes | None:
        """The opening event of a choice: the chat role; nothing for completions."""
        if not self.chat:
            return None
        return _event(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]))

    def delta(self, index: int, text: str) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        return _event(self._chunk([choice]))

    def finish(self, index: int, reason: str) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        return _event(self._chunk([choice]))

    def usage_event(self, jobs: list[Job]) -> bytes:
        return _event(self._chunk([], usage(jobs)))

    def whole(self, jobs: list[Job]) -> dict[str, Any]:
        choices = []
        for job in jobs:
            assert job.result is not None
            text = job.echo + job.result.text
            if self.chat:
                choices.append({"index": job.index, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": job.result.finish_reason})
            else:
                choices.append({"index": job.index, "text": text, "logprobs": None,
                                "finish_reason": job.result.finish_reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage(jobs)}


def usage(jobs: list[Job]) -> dict[str, int]:
    """Prompt tokens count once per prompt (its choices share it), as OpenAI counts them."""
    prompts: dict[str, int] = {}
    completion = 0
    for job in jobs:
        assert job.result is not None
        prompts[repr(job.prompt)] = job.result.usage.prompt_tokens
        completion += job.result.usage.completion_tokens
    prompt = sum(prompts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class EventStream(StreamingResponse):
    """Server-sent events that stop (and cancel their daemon requests) as soon as the
    client disconnects, even while no event is being written."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        with contextlib.suppress(OSError):
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                log.debug("client disconnected; cancelling its stream")
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
        try:
            health = await self.client.health(timeout=HEALTH_TIMEOUT_S)
        except HybriddError:
            # The workers do not serve (starting, restarting): the supervisor's fallback
            # endpoint knows the lifecycle state.
            if self.fallback is None:
                return False, "unavailable"
            try:
                health = await self.fallback.health(timeout=HEALTH_TIMEOUT_S)
            except HybriddError:
                return False, "unavailable"
        return health.ok, health.state

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
        if body.logprobs is not None:
            raise GatewayError(400, "logprobs: not supported by this daemon", param="logprobs")
        prompts = body.prompts()
        sampling = body.sampling()
        jobs = [Job(index=i * body.n + j, prompt=prompt, sampling=_choice_sampling(sampling, j),
                    echo=prompt if body.echo and isinstance(prompt, str) else "")
                for i, prompt in enumerate(prompts) for j in range(body.n)]
        reply = Reply(id=f"cmpl-{uuid.uuid4().hex}", model=body.model, chat=False)
        return await self.generate(request, jobs, reply, stream=body.stream, include_usage=body.include_usage)

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        body: ChatCompletionRequest = await self.body(request, ChatCompletionRequest)
        self.check_model(body.model)
        raise GatewayError(400, "chat completions are not supported by this daemon", param="messages")

    # ------------------------------------------------------------ generation

    async def generate(self, request: Request, jobs: list[Job], reply: Reply, *, stream: bool,
                       include_usage: bool) -> Response:
        await self.ensure_ready()
        if not stream:
            await _unless_disconnected(request, self._run_whole(jobs))
            return JSONResponse(reply.whole(jobs))
        streams = [self.client.stream(job.prompt, **job.sampling) for job in jobs]
        try:
            firsts = await _unless_disconnected(request, _first_replies(streams))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return EventStream(_events(reply, jobs, streams, firsts, include_usage, self.daemon_failed))

    async def _run_whole(self, jobs: list[Job]) -> None:
        tasks = [asyncio.ensure_future(self.client.generate(job.prompt, **job.sampling)) for job in jobs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for job, result in zip(jobs, results, strict=True):
            job.result = result


def _choice_sampling(sampling: dict[str, Any], choice: int) -> dict[str, Any]:
    """The sampling of the `choice`-th of n choices: with a seed, choice j uses seed + j,
    so that the choices differ and the whole answer is reproducible."""
    if choice and sampling.get("seed") is not None:
        return sampling | {"seed": sampling["seed"] + choice}
    return sampling


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work` unless the HTTP client disconnects first (then it is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


_END = object()


async def _first_reply(stream: AsyncStream) -> Chunk | object:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


async def _first_replies(streams: list[AsyncStream]) -> list[Chunk | object]:
    outcomes = await asyncio.gather(*(_first_reply(s) for s in streams), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


async def _events(reply: Reply, jobs: list[Job], streams: list[AsyncStream], firsts: list[Any],
                  include_usage: bool, on_error: Callable[[HybriddError], None]) -> AsyncIterator[bytes]:
    try:
        for job in jobs:
            if (start := reply.start(job.index)) is not None:
                yield start
            if job.echo:
                yield reply.delta(job.index, job.echo)
        if len(streams) == 1:
            source = _one(jobs[0], streams[0], firsts[0])
        else:
            source = _merged(jobs, streams, firsts)
        async for event in source(reply):
            yield event
        if include_usage:
            yield reply.usage_event(jobs)
        yield DONE_EVENT
    except HybriddError as error:
        log.warning("generation failed mid-stream", code=error.code.value, error=error.message)
        on_error(error)
        yield _event(from_daemon(error).body())
    finally:
        for stream in streams:
            stream.close()


def _one(job: Job, stream: AsyncStream, first: Any) -> Callable[[Reply], AsyncIterator[bytes]]:
    async def events(reply: Reply) -> AsyncIterator[bytes]:
        if first is not _END:
            if first.text:
                yield reply.delta(job.index, first.text)
            async for chunk in stream:
                if chunk.text:
                    yield reply.delta(job.index, chunk.text)
        job.result = stream.result
        assert job.result is not None
        yield reply.finish(job.index, job.result.finish_reason)

    return events


def _merged(jobs: list[Job], streams: list[AsyncStream], firsts: list[Any]) -> Callable[[Reply], AsyncIterator[bytes]]:
    async def events(reply: Reply) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: Job, stream: AsyncStream, first: Any) -> None:
            try:
                async for event in _one(job, stream, first)(reply):
                    queue.put_nowait(event)
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
