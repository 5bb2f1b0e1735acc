"""A client's request on the context generator's side: while its prompt is tokenized
(`PendingPrompt`), while the engine core runs it (`ClientRequest`), the final reply each
ends with, and how a message that cannot be served is attributed and answered."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

from hybridd.engine.core import EngineRequest
from hybridd.engine.grammar import StructuredOutputError
from hybridd.engine.prompt import PromptError
from hybridd.protocol import codec
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.limits import PROTOCOL_VERSION
from hybridd.protocol.messages import Choice, FinalReply, GenerateRequest, Request, Timings, Usage


@dataclass
class ClientRequest:
    """A client's generate request while the core runs it: where its replies go and
    how. Its output, text and timings live in the core's request (`engine.seqs`); the
    request's own timings are those of sequence 0."""

    identity: bytes
    id: str
    stream: bool
    engine: EngineRequest
    v: int  # the protocol version of the request, and so of its replies
    chunks: int = 0  # chunks sent, numbered on the wire in version 1

    def final(self, now: float) -> FinalReply:
        """The request's final reply, once every sequence has ended."""
        engine = self.engine
        first = engine.seqs[0]
        return FinalReply(
            id=self.id,
            choices=[Choice(index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
                            finish_reason=seq.finish_reason,
                            # a stream's chunks carried them already
                            logprobs=None if self.stream else seq.logprobs)
                     for seq in engine.seqs],
            usage=Usage(prompt_tokens=first.num_prompt_tokens, completion_tokens=engine.completion_tokens,
                        cached_tokens=engine.cached_tokens),
            timings=Timings(
                ttft_s=None if first.first_token_time is None else first.first_token_time - first.arrival_time,
                total_s=now - first.arrival_time,
                queue_s=(first.scheduled_time or now) - first.arrival_time,
            ),
            prompt_logprobs=first.prompt_logprobs,
            v=self.v,
        )


@dataclass
class PendingPrompt:
    """A generate whose prompt the intake's thread is tokenizing; admitted when done."""

    identity: bytes
    request: GenerateRequest
    received: float
    deadline: float | None
    encoding: Future | None

    def final(self, reason: str) -> FinalReply:
        """Its final when it ends (cancel, timeout, drain) before its prompt is tokenized:
        no output; the thread's result is dropped when it comes."""
        req = self.request
        waited = time.monotonic() - self.received
        return FinalReply(
            id=req.id,
            choices=[Choice(index=i, text="", token_ids=[], finish_reason=reason, logprobs=None)
                     for i in range(req.sampling.n)],
            usage=Usage(prompt_tokens=0, completion_tokens=0),
            timings=Timings(ttft_s=None, total_s=waited, queue_s=waited),
            v=req.v,
        )


def request_key(identity: bytes, request_id: str) -> str:
    """The core's id of a client's request: request ids are unique within a session only."""
    return f"{identity.hex()}:{request_id}"


def field_first(field: str, message: str) -> str:
    """SPEC: an error's message names the field first."""
    return message if message.startswith(f"{field}:") else f"{field}: {message}"


def encoding_failure(exc: Exception) -> tuple[ErrorCode, str, str | None]:
    """The error that answers a prompt whose encoding failed: a prompt that cannot run
    is the client's (invalid_request, its field named), a tokenizer that raised is ours."""
    if isinstance(exc, (PromptError, StructuredOutputError)):
        return ErrorCode.INVALID_REQUEST, field_first(exc.field, str(exc)), exc.field
    return ErrorCode.INTERNAL, f"prompt: the tokenizer failed: {type(exc).__name__}: {exc}", "prompt"


def decode_request(frame: bytes | memoryview) -> Request | ProtocolError:
    try:
        return codec.REQUESTS.decode(frame)
    except ProtocolError as error:
        return error


def attribution(request: Request | ProtocolError | None) -> tuple[str, int]:
    """The id (when valid) and version an error about this message is answered with."""
    if request is None:  # not decoded yet
        return "", PROTOCOL_VERSION
    if isinstance(request, ProtocolError):
        return request.request_id or "", request.version or PROTOCOL_VERSION
    return request.id, request.v
