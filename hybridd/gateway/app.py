"""The gateway's routes: OpenAI's completions, chat completions and models, plus
`/health` and `/metrics`, over one `hybridd.AsyncClient`. The generation routes are
served in raw ASGI (`exchange.Exchange`: they are every first token's path), the
others by Starlette.

Every request carries an id: its `X-Request-Id` header when it gives a usable one, else
a fresh one; the response returns it in the same header, its daemon requests carry it
on the wire (so the daemon's log lines for them name it), and the gateway writes one
access-log line per request with it (status, tokens, time to first token, duration,
finish reasons). Body fields the gateway does not use are ignored and named in the
`X-Hybridd-Ignored-Fields` header (`strict_openai` refuses them instead).

Every generation is one daemon request per prompt (its `n` choices share the prompt's
prefill in the engine); a response streams as server-sent events (`data: {...}`, then
`data: [DONE]`). The daemon's first reply is awaited before the HTTP status is chosen,
so that a refusal (overloaded, draining, invalid) is an HTTP error, not an event in a
200 stream. A client that disconnects has its daemon requests cancelled at once,
streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hybridd.client import AsyncClient, AsyncStream, Chunk, GenerateResult
from hybridd.errors import HybriddError
from hybridd.protocol.errors import ErrorCode
from hybridd.protocol.messages import HealthReply
from hybridd.gateway.api_keys import key_matches
from hybridd.gateway.cache_salt import request_salt
from hybridd.gateway.errors import GatewayError, from_daemon, from_http, not_ready
from hybridd.gateway.exchange import ClientDisconnected, Exchange
from hybridd.gateway.openai_output import DONE_EVENT, Job, Reply, event, tool_calls_reason
from hybridd.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, parse_body
from hybridd.gateway.tokenize import Tokenize
from hybridd.gateway.tool_call_reader import CallReader
from hybridd.gateway.tool_calls import ToolPlan, plan, template_format
from hybridd.log import get_logger
from hybridd.metrics import CONTENT_TYPE, render

log = get_logger("gateway")

HEALTH_TIMEOUT_S = 1.0
STATUS_TIMEOUT_S = 5.0
# The largest request body read; a prompt of the protocol's maximum size fits.
MAX_BODY_BYTES = 8 * 1024 * 1024
# Errors that say the daemon does not serve now (rather than that a request was bad).
UNSERVED_CODES = frozenset({ErrorCode.DRAINING, ErrorCode.UNAVAILABLE, ErrorCode.ENGINE_DEAD})
# A client's X-Request-Id is taken when it is this (room is left on the wire for the
# per-prompt suffix); anything else gets a fresh id.
USABLE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,100}")
IGNORED_FIELDS_HEADER = b"x-hybridd-ignored-fields"
PROBES = frozenset({"/health", "/metrics"})  # polled: their access lines are debug's


def request_id_of(given: str) -> str:
    """The request's id: the client's X-Request-Id when usable, else a fresh one."""
    return given if USABLE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def model_id(model_path: str) -> str:
    """The name `/v1/models` lists: the model directory's name."""
    return Path(model_path).name or model_path


class Gateway:
    """The routes' state: the daemon client, the served model's name, the API keys and
    whether each key salts its requests' prefix cache (`salt_by_api_key`)."""

    def __init__(self, client: AsyncClient, model_path: str, api_keys: frozenset[str] | None = None,
                 fallback: AsyncClient | None = None, *, salt_by_api_key: bool = False,
                 served_names: list[str] | tuple[str, ...] = (), strict_openai: bool = False,
                 tool_call_parser: str = "auto") -> None:
        if salt_by_api_key and not api_keys:
            raise ValueError("salt_by_api_key needs API keys: without them there is nothing to salt by")
        self.client = client
        self.salt_by_api_key = salt_by_api_key
        self.fallback = fallback
        self.model_path = model_path
        self.served_names = list(dict.fromkeys(served_names)) or [model_id(model_path)]
        self.model = self.served_names[0]
        self.strict_openai = strict_openai
        # How tool calls are read out of the model's text: its chat template's family unless set.
        self.tool_format = template_format(model_path) if tool_call_parser == "auto" else tool_call_parser
        self.tokenize_routes = Tokenize(model_path, self)
        self.api_keys = api_keys
        self.created = int(time.time())
        self.serving = False  # the daemon answered the last request (or health check) as serving
        self.quantization: str | None = None  # the weights' ("none", "fp8"), once the daemon said

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
        if name not in self.served_names and name != self.model_path:
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

    def model_card(self, name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "hybridd",
                "root": self.model_path}
        return card if self.quantization is None else card | {"quantization": self.quantization}

    async def _learn_quantization(self) -> None:
        """The weights' quantization, from the daemon's status the first time it answers (a
        card without it until then)."""
        if self.quantization is not None:
            return
        try:
            status = await self.client.status(timeout=STATUS_TIMEOUT_S)
        except HybriddError:
            return
        if status.get("state") == "ready":
            self.quantization = (status.get("quantization") or {}).get("method", "none")

    async def models(self, request: Request) -> Response:
        self.authorize(request.headers.get("authorization", ""))
        await self._learn_quantization()
        return JSONResponse({"object": "list", "data": [self.model_card(name) for name in self.served_names]})

    async def retrieve_model(self, request: Request) -> Response:
        """`GET /v1/models/{id}` (the openai client's `models.retrieve`)."""
        self.authorize(request.headers.get("authorization", ""))
        name = request.path_params["model"]
        self.check_model(name)
        await self._learn_quantization()
        return JSONResponse(self.model_card(name))

    def parse(self, exchange: Exchange, model: type, raw: bytes) -> Any:
        """The body, its ignored fields logged once and named in the response's header."""
        body, ignored = parse_body(model, raw, strict=self.strict_openai)
        if ignored:
            names = ",".join(ignored)
            log.info("fields ignored", request_id=exchange.request_id, path=exchange.scope["path"], fields=names)
            exchange.headers.append((IGNORED_FIELDS_HEADER, names.encode("latin-1", "replace")))
        return body

    async def completions(self, exchange: Exchange, tenant: str | None) -> None:
        body: CompletionRequest = self.parse(exchange, CompletionRequest, await exchange.body(MAX_BODY_BYTES))
        self.check_model(body.model)
        prompts = body.prompts()
        sampling = body.sampling()
        salt = request_salt(tenant, body.cache_salt)
        structured = body.structured()
        jobs = [Job(base=i * body.n, prompt=prompt, sampling=sampling,
                    structured_param=None if structured is None else structured[1],
                    echo=prompt if body.echo and isinstance(prompt, str) else "", cache_salt=salt,
                    speculative=body.speculative,
                    echo_logprobs=body.logprobs if body.echo else None, prompt_logprobs=body.prompt_logprobs,
                    request_id=exchange.request_id if len(prompts) == 1 else f"{exchange.request_id}-{i}")
                for i, prompt in enumerate(prompts)]
        exchange.jobs = jobs
        await self.generate(exchange, jobs, body.model, chat=False, stream=body.stream,
                            include_usage=body.include_usage)

    async def chat_completions(self, exchange: Exchange, tenant: str | None) -> None:
        body: ChatCompletionRequest = self.parse(exchange, ChatCompletionRequest,
                                                 await exchange.body(MAX_BODY_BYTES))
        self.check_model(body.model)
        sampling = body.sampling()
        tools = body.tool_list()
        tool_plan: ToolPlan | None = None
        structured = body.structured()
        structured_param = structured[1] if structured is not None else None
        if tools is not None:
            tool_plan = plan([{"name": t["name"], "parameters": f.function.parameters} for t, f in
                              zip(tools, body.tools or (), strict=True)], body.tool_choice_value(),
                             body.parallel_tool_calls is not False, self.tool_format)
            if tool_plan.schema is not None:
                sampling["structured"] = {"json": json.dumps(tool_plan.schema)}
                structured_param = "tools"
        jobs = [Job(base=0, prompt=None, messages=body.chat_messages(), sampling=sampling,
                    cache_salt=request_salt(tenant, body.cache_salt), request_id=exchange.request_id, tools=tools,
                    speculative=body.speculative,
                    tool_plan=tool_plan, structured_param=structured_param,
                    prompt_logprobs=body.prompt_logprobs)]
        exchange.jobs = jobs
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
            exchange.status = 499  # nginx's "client closed request", for the access log
            return  # nobody reads an answer
        except GatewayError as error:
            failure = error
        except HybriddError as error:
            self.daemon_failed(error)
            failure = from_daemon(error, exchange.jobs[0].structured_param if exchange.jobs else None)
        except Exception as error:
            log.error("internal error", path=exchange.scope["path"], error=repr(error))
            if exchange.started:
                raise
            failure = GatewayError(500, f"internal error: {type(error).__name__}", type="internal_error")
        if exchange.started:
            raise RuntimeError("an HTTP error after the answer began") from failure
        exchange.error = failure.code
        await exchange.json(failure.status, failure.body(), failure.headers())

    # ------------------------------------------------------------ generation

    def _stream(self, job: Job) -> AsyncStream:
        if job.messages is not None:
            return self.client.chat_stream(job.messages, cache_salt=job.cache_salt, speculative=job.speculative,
                                           request_id=job.request_id, tools=job.tools, **job.sampling)
        return self.client.stream(job.prompt, cache_salt=job.cache_salt, speculative=job.speculative,
                                  request_id=job.request_id, **job.sampling)

    async def generate(self, exchange: Exchange, jobs: list[Job], model: str, *, chat: bool, stream: bool,
                       include_usage: bool) -> None:
        """Send the daemon requests first, then build the answer's writer while the daemon
        works: only what the request needs stands before the first token."""
        await self.ensure_ready()
        if not stream and not jobs[0].sampling.get("logprobs"):
            with exchange.watch():
                await self._run_whole(jobs)
            await exchange.json(200, _reply(exchange.request_id, model, chat).whole(jobs))
            return
        # Logprobs travel in the daemon's chunks (a final reply holds only so many), so a
        # whole answer with logprobs is streamed from the daemon and gathered here.
        streams = [self._stream(job) for job in jobs]
        reply = _reply(exchange.request_id, model, chat)
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
                return await self.client.chat(job.messages, cache_salt=job.cache_salt, speculative=job.speculative,
                                              request_id=job.request_id, tools=job.tools, **job.sampling)
            return await self.client.generate(job.prompt, cache_salt=job.cache_salt, speculative=job.speculative,
                                              request_id=job.request_id, **job.sampling)

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


def _reply(request_id: str, model: str, chat: bool) -> Reply:
    return Reply(id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", model=model, chat=chat)


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
    tool_plan = job.tool_plan if job.tool_plan is not None and job.tool_plan.reads_calls else None
    readers: dict[int, CallReader] = {}  # per sequence, when its text may hold tool calls

    def delta(reply: Reply, chunk: Chunk) -> bytes | None:
        logprobs = reply.logprobs(job, chunk.index, chunk.logprobs)
        if tool_plan is not None:
            events = readers.setdefault(chunk.index, CallReader(tool_plan)).feed(chunk.text)
            if not events and logprobs is None:
                return None  # text held back (it may begin a call)
            return reply.read_delta(job.base + chunk.index, events, logprobs)
        if not chunk.text and logprobs is None:
            return None  # text held back (a partial character, a possible stop string)
        return reply.delta(job.base + chunk.index, chunk.text, logprobs)

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
            reason = choice.finish_reason
            if (reader := readers.get(choice.index)) is not None:
                if events := reader.finish():
                    yield reply.read_delta(job.base + choice.index, events)
                if reader.calls:
                    reason = tool_calls_reason(reason)
            yield reply.finish(job.base + choice.index, reason)

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
    routes served on their own fast path (`Exchange`), everything else by Starlette;
    every HTTP request gets its id and its access-log line here."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.generation = {"/v1/completions": gateway.completions, "/v1/chat/completions": gateway.chat_completions}

        async def gateway_error(request: Request, error: Exception) -> Response:
            assert isinstance(error, GatewayError)
            return error.response()

        async def http_error(request: Request, error: Exception) -> Response:
            assert isinstance(error, HTTPException)
            return from_http(error.status_code, error.detail, request.url.path).response()

        async def internal(request: Request, error: Exception) -> Response:
            log.error("internal error", path=request.url.path, error=repr(error))
            return GatewayError(500, f"internal error: {type(error).__name__}", type="internal_error").response()

        self.rest = Starlette(routes=[
            Route("/health", gateway.health, methods=["GET"]),
            Route("/metrics", gateway.metrics, methods=["GET"]),
            Route("/v1/models", gateway.models, methods=["GET"]),
            Route("/v1/models/{model:path}", gateway.retrieve_model, methods=["GET"]),
            Route("/tokenize", gateway.tokenize_routes.tokenize, methods=["POST"]),
            Route("/detokenize", gateway.tokenize_routes.detokenize, methods=["POST"]),
        ], exception_handlers={GatewayError: gateway_error, HTTPException: http_error, Exception: internal})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.rest(scope, receive, send)
            return
        started = time.monotonic()
        exchange = Exchange(scope, receive, send)
        exchange.request_id = request_id_of(exchange.header(b"x-request-id"))
        exchange.headers.append((b"x-request-id", exchange.request_id.encode()))
        try:
            if (route := self.generation.get(scope["path"])) is not None:
                if scope["method"] != "POST":
                    error = GatewayError(405, f"{scope['method']} is not allowed on {scope['path']}: use POST")
                    exchange.error = error.code
                    await exchange.json(405, error.body(), ((b"allow", b"POST"),))
                    return
                await self.gateway.serve_generation(route, exchange)
                return
            scope.setdefault("state", {})["request_id"] = exchange.request_id
            await self.rest(scope, receive, exchange.send_with_headers)
        finally:
            access_log(exchange, time.monotonic() - started)


def access_log(exchange: Exchange, duration_s: float) -> None:
    """One line per request: what it asked, how it ended, and what it cost."""
    fields: dict[str, Any] = {"request_id": exchange.request_id, "method": exchange.scope["method"],
                              "path": exchange.scope["path"], "status": exchange.status,
                              "duration_s": round(duration_s, 6)}
    results = [job.result for job in exchange.jobs if job.result is not None]
    if results:
        fields["prompt_tokens"] = sum(r.usage.prompt_tokens for r in results)
        fields["generated_tokens"] = sum(r.usage.completion_tokens for r in results)
        ttfts = [r.timings.ttft_s for r in results if r.timings.ttft_s is not None]
        fields["ttft_s"] = round(min(ttfts), 6) if ttfts else None
        fields["finish_reason"] = ",".join(sorted({c.finish_reason for r in results for c in r.choices}))
    if exchange.error:
        fields["error"] = exchange.error
    if exchange.scope["path"] in PROBES:
        log.debug("request", **fields)
    else:
        log.info("request", **fields)


def create_app(gateway: Gateway, cors_origins: list[str] | tuple[str, ...] = ()) -> Any:
    """The OpenAI-compatible application over `gateway`; with `cors_origins`, browsers
    on those origins may call it (CORS)."""
    app: Any = GatewayApp(gateway)
    if cors_origins:
        app = CORSMiddleware(app, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"],
                             expose_headers=["X-Request-Id", "X-Hybridd-Ignored-Fields"])
    return app


def create_metrics_app(gateway: Gateway) -> Starlette:
    """`/metrics` alone, for the `metrics_endpoint` served without the API."""
    return Starlette(routes=[Route("/metrics", gateway.metrics, methods=["GET"]),
                             Route("/health", gateway.health, methods=["GET"])])
