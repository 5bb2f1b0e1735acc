"""The context-generator process: a shell around the engine core.

The core (`hybridd.engine.core.EngineCore`) schedules, runs the overlapped step
pipeline to the graph generator (its peer over a PAIR control channel and the shared
arenas), samples, detokenizes and checks stop criteria. This shell owns what faces the
clients and the supervisor: the client ROUTER sockets and their sessions, the intake
(decoding, validating and tokenizing requests), replies (chunks, finals, errors, reply
rings), cancel, timeouts, drain and status.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import msgspec
import zmq

from hybridd.version import __version__
from hybridd.config import Config, resolve_device, resolve_dtype
from hybridd.engine.block_manager import BlockManager
from hybridd.engine.core import EngineCore, EngineOutputs
from hybridd.engine.grammar import CompiledGrammar, GrammarCompiler
from hybridd.engine.prompt import PromptError, prompt_length_refusal, prompt_token_ids
from hybridd.engine.sampler import Sampler
from hybridd.engine.scheduler import AdmissionError, Scheduler
from hybridd.engine.speculation.graph_drafter import GraphDrafter
from hybridd.engine.speculation.policy import SpeculationPolicy
from hybridd.engine.speculation.registry import make_drafter
from hybridd.engine.speculation.speculator import Speculator
from hybridd.engine.step_pipeline import StepPipeline
from hybridd.errors import EngineDeadError
from hybridd.log import configure, get_logger
from hybridd.model import ModelConfig, load_tokenizer
from hybridd.model.config import chat_stop_strings
from hybridd.runtime import gc_pauses
from hybridd.runtime.step_buffers import StepBuffers, geometry
from hybridd.serving_metrics import ServingMetrics
from hybridd.runtime.step_trace import StepTracer, mark
from hybridd.ipc.channel import CLIENT_SOCKET_MODE, Channel, PeerProtocolError, bind_ipc_endpoint
from hybridd.ipc.posix_shm import pid_alive
from hybridd.ipc.shared_arena import SharedArena
from hybridd.protocol import codec, control
from hybridd.protocol.codec import encode
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import PROTOCOL_VERSION, SESSION_BACKLOG_LIMIT
from hybridd.protocol.supervisor import Drain, SupervisorInfo
from hybridd.protocol.messages import (
    AttachRingRequest,
    CancelRequest,
    ChunkReply,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Request,
    RingAttachedReply,
    SamplingParams,
    StatusReply,
    StatusRequest,
)
from hybridd.workers.loop_exit import LoopExit, Terminated, stop_signals_from
from hybridd.workers.client_requests import (
    ClientRequest, PendingPrompt, attribution, decode_request, encoding_failure, field_first,
)
from hybridd.workers.client_sessions import ClientSessions, client_chosen, socket_options
from hybridd.workers.intake import Intake
from hybridd.workers.reply_rings import ReplyRings
from hybridd.workers.supervisor_link import SupervisorLink

PIPELINE_DEPTH = 2  # steps in flight: the host schedules one step ahead of the GPU
# Frames larger than this are screened by their byte counts before they are decoded
# (decoding a 4 MiB frame of non-ASCII text takes milliseconds of the loop's time).
SCREEN_FRAMES_OVER_BYTES = 64 * 1024
READY_TIMEOUT_S = 3600.0
# How soon the loop comes back to a session's outbox while nothing else is due.
OUTBOX_RETRY_MS = 5
TCP_PREFIX = b"tcp:"


class ContextGenerator:
    def __init__(self, config: Config, ctl_endpoint: str, supervised: bool = True):
        self.config = config
        self.supervised = supervised  # False only for a pair started without a supervisor (tests)
        self.log = get_logger("context_generator", pid=os.getpid())
        self.link = SupervisorLink(config.supervisor_endpoint, "context", config.heartbeat_interval_s)
        self.ctl = Channel(zmq.PAIR, decoder=codec.CONTROL, name="ctl-context")
        self.ctl.bind(ctl_endpoint)
        self.device = resolve_device(config)
        self.tracer = StepTracer("context")
        self.requests: dict[str, ClientRequest] = {}  # by the core's request id (`_key`)
        self.encoding: dict[str, PendingPrompt] = {}  # prompts on the intake's thread
        # The end of the graph generator's poll window after the last `Expect` (0: none open).
        self._expect_until = 0.0
        self.state = "loading"
        self.drain_deadline: float | None = None
        self.started = time.time()
        self.supervisor_info: dict[str, Any] = {}
        self.graph_stats: dict[str, Any] = {}
        self.served = 0
        self.failed = 0
        self.metrics = ServingMetrics()
        self.rings = ReplyRings(config.max_reply_rings)
        self.stop = False
        self.loop_exit = LoopExit(self.log)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        config = self.config
        if self.device.type == "cuda":
            # A phase of its own: this process's CUDA context is created here, beside the
            # graph generator's weight loading.
            self.link.phase("loading", "initialising CUDA")
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)
        self.link.phase("loading", "loading tokenizer")
        self.tokenizer = load_tokenizer(config.model)
        self.chat_stops = chat_stop_strings(config.model)
        # The fused sampling kernels run on the GPU only; the CPU samples eagerly. Their
        # compilation runs while the graph generator loads its weights and captures its
        # graphs: it needs only the vocabulary's size, and the graph generator's Ready
        # waits in the socket meanwhile.
        vocab_size = ModelConfig.from_dir(config.model).vocab_size
        sampler = Sampler(compile=config.compile_sampler and self.device.type == "cuda")
        self._warm_up_sampler(sampler, vocab_size)
        self.link.phase("loading", "waiting for the graph generator")
        ready = self._await_ready()
        if ready.vocab_size != vocab_size:
            raise EngineDeadError(f"the graph generator's vocabulary has {ready.vocab_size} tokens, "
                                  f"the model's config.json {vocab_size}")
        self.ready = ready
        self.kv_arena = SharedArena.open(ready.arenas["kv"])
        self.step_arena = SharedArena.open(ready.arenas["step"])
        # A draft model runs in the graph generator, beside the model: its draft distributions' region.
        self.draft_arena = SharedArena.open(ready.arenas["draft"]) if "draft" in ready.arenas else None
        self.ctl.send(control.ReadyAck())
        max_tokens, blocks_per_seq = geometry(config.max_prefill_tokens, ready.max_batch, ready.max_model_len,
                                              ready.block_size)
        self.buffers = StepBuffers(dict(self.step_arena.tensors), max_tokens, blocks_per_seq)
        self.block_manager = BlockManager(ready.num_kv_blocks, ready.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.intake = Intake(self.tokenizer, ready.max_model_len)
        self.pipeline = StepPipeline(
            ready, self.buffers, self.ctl, sampler, self.device,
            on_control=self._on_control, peer_alive=self._graph_alive,
            kv_cache=self.kv_arena.tensors["kv_cache"], while_launching=self._while_launching,
            while_waiting=self.link.heartbeat, settle=self._settle,
        )
        drafter = make_drafter(config.speculative_drafter, config.speculative_ngram_min, config.speculative_ngram_max,
                               self.pipeline.exchange_draft, self.ctl.send,
                               None if self.draft_arena is None else self.draft_arena.tensors["probabilities"])
        k = config.num_speculative_tokens
        self.speculator = None if drafter is None else Speculator(
            drafter, k, SpeculationPolicy(k, adaptive=config.speculative_adaptive))
        self.scheduler = Scheduler(
            self.block_manager,
            speculator=self.speculator,
            # A verify step's rows replay the decode graphs, the largest of which has max_batch rows.
            max_verify_rows=ready.max_batch,
            max_batch=ready.max_batch,
            max_prefill_tokens=config.max_prefill_tokens,
            chunk_tokens=config.chunk_tokens,
            max_model_len=ready.max_model_len,
            block_table_width=self.buffers.max_blocks_per_seq,
            max_prefill_seqs=ready.max_prefill_seqs,
            eos_token_ids=ready.eos_token_ids,
            tokenizer=self.tokenizer,
        )
        if isinstance(drafter, GraphDrafter) and drafter.hidden_states_kept:  # an EAGLE-3 head's
            self.pipeline.feed_hidden_states(drafter)
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size, ready.eos_token_ids,
                                        timeout_s=config.structured_compile_timeout_s,
                                        cache_size=config.structured_cache_size)
        self.core = EngineCore(self.scheduler, self.pipeline, self.tokenizer, PIPELINE_DEPTH,
                               on_launch=self._launched)
        # Sessions are tracked from before each bind: a client already waiting connects
        # the moment the socket exists.
        self.sessions: dict[bytes, ClientSessions] = {}
        self.client = bind_ipc_endpoint(
            self._ipc_path(config.client_endpoint), decoder=codec.REQUESTS, name="client",
            options=socket_options("ipc"), mode=CLIENT_SOCKET_MODE,
            before_bind=lambda channel: self.sessions.__setitem__(b"", ClientSessions(channel)),
        )
        self.tcp = None
        if config.tcp_endpoint:
            self.tcp = self._bind_tcp(config)
        self.state = "ready"
        self.link.phase("ready", "serving")
        self.log.info("serving", endpoint=config.client_endpoint, kv_blocks=ready.num_kv_blocks)

    def _warm_up_sampler(self, sampler: Sampler, vocab_size: int) -> None:
        """Compile every sampling path before ready, so no request pays for it and the
        serving loop never stalls on a compilation; heartbeats go out in between."""
        if not sampler.compiled:
            return

        def progress(done: int, total: int) -> None:
            self.link.phase("loading", "compiling the sampler", done, total)
            self.link.heartbeat(force=True)

        sampler.warm_up(vocab_size, self.device, progress)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def _ipc_path(endpoint: str) -> str:
        return endpoint.removeprefix("ipc://")

    def _bind_tcp(self, config: Config) -> Channel:
        from pathlib import Path

        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        channel = Channel(zmq.ROUTER, decoder=codec.REQUESTS, name="client-tcp")
        _, secret = zmq.auth.load_certificate(config.curve_secret_key_file)
        self._auth = ThreadAuthenticator(zmq.Context.instance())
        self._auth.start()
        if config.curve_allow_any:  # validated: only when explicitly configured
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._auth.configure_curve(domain="*", location=str(Path(config.curve_client_keys_dir)))
        channel.use_curve_server(secret)
        for option, value in socket_options("tcp").items():
            channel.socket.setsockopt(option, value)
        self.sessions[TCP_PREFIX] = ClientSessions(channel, TCP_PREFIX)
        channel.bind(config.tcp_endpoint)
        return channel

    def _await_ready(self) -> control.Ready:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.link.heartbeat()
            message = self.ctl.recv(timeout_ms=int(self.config.heartbeat_interval_s * 1000))
            if message is None:
                continue
            if isinstance(message, control.Ready):
                return message
        raise EngineDeadError("graph generator never became ready")

    def _graph_alive(self) -> bool:
        return self.ready.pid <= 0 or pid_alive(self.ready.pid)

    def _on_control(self, message: control.ControlMessage) -> None:
        if isinstance(message, control.Stats):
            self.graph_stats = message.stats

    # ------------------------------------------------------------------- loop
    def serve(self) -> None:
        self.pipeline.serve_from_this_thread()
        poller = zmq.Poller()
        sockets = [self.client.socket, self.link.socket, self.ctl.socket] + ([self.tcp.socket] if self.tcp else [])
        sockets += [sessions.monitor for sessions in self.sessions.values()]
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self.intake.fileno(), zmq.POLLIN)
        last_alive_check = 0.0
        idle_ms = int(self.config.heartbeat_interval_s * 1000)
        poll_until = 0.0  # busy_poll_s after the last piece of work
        while not self.stop:
            self.link.heartbeat()
            busy = self.core.has_work
            if busy:
                poll_until = time.monotonic() + self.config.busy_poll_s
            elif poll_until and time.monotonic() < poll_until:
                busy = True
            outboxes = any(sessions.pending for sessions in self.sessions.values())
            events = dict(poller.poll(timeout=0 if busy else OUTBOX_RETRY_MS if outboxes else idle_ms))
            if self.link.socket in events:
                self._supervisor_commands()
            for channel in (self.client, self.tcp):
                if channel is not None and channel.socket in events:
                    self._client_messages(channel)
            if self.intake.fileno() in events:
                self._encoded_prompts()
            self._serve_sessions()
            if self.ctl.socket in events and not self.core.inflight:
                while (message := self.ctl.recv(timeout_ms=0)) is not None:
                    self._on_control(message)
            now = time.monotonic()
            if now - last_alive_check > 0.1:
                last_alive_check = now
                if not self._graph_alive():
                    raise EngineDeadError("graph generator died")
                self._expire_timeouts(now)
            self._deliver(self.core.step())
            if self.state == "draining":
                self._check_drain()
            self.rings.end_batch()

    def _launched(self) -> None:
        self._expect_until = 0.0  # a step ends the graph generator's poll window
        self.tracer.step()
        self.link.steps += 1

    def _while_launching(self) -> None:
        """While the graph generator launches a step: the steps that have landed are
        retired and their tokens sent now, not after the launch."""
        self.core.retire_landed()
        self._deliver(self.core.take_outputs())

    def _settle(self) -> None:
        """A constrained batch's forward runs: every step before it is retired (its tokens
        advance the grammars its masks are filled from) and its tokens sent."""
        self.core.retire_all()
        self._deliver(self.core.take_outputs())

    def _deliver(self, outputs: EngineOutputs) -> None:
        """Send what the core produced: each streamed token as a chunk, each ended
        request's final; record its latencies once (status and /metrics read them)."""
        if not outputs:
            return
        metrics = self.metrics
        for seconds in outputs.queued_s:
            metrics.scheduled(seconds)
        for seconds in outputs.first_token_s:
            metrics.first_token(seconds)
        for seconds in outputs.inter_token_s:
            metrics.inter_token(seconds)
        for seconds in outputs.prefill_step_s:
            metrics.step(seconds, prefill=True)
        for seconds in outputs.decode_step_s:
            metrics.step(seconds, prefill=False)
        for out in outputs.tokens:
            request = self.requests.get(out.request.id)
            if request is None or not request.stream:
                continue
            if self._backlog(request.identity) >= SESSION_BACKLOG_LIMIT:
                self._too_slow(request.identity)
                continue
            mark("chunk_send")
            self._send(request.identity, ChunkReply(
                id=request.id, index=out.seq.index, number=request.chunks, text=out.text, token_ids=[out.token],
                logprobs=None if out.logprob is None else [out.logprob], v=request.v))
            request.chunks += 1
        for engine_request in outputs.finished:
            request = self.requests.pop(engine_request.id, None)
            if request is not None:
                self._finish(request)
        self.rings.end_batch()

    # ---------------------------------------------------------------- clients
    def _route(self, identity: bytes) -> tuple[ClientSessions, bytes]:
        if identity.startswith(TCP_PREFIX) and TCP_PREFIX in self.sessions:
            return self.sessions[TCP_PREFIX], identity.removeprefix(TCP_PREFIX)
        return self.sessions[b""], identity

    def _send(self, identity: bytes, message) -> None:
        """Deliver a reply, or queue it in the session's outbox; never drops it while
        the session lives. A session whose backlog passes twice its limit is abandoned."""
        sessions, routing_id = self._route(identity)
        frame = encode(message)
        self.rings.put(identity, frame)
        backlog = sessions.send(routing_id, frame)
        if backlog > 2 * SESSION_BACKLOG_LIMIT:
            self.log.warning("abandoning a session that reads none of its replies", backlog=backlog)
            sessions.end(routing_id)

    def _backlog(self, identity: bytes) -> int:
        sessions, routing_id = self._route(identity)
        return sessions.backlog(routing_id)

    def _serve_sessions(self) -> None:
        """Flush outboxes; cancel the requests of sessions that ended (a disconnect, a
        connection dropped for an over-size frame, a peer that died)."""
        for sessions in self.sessions.values():
            sessions.poll_events()
            if sessions.pending:
                sessions.flush()
            for identity in sessions.ended():
                self._end_session(identity)

    def _drop(self, key: str) -> ClientRequest | None:
        """Stop every unfinished sequence of a request and forget it, sending nothing."""
        request = self.requests.pop(key, None)
        if request is None:
            return None
        self.core.abort(key)
        return request

    def _end_session(self, identity: bytes) -> None:
        """The client is gone: its requests are cancelled, their KV blocks freed; no reply."""
        self.rings.detach(identity)
        for key in [key for key, pending in self.encoding.items() if pending.identity == identity]:
            del self.encoding[key]  # its prompt's ids are dropped when they come
        ended = [key for key, request in self.requests.items() if request.identity == identity]
        now = time.monotonic()
        for key in ended:
            engine = self._drop(key).engine
            self.metrics.finished_request("cancelled", prompt_tokens=engine.seqs[0].num_prompt_tokens,
                                          generation_tokens=engine.completion_tokens, e2e_s=now - engine.arrival)
        if ended:
            self.log.info("session ended; its requests are cancelled", requests=len(ended))

    def _too_slow(self, identity: bytes) -> None:
        """The session's backlog reached its limit: every generate of it ends now with a
        terminal `overloaded` error, queued behind the replies it has not read."""
        backlog = self._backlog(identity)
        for key in [key for key, request in self.requests.items() if request.identity == identity]:
            request = self._drop(key)
            tokens = request.engine.completion_tokens
            self._error(identity, request.id, ErrorCode.OVERLOADED,
                        f"client too slow: {backlog} replies unread beyond the transport's queue "
                        f"(limit {SESSION_BACKLOG_LIMIT}); the request was ended after {tokens} tokens", v=request.v)
        self.log.warning("session too slow; its requests are ended", backlog=backlog)

    def _error(self, identity: bytes, request_id: str, code: ErrorCode, message: str, field: str | None = None,
               *, v: int):
        self.failed += code not in (ErrorCode.CANCELLED,)
        self._send(identity, ErrorReply(id=request_id, code=code, message=message, field=field, v=v))

    def _client_messages(self, channel: Channel) -> None:
        prefix = TCP_PREFIX if channel is self.tcp else b""
        sessions = self.sessions[prefix]
        self.intake.new_turn()
        for _ in range(256):
            try:
                received = channel.recv_frame_from(timeout_ms=0)
            except PeerProtocolError as exc:
                if client_chosen(exc.identity) or sessions.admit(exc.identity, channel.last_peer_fd):
                    self._send(prefix + exc.identity, ErrorReply.from_error(exc))
                continue
            if received is None:
                return
            mark("frame_received")
            routing_id, frame = received
            identity = prefix + routing_id
            now = time.monotonic()
            request = decode_request(frame) if len(frame) <= SCREEN_FRAMES_OVER_BYTES else None
            if client_chosen(routing_id):
                rid, version = attribution(request)
                self._error(identity, rid, ErrorCode.INVALID_REQUEST,
                            "ZMQ_ROUTING_ID: this connection chose its own routing id; the daemon names "
                            "sessions itself, so leave ZMQ_ROUTING_ID unset (the message was not executed)",
                            v=version)
                continue
            if not sessions.admit(routing_id, channel.last_peer_fd):
                # A message queued behind its connection's disconnect (the reply is
                # unroutable), or a new connection that set an ended session's id.
                self._error(identity, "", ErrorCode.INVALID_REQUEST,
                            "ZMQ_ROUTING_ID: this routing id belongs to a session that has ended; "
                            "leave ZMQ_ROUTING_ID unset (the message was not executed)", v=attribution(request)[1])
                continue
            if request is None:  # a large frame: its prompt may be refused from its byte counts
                screened = self.intake.screen(frame)
                if screened is not None:
                    error, version = screened
                    error.version = version
                    request = error
                else:
                    request = decode_request(frame)
            self._on_request(channel, identity, request, now)

    def _on_request(self, channel: Channel, identity: bytes, request: Request | ProtocolError,
                    received: float) -> None:
        if isinstance(request, ProtocolError):
            channel.count_rejected(request)
            # The id only if the message had a valid one (SPEC: "" otherwise, never a prefix).
            self._error(identity, request.request_id or "", request.code, request.message, request.field,
                        v=request.version or PROTOCOL_VERSION)
        elif isinstance(request, GenerateRequest):
            self._generate(identity, request, received)
        elif isinstance(request, CancelRequest):
            self._cancel(identity, request.target)
        elif isinstance(request, StatusRequest):
            self._send(identity, StatusReply(id=request.id, status=self.status(), v=request.v))
        elif isinstance(request, HealthRequest):
            # ok only in the supervisor's `ready`: this process serves a moment before the
            # supervisor hears of it, and a client that waited for ok reads the state next.
            state = self._lifecycle_state()
            self._send(identity, HealthReply(id=request.id, state=state, ok=state == "ready", v=request.v))
        elif isinstance(request, AttachRingRequest):
            self._attach_ring(channel, identity, request)

    def _attach_ring(self, channel: Channel, identity: bytes, request: AttachRingRequest) -> None:
        try:
            ring = self.rings.open(identity, request, None if channel is self.tcp else channel.last_peer_fd)
        except ProtocolError as error:
            error.version = request.v
            self._send(identity, ErrorReply.from_error(error, request.id))
            return
        # The reply that says so is the last one the ring does not carry.
        self._send(identity, RingAttachedReply(id=request.id, v=request.v))
        self.rings.attach(identity, ring)

    def _key(self, identity: bytes, request_id: str) -> str:
        return f"{identity.hex()}:{request_id}"

    def _generate(self, identity: bytes, req: GenerateRequest, received: float) -> None:
        """Admit at once what needs no tokenizing; a prompt or a chat goes to the
        intake's thread after the checks that cost nothing (a prompt's characters first)."""
        def refuse(code: ErrorCode, message: str, field: str | None = None, request_id: str = req.id) -> None:
            self._error(identity, request_id, code, message, field, v=req.v)

        if self.state != "ready":
            refuse(ErrorCode.DRAINING, "the daemon is draining and accepts no new requests")
            return
        key = self._key(identity, req.id)
        if key in self.requests or key in self.encoding:
            # Not under req.id: an error is terminal for its id, and that id is the running request's.
            refuse(ErrorCode.INVALID_REQUEST, f"id: {req.id!r} is already in flight in this session; "
                   "the request was not run", "id", request_id="")
            return
        if self._backlog(identity) >= SESSION_BACKLOG_LIMIT:
            refuse(ErrorCode.OVERLOADED, f"client too slow: {self._backlog(identity)} replies unread "
                                         f"(limit {SESSION_BACKLOG_LIMIT}); read them before sending more")
            return
        in_flight = len(self.requests) + len(self.encoding)
        if in_flight >= self.config.max_queued_requests:
            refuse(ErrorCode.OVERLOADED, f"{in_flight} requests in flight (max_queued_requests); retry later")
            return
        vocab = self.ready.vocab_size
        params = req.sampling  # checked when decoded; only the vocabulary is known here alone
        bad = next((i for i, t in enumerate(params.stop_token_ids) if t >= vocab), None)
        if bad is not None:
            where = f"sampling.stop_token_ids[{bad}]"
            refuse(ErrorCode.INVALID_REQUEST,
                   f"{where}: token id {params.stop_token_ids[bad]} is outside the vocabulary of {vocab}", where)
            return
        if req.messages is not None and self.chat_stops and not params.ignore_eos:
            # The answer ends with the model's turn, as at EOS (the model's declared turn end).
            req.sampling = msgspec.structs.replace(
                params, stop=params.stop + [s for s in self.chat_stops if s not in params.stop])
        self._expect_step()
        deadline = received + req.timeout_s if req.timeout_s else None
        if req.prompt_token_ids is not None:
            refusal = prompt_length_refusal(len(req.prompt_token_ids), self.ready.max_model_len)
            if refusal is not None:  # before looking at every id
                refuse(ErrorCode.INVALID_REQUEST, f"prompt_token_ids: {refusal}", "prompt_token_ids")
                return
            try:
                ids = prompt_token_ids(self.tokenizer, token_ids=req.prompt_token_ids, vocab_size=vocab)
            except PromptError as exc:
                refuse(ErrorCode.INVALID_REQUEST, field_first(exc.field, str(exc)), exc.field)
                return
            if params.structured is None:
                self._admit(key, PendingPrompt(identity, req, received, deadline, None), ids)
            else:  # its constraint compiles on the intake's thread
                encoding = self.intake.submit(self._with_grammar, ids, params)
                self.encoding[key] = PendingPrompt(identity, req, received, deadline, encoding)
            return
        if req.prompt is not None and (refusal := self.intake.refusal(req.prompt)) is not None:
            refuse(ErrorCode.INVALID_REQUEST, refusal, "prompt")
            return
        ids = None
        if req.prompt is not None and not self.encoding and params.structured is None:
            # A short prompt, and none before it still on the intake's thread (admission
            # keeps the order of arrival): encoded here and admitted at once.
            try:
                ids = self.intake.encode_now(req.prompt)
                if ids is not None:
                    ids = self._checked_prompt_ids(ids)
            except Exception as exc:  # the tokenizer's failure is this request's alone
                refuse(*encoding_failure(exc))
                return
        if ids is not None:
            self._admit(key, PendingPrompt(identity, req, received, deadline, None), ids)
            return
        if req.prompt is not None:
            encoding = self.intake.submit(self._prompt_ids, req.prompt, params)
        else:
            messages = [m.as_dict() for m in req.messages or []]
            tools = None if req.tools is None else [tool.as_dict() for tool in req.tools]
            encoding = self.intake.submit(self._chat_ids, messages, tools, params)
        self.encoding[key] = PendingPrompt(identity, req, received, deadline, encoding)

    def _expect_step(self) -> None:
        """Tell the graph generator that a step follows, when none is in flight: it polls
        for the step instead of sleeping, and the wake-up of its threads overlaps this
        request's admission instead of following it (at most once per poll window)."""
        window = self.config.step_wake_poll_s
        if not window or self.core.inflight:
            return
        now = time.monotonic()
        if now >= self._expect_until:
            self._expect_until = now + window
            mark("expect_send")
            self.ctl.send(control.Expect())

    def _prompt_ids(self, prompt: str, params: SamplingParams) -> tuple[list[int], CompiledGrammar | None]:
        """On the intake's thread: the prompt's ids (the first max_model_len at most), and
        its structured output compiled."""
        return self._with_grammar(self._checked_prompt_ids(self.intake.prompt_ids(prompt)), params)

    def _chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  params: SamplingParams) -> tuple[list[int], CompiledGrammar | None]:
        """On the intake's thread: a chat's ids (the first max_model_len at most), with its
        tools, and its structured output compiled."""
        return self._with_grammar(self._checked_prompt_ids(self.intake.chat_ids(messages, tools), "messages"),
                                  params)

    def _with_grammar(self, ids: list[int], params: SamplingParams) -> tuple[list[int], CompiledGrammar | None]:
        """On the intake's thread: the ids, and the request's constraint compiled (cached)."""
        return ids, None if params.structured is None else self.grammars.compile(params.structured)

    def _checked_prompt_ids(self, ids: list[int], field: str = "prompt") -> list[int]:
        """A prompt's ids as encoded (the first max_model_len at most), if they can run."""
        if not ids:
            raise PromptError("is empty once tokenized", field)
        if (refusal := prompt_length_refusal(len(ids), self.ready.max_model_len, at_least=True)) is not None:
            raise PromptError(refusal, field)
        return ids

    def _encoded_prompts(self) -> None:
        """Admit the requests whose prompts the intake's thread has tokenized."""
        self.intake.clear_wakeups()
        for key, pending in list(self.encoding.items()):
            if not pending.encoding.done():
                continue
            del self.encoding[key]
            req = pending.request
            try:
                ids, grammar = pending.encoding.result()
            except Exception as exc:  # the tokenizer's (or a constraint's) failure is this request's alone
                self._error(pending.identity, req.id, *encoding_failure(exc), v=req.v)
                continue
            self._admit(key, pending, ids, grammar)

    def _admit(self, key: str, pending: PendingPrompt, ids: list[int], grammar: CompiledGrammar | None = None) -> None:
        """Hand a request with its prompt's token ids (and its compiled constraint) to the
        engine core, or refuse it."""
        req = pending.request
        try:
            engine = self.core.add(key, ids, req.sampling, pending.received, pending.deadline, req.cache_salt,
                                   grammar, speculative=req.speculative is not False)
        except AdmissionError as exc:
            self._error(pending.identity, req.id, ErrorCode.INVALID_REQUEST, field_first(exc.field, str(exc)),
                        exc.field, v=req.v)
            return
        self.requests[key] = ClientRequest(pending.identity, req.id, req.stream, engine, req.v)
        mark("admitted")

    def _end_pending(self, key: str, reason: str) -> None:
        """A request ended (cancel, timeout, drain) while its prompt was being tokenized."""
        pending = self.encoding.pop(key)
        self._send(pending.identity, pending.final(reason))

    def _cancel(self, identity: bytes, target: str) -> None:
        self._end(self._key(identity, target), "cancelled")

    def _expire_timeouts(self, now: float) -> None:
        for key, pending in list(self.encoding.items()):
            if pending.deadline is not None and now > pending.deadline:
                self._end_pending(key, "timeout")
        self.core.expire(now)
        self._deliver(self.core.take_outputs())

    def _end(self, key: str, reason: str) -> None:
        """Stop every unfinished sequence of a request (cancel, drain); its final goes out now."""
        if key in self.encoding:
            self._end_pending(key, reason)
            return
        if self.core.abort(key, reason) is not None:
            self._deliver(self.core.take_outputs())

    def _finish(self, request: ClientRequest) -> None:
        """Every sequence of the request has ended: its final reply."""
        engine = request.engine
        now = time.monotonic()
        reasons = [seq.finish_reason for seq in engine.seqs]
        if all(reason in ("stop", "length") for reason in reasons):
            self.served += 1
        # The request's reason: the first sequence's, unless one ended otherwise than by stop or length.
        reason = next((r for r in reasons if r not in ("stop", "length")), reasons[0])
        self.metrics.finished_request(reason, prompt_tokens=engine.seqs[0].num_prompt_tokens,
                                      generation_tokens=engine.completion_tokens, e2e_s=now - engine.arrival)
        self._send(request.identity, request.final(now))

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """A terminal error for every request still in flight (engine death, shutdown)."""
        for key, request in list(self.requests.items()):
            self._error(request.identity, request.id, code, message, v=request.v)
            self.requests.pop(key, None)
        for key, pending in list(self.encoding.items()):
            self._error(pending.identity, pending.request.id, code, message, v=pending.request.v)
            self.encoding.pop(key, None)
        for sessions in getattr(self, "sessions", {}).values():
            sessions.flush()

    # ------------------------------------------------------------- supervisor
    def _supervisor_commands(self) -> None:
        while (command := self.link.poll_command()) is not None:
            if isinstance(command, Drain):
                self._begin_drain(command.timeout_s)
            elif isinstance(command, SupervisorInfo):
                self.supervisor_info = command.info.to_wire()

    def _begin_drain(self, timeout_s: float) -> None:
        if self.state != "ready":
            return
        self.state = "draining"
        self.drain_deadline = time.monotonic() + timeout_s
        self.link.phase("draining", f"draining {len(self.requests)} requests")
        self.log.info("draining", requests=len(self.requests), timeout_s=timeout_s)

    def _check_drain(self) -> None:
        unread = any(sessions.pending for sessions in self.sessions.values())
        if (self.requests or self.encoding or unread) and time.monotonic() < self.drain_deadline:
            return
        for key in list(self.requests) + list(self.encoding):
            self._end(key, "cancelled")
        self.core.drain()
        self.loop_exit.commanded("drain")
        self.stop = True

    # ----------------------------------------------------------------- status
    def _lifecycle_state(self) -> str:
        if self.state == "draining":
            return "draining"
        return self.supervisor_info.get("state", "starting" if self.supervised else self.state)

    def status(self) -> dict[str, Any]:
        graph = self.graph_stats
        bm = self.block_manager
        info = self.supervisor_info
        return {
            "state": self._lifecycle_state(),
            "uptime_s": info.get("uptime_s", time.time() - self.started),
            "started_at": info.get("started_at", self.started),
            "model": self.config.model,
            "dtype": str(resolve_dtype(self.config, self.device)).removeprefix("torch."),
            "device": str(self.device),
            "quantization": self.ready.quantization or None,
            "workers": info.get("workers", {"context": {"pid": os.getpid(), "restarts": 0},
                                            "graph": {"pid": self.ready.pid, "restarts": 0}}),
            "buckets": graph.get("buckets", []),
            "graph_bytes": graph.get("graph_bytes", 0),
            "graph_pool_bytes": graph.get("pool_bytes", 0),
            "graph_memory_budget_bytes": graph.get("memory_budget_bytes", self.config.graph_memory_budget_mb << 20),
            "kv_blocks": {"total": bm.num_blocks, "used": bm.num_blocks - bm.num_free, "free": bm.num_free},
            "kv_usage": (bm.num_blocks - bm.num_free) / bm.num_blocks if bm.num_blocks else 0.0,
            "version": __version__,
            "max_model_len": self.ready.max_model_len,
            "max_prompt_chars": self.intake.max_prompt_chars,
            "vocab_size": self.ready.vocab_size,
            "rejected": self._rejected(),
            "tokens_per_s": self.core.throughput.per_second(),
            "endpoints": {"ipc": self.config.client_endpoint, "tcp": self.config.tcp_endpoint or None},
            "restarts": info.get("workers", {}).get("context", {}).get("restarts", 0),
            "last_restart_reason": info.get("last_failure") or None,
            "cuda_mps": info.get("cuda_mps") or None,
            "requests": {"running": len(self.scheduler.running),
                         "queued": len(self.scheduler.waiting) + len(self.encoding),
                         "served": self.served, "failed": self.failed,
                         "preemptions": self.scheduler.num_preemptions},
            # In prompt tokens, as vLLM's prefix_cache_queries / prefix_cache_hits.
            "prefix_cache": {"enabled": bm.enable_prefix_caching, "queries": bm.prefix_cache_queries,
                             "hits": bm.prefix_cache_hits, "cached_blocks": bm.num_cached_blocks},
            "steps": self._steps(),
            "speculation": self._speculation(),
            "latency": self.metrics.latency(),
            "metrics": self.metrics.to_status(),
            "reply_rings": {"attached": len(self.rings), "written": self.rings.written,
                            "left_out": self.rings.left_out, "wakes": self.rings.wakes},
        }

    def _steps(self) -> dict[str, Any]:
        """What the scheduled steps carried since the worker started (chunked prefill's
        counters)."""
        stats = self.scheduler.stats
        return {"total": stats.steps, "tokens": stats.tokens, "tokens_per_step": stats.tokens_per_step,
                "prefill": stats.prefill_steps, "chunked_prefill": stats.chunked_prefill_steps,
                "mixed": stats.mixed_steps}

    def _speculation(self) -> dict[str, Any]:
        """Speculative decoding's counters (vLLM's spec_decode_*), and the policy's measured
        milliseconds per token by batch size, speculating and not."""
        if self.speculator is None:
            return {"drafter": "none"}
        speculation = {"drafter": self.speculator.drafter.name, "num_speculative_tokens": self.speculator.max_tokens,
                       **self.speculator.stats.to_dict(), "ms_per_token": self.speculator.policy.snapshot()}
        if "draft_model" in self.graph_stats:  # its KV arena and graphs, in the graph generator
            speculation["draft_model"] = self.graph_stats["draft_model"]
        return speculation

    def _rejected(self) -> dict[str, int]:
        """Messages refused while being read (SPEC §6) since the worker started, by code."""
        counts: dict[str, int] = {}
        for channel in (self.client, self.tcp):
            if channel is not None:
                for code, n in channel.stats.rejected.items():
                    counts[code] = counts.get(code, 0) + n
        return {"total": sum(counts.values()), **counts}

    def close(self) -> None:
        try:
            self.ctl.send(control.Shutdown())
        except Exception:  # the peer may be gone already
            pass
        for name in ("kv_arena", "step_arena", "draft_arena", "intake", "grammars"):
            if getattr(self, name, None) is not None:
                getattr(self, name).close()
        self.link.phase("stopped")
        for sessions in getattr(self, "sessions", {}).values():
            sessions.flush()
            sessions.close()
        self.rings.close()
        for name in ("client", "tcp"):
            channel = getattr(self, name, None)
            if channel is not None:
                channel.close(linger_ms=200)
        self.ctl.close(linger_ms=200)
        self.link.close()
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()  # its thread uses the ZeroMQ context, which the worker destroys on exit


def main(config: dict[str, Any], ctl_endpoint: str, supervised: bool = True) -> None:
    cfg = Config.from_dict(config)
    configure(cfg.log_level, json=cfg.log_format == "json")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor drains us with a message

    def terminate(signum, frame):
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, terminate)
    if supervised:
        stop_signals_from(os.getppid(), get_logger("context_generator", pid=os.getpid()))
    worker = ContextGenerator(cfg, ctl_endpoint, supervised)
    try:
        with worker.link.starting_up():
            worker.start()
        frozen = gc_pauses.freeze_start_up()
        worker.log.debug("start-up objects frozen out of the cyclic collector", objects=frozen)
        with worker.loop_exit.watch():
            worker.serve()
    except EngineDeadError as exc:
        worker.log.error("engine_dead", error=exc.message)
        worker.fail_all(ErrorCode.ENGINE_DEAD, f"the engine died: {exc.message}")
        raise SystemExit(3) from exc
    except SystemExit:
        worker.fail_all(ErrorCode.ENGINE_DEAD, "the engine is shutting down")
        raise
    except Exception as exc:
        # Any other failure ends the process too (the supervisor classifies it); every
        # client still hears about it first.
        worker.fail_all(ErrorCode.ENGINE_DEAD, f"the engine died: {type(exc).__name__}: {exc}")
        raise
    finally:
        worker.close()
