"""Replies to the context generator's client sessions.

What the engine core produced goes out from here: each streamed token as a chunk, each
ended request's final, and every error, to the session the request came from over its
socket (the IPC one, or the TCP one: identities of TCP sessions carry `TCP_PREFIX`)
and its reply ring. This module owns the requests the core runs for a client
(`ClientRequest`, by the core's request id: where their replies go), the sessions'
outboxes and the slow-consumer rule, the counts of requests served and failed, and the
latencies recorded once per request (`ServingMetrics`, which status and /metrics read).

A reply is never dropped while its session lives: a frame the transport will not take
waits in the session's outbox. A session whose backlog reaches `SESSION_BACKLOG_LIMIT`
is too slow: its generates end with a terminal `overloaded` error, queued behind the
replies it has not read; one whose backlog passes twice the limit is abandoned.
"""

from __future__ import annotations

import time

from hybridd.engine.core import EngineCore, EngineOutputs
from hybridd.ipc.channel import Channel
from hybridd.protocol.codec import encode
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import SESSION_BACKLOG_LIMIT
from hybridd.protocol.messages import AttachRingRequest, ChunkReply, ErrorReply, RingAttachedReply
from hybridd.runtime.step_trace import mark
from hybridd.serving_metrics import ServingMetrics
from hybridd.workers.client_requests import ClientRequest
from hybridd.workers.client_sessions import ClientSessions
from hybridd.workers.reply_rings import ReplyRings

TCP_PREFIX = b"tcp:"


class Replies:
    """The replies of every client session, and the client requests they answer."""

    def __init__(self, core: EngineCore, rings: ReplyRings, metrics: ServingMetrics, log) -> None:
        self.core = core
        self.rings = rings
        self.metrics = metrics
        self.log = log
        # Each client socket's sessions, by the prefix of their identities (b"": the IPC socket).
        self.sessions: dict[bytes, ClientSessions] = {}
        self.requests: dict[str, ClientRequest] = {}  # by the core's request id (`request_key`)
        self.served = 0
        self.failed = 0

    # ---------------------------------------------------------------- sending
    def _route(self, identity: bytes) -> tuple[ClientSessions, bytes]:
        if identity.startswith(TCP_PREFIX) and TCP_PREFIX in self.sessions:
            return self.sessions[TCP_PREFIX], identity.removeprefix(TCP_PREFIX)
        return self.sessions[b""], identity

    def send(self, identity: bytes, message) -> None:
        """Deliver a reply, or queue it in the session's outbox; never drops it while
        the session lives. A session whose backlog passes twice its limit is abandoned."""
        sessions, routing_id = self._route(identity)
        frame = encode(message)
        self.rings.put(identity, frame)
        backlog = sessions.send(routing_id, frame)
        if backlog > 2 * SESSION_BACKLOG_LIMIT:
            self.log.warning("abandoning a session that reads none of its replies", backlog=backlog)
            sessions.end(routing_id)

    def backlog(self, identity: bytes) -> int:
        sessions, routing_id = self._route(identity)
        return sessions.backlog(routing_id)

    def error(self, identity: bytes, request_id: str, code: ErrorCode, message: str, field: str | None = None,
              *, v: int):
        self.failed += code not in (ErrorCode.CANCELLED,)
        self.send(identity, ErrorReply(id=request_id, code=code, message=message, field=field, v=v))

    @property
    def pending(self) -> bool:
        """Whether some session's outbox holds replies the transport has not taken yet."""
        return any(sessions.pending for sessions in self.sessions.values())

    def flush(self) -> None:
        for sessions in self.sessions.values():
            sessions.flush()

    # ------------------------------------------------------- engine outputs
    def deliver(self, outputs: EngineOutputs) -> None:
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
            if self.backlog(request.identity) >= SESSION_BACKLOG_LIMIT:
                self._too_slow(request.identity)
                continue
            mark("chunk_send")
            self.send(request.identity, ChunkReply(
                id=request.id, index=out.seq.index, number=request.chunks, text=out.text, token_ids=[out.token],
                logprobs=None if out.logprob is None else [out.logprob], v=request.v))
            request.chunks += 1
        for engine_request in outputs.finished:
            request = self.requests.pop(engine_request.id, None)
            if request is not None:
                self._finish(request)
        self.rings.end_batch()

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
        self.send(request.identity, request.final(now))

    # ------------------------------------------------------------- sessions
    def serve_sessions(self) -> list[bytes]:
        """Flush outboxes; the identities of the sessions that ended since the last call
        (a disconnect, a connection dropped for an over-size frame, a peer that died)."""
        ended: list[bytes] = []
        for sessions in self.sessions.values():
            sessions.poll_events()
            if sessions.pending:
                sessions.flush()
            ended += sessions.ended()
        return ended

    def _drop(self, key: str) -> ClientRequest | None:
        """Stop every unfinished sequence of a request and forget it, sending nothing."""
        request = self.requests.pop(key, None)
        if request is None:
            return None
        self.core.abort(key)
        return request

    def end_session(self, identity: bytes) -> None:
        """The client is gone: its running requests are cancelled, their KV blocks freed,
        its ring detached; no reply."""
        self.rings.detach(identity)
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
        backlog = self.backlog(identity)
        for key in [key for key, request in self.requests.items() if request.identity == identity]:
            request = self._drop(key)
            tokens = request.engine.completion_tokens
            self.error(identity, request.id, ErrorCode.OVERLOADED,
                       f"client too slow: {backlog} replies unread beyond the transport's queue "
                       f"(limit {SESSION_BACKLOG_LIMIT}); the request was ended after {tokens} tokens", v=request.v)
        self.log.warning("session too slow; its requests are ended", backlog=backlog)

    def attach_ring(self, channel: Channel, identity: bytes, request: AttachRingRequest, tcp: bool) -> None:
        try:
            ring = self.rings.open(identity, request, None if tcp else channel.last_peer_fd)
        except ProtocolError as error:
            error.version = request.v
            self.send(identity, ErrorReply.from_error(error, request.id))
            return
        # The reply that says so is the last one the ring does not carry.
        self.send(identity, RingAttachedReply(id=request.id, v=request.v))
        self.rings.attach(identity, ring)

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """A terminal error for every request the core runs for a client (engine death, shutdown)."""
        for key, request in list(self.requests.items()):
            self.error(request.identity, request.id, code, message, v=request.v)
            self.requests.pop(key, None)

    def close(self) -> None:
        for sessions in self.sessions.values():
            sessions.flush()
            sessions.close()
