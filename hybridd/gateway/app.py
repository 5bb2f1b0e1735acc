"""The gateway's routes: OpenAI's completions, chat completions and models, plus
`/health` and `/metrics`, over one `hybridd.AsyncClient`. The generation routes are
served in raw ASGI (`exchange.Exchange`: they are every first token's path), the
others by Starlette.

Every generation is one daemon request per prompt (its `n` choices share the prompt's
prefill in the engine); a response streams as server-sent events (`data: {...}`, then
`data: [DONE]`). The daemon's first reply is awaited before the HTTP status is chosen,
so that a refusal (overloaded, draining, invalid) is an HTTP error, not an event in a
200 stream. A client that disconnects has its daemon requests cancelled at once,
streaming or not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hybridd.client import AsyncClient, AsyncStream, Chunk, GenerateResult
from hybridd.errors import HybriddError
from hybridd.protocol.errors import ErrorCode
from hybridd.protocol.messages import HealthReply
from hybridd.gateway.api_keys import key_matches
from hybridd.gateway.cache_salt import request_salt
from hybridd.gateway.errors import GatewayError, from_daemon, not_ready
from hybridd.gateway.exchange import ClientDisconnected, Exchange
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


class Gateway:
    """The routes' state: the daemon client, the served model's name, the API keys and
    whether each key salts its requests' prefix cache (`salt_by_api_key`)."""

    def __init__(self, client: AsyncClient, model_path: str, api_keys: frozenset[str] | None = None,
                 fallback: AsyncClient | None = None, *, salt_by_api_key: bool = False) -> None:
        if salt_by_api_key and not api_keys:
            raise ValueError("salt_by_api_key needs API keys: without them there is nothing to salt by")
        self.client = client
        self.salt_by_api_key = salt_by_api_key
        self.fallback = fallback
        self.model_path = model_path
        self.model = model_id(model_path)
        self.api_keys = api_keys
        self.created = int(time.time())
        self.serving = False  # the daemon answered the last request (or health check) as serving

    # ------------------------------------------------------------ checks

    def authorize(self, authorization: str) -> str | None:
        """Check the `Authorization` header's value against the API keys (if any); the
        key that matched (None without keys)."""
        if not self.api_keys:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(401, "missing API key: send `Authorization: Bearer <key>`",
                               type="authentication_error", code="invalid_api_key")
        if not key_matches(token, self.api_keys):
            raise GatewayError(401, "incorrect API key", type="authentication_error", code="invalid_api_key")
        return token.strip()

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
        self.authorize(request.headers.get("authorization", ""))
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "hybridd",
             "root": self.model_path},
        ]})

    async def completions(self, exchange: Exchange, tenant: str | None) -> None:
        body: CompletionRequest = parse_body(CompletionRequest, await exchange.body(MAX_BODY_BYTES))
        self.check_model(body.model)
        prompts = body.prompts()
        sampling = body.sampling()
        salt = request_salt(tenant, body.cache_salt)
        jobs = [Job(base=i * body.n, prompt=prompt, sampling=sampling,
                    echo=prompt if body.echo and isinstance(prompt, str) else "", cache_salt=salt)
                for i, prompt in enumerate(prompts)]
        await self.generate(exchange, jobs, body.model, chat=False, stream=body.stream,
                            include_usage=body.include_usage)

    async def chat_completions(self, exchange: Exchange, tenant: str | None) -> None:
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await exchange.body(MAX_BODY_BYTES))
        self.check_model(body.model)
        jobs = [Job(base=0, prompt=None, messages=body.chat_messages(), sampling=body.sampling(),
                    cache_salt=request_salt(tenant, body.cache_salt))]
        await self.generate(exchange, jobs, body.model, chat=True, stream=body.stream,
                            include_usage=body.include_usage)

    async def serve_generation(self, route: Callable[[Exchange, str | None], Any], exchange: Exchange) -> None:
        """Run a generation route, with the API key that salts its prefix cache (None when
        the gateway does not salt by key); an error before the answer began is an HTTP
        error in OpenAI's format (after it began, a daemon error is the stream's last event)."""
        try:
            key = self.authorize(exchange.header(b"authorization"))
            await route(exchange, key if self.salt_by_api_key else None)
            return
        except ClientDisconnected:
            return  # nobody reads an answer
        except GatewayError as error:
            failure = error
        except HybriddError as error:
            self.daemon_failed(error)
            failure = from_daemon(error)
        except Exception as error:
            log.error("internal error", path=exchange.scope["path"], error=repr(error))
            if exchange.started:
                raise
            failure = GatewayError(500, f"internal error: {type(error).__name__}", type="internal_error")
        if exchange.started:
            raise RuntimeError("an HTTP error after the answer began") from failure
        await exchange.json(failure.status, failure.body(), failure.headers())

    # ------------------------------------------------------------ generation

    def _stream(self, job: Job) -> AsyncStream:
        if job.messages is not None:
            return self.client.chat_stream(job.messages, cache_salt=job.cache_salt, **job.sampling)
        return self.client.stream(job.prompt, cache_salt=job.cache_salt, **job.sampling)

    async def generate(self, exchange: Exchange, jobs: list[Job], model: str, *, chat: bool, stream: bool,
                       include_usage: bool) -> None:
        """Send the daemon requests first, then build the answer's writer while the daemon
        works: only what the request needs stands before the first token."""
        await self.ensure_ready()
        if not stream and not jobs[0].sampling.get("logprobs"):
            with exchange.watch():
                await self._run_whole(jobs)
            await exchange.json(200, _reply(model, chat).whole(jobs))
            return
        # Logprobs travel in the daemon's chunks (a final reply holds only so many), so a
        # whole answer with logprobs is streamed from the daemon and gathered here.
        streams = [self._stream(job) for job in jobs]
        reply = _reply(model, chat)
        try:
            # The first reply is awaited in this task, and the events are written from it
            # too: the first token goes out without waiting for another task's turn.
            with exchange.watch():
                firsts = await _first_replies(streams)
                if not stream:
                    await _drain(jobs, streams, firsts)
                else:
                    await exchange.events(_events(reply, jobs, streams, firsts, include_usage, self.daemon_failed),
                                          last=DONE_EVENT)
        finally:
            for s in streams:
                s.close()
        if not stream:
            await exchange.json(200, reply.whole(jobs))

    async def _run_whole(self, jobs: list[Job]) -> None:
        async def one(job: Job) -> GenerateResult:
            if job.messages is not None:
                return await self.client.chat(job.messages, cache_salt=job.cache_salt, **job.sampling)
            return await self.client.generate(job.prompt, cache_salt=job.cache_salt, **job.sampling)

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


def _reply(model: str, chat: bool) -> Reply:
    return Reply(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model=model, chat=chat)


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


class GatewayApp:
    """The OpenAI-compatible application over `gateway` (an ASGI callable): the generation
    routes served on their own fast path (`Exchange`), everything else by Starlette."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.generation = {"/v1/completions": gateway.completions, "/v1/chat/completions": gateway.chat_completions}

        async def gateway_error(request: Request, error: Exception) -> Response:
            assert isinstance(error, GatewayError)
            return error.response()

        async def internal(request: Request, error: Exception) -> Response:
            log.error("internal error", path=request.url.path, error=repr(error))
            return GatewayError(500, f"internal error: {type(error).__name__}", type="internal_error").response()

        self.rest = Starlette(routes=[
            Route("/health", gateway.health, methods=["GET"]),
            Route("/metrics", gateway.metrics, methods=["GET"]),
            Route("/v1/models", gateway.models, methods=["GET"]),
        ], exception_handlers={GatewayError: gateway_error, Exception: internal})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (route := self.generation.get(scope["path"])) is not None:
            exchange = Exchange(scope, receive, send)
            if scope["method"] != "POST":
                error = GatewayError(405, f"{scope['method']} is not allowed on {scope['path']}: use POST")
                await exchange.json(405, error.body(), ((b"allow", b"POST"),))
                return
            await self.gateway.serve_generation(route, exchange)
            return
        await self.rest(scope, receive, send)


def create_app(gateway: Gateway) -> GatewayApp:
    """The OpenAI-compatible application over `gateway`."""
    return GatewayApp(gateway)


def create_metrics_app(gateway: Gateway) -> Starlette:
    """`/metrics` alone, for the `metrics_endpoint` served without the API."""
    return Starlette(routes=[Route("/metrics", gateway.metrics, methods=["GET"]),
                             Route("/health", gateway.health, methods=["GET"])])
