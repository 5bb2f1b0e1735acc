"""Admission: a client's generate checked, its prompt tokenized, and the request handed
to the engine core or refused.

The checks that cost nothing come first, in order: the daemon is not draining, the id
is not already in flight in the session, the session reads its replies, the daemon's
queue has room, every stop token is in the vocabulary, and the prompt can fit the
model's context (`prompt_length_refusal`, the one rule for a prompt's length; a text
prompt's characters are judged by the intake before it is tokenized). A prompt given
as token ids, or a short text prompt (encoded on the loop, `Intake.encode_now`), is
admitted at once; a longer prompt, a chat and a structured output's constraint are
encoded and compiled on the intake's thread, and the request is admitted when that is
done (`encoded_prompts`), in the order of arrival. This module owns those requests
while they wait (`PendingPrompt`, by the core's request id) and the jobs the intake's
thread runs for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from hybridd.config import Config
from hybridd.engine.core import EngineCore
from hybridd.engine.grammar import CompiledGrammar, GrammarCompiler
from hybridd.engine.prompt import PromptError, prompt_length_refusal, prompt_token_ids
from hybridd.engine.scheduler import AdmissionError
from hybridd.protocol import control
from hybridd.protocol.errors import ErrorCode
from hybridd.protocol.limits import SESSION_BACKLOG_LIMIT
from hybridd.protocol.messages import GenerateRequest, SamplingParams
from hybridd.runtime.step_trace import mark
from hybridd.workers.client_requests import (
    ClientRequest, PendingPrompt, encoding_failure, field_first, request_key,
)
from hybridd.workers.intake import Intake
from hybridd.workers.replies import Replies


class Admission:
    """The generates between their arrival and the engine core."""

    def __init__(self, config: Config, ready: control.Ready, core: EngineCore, replies: Replies, intake: Intake,
                 grammars: GrammarCompiler, tokenizer, chat_stops: list[str], *,
                 state: Callable[[], str], expect_step: Callable[[], None]) -> None:
        self.config = config
        self.ready = ready
        self.core = core
        self.replies = replies
        self.intake = intake
        self.grammars = grammars
        self.tokenizer = tokenizer  # the process's one tokenizer (the intake holds its fast path)
        self.chat_stops = chat_stops
        self.state = state  # the serving process's state: only "ready" admits
        self.expect_step = expect_step  # tells the graph generator that a step follows
        self.pending: dict[str, PendingPrompt] = {}  # prompts on the intake's thread, by request key

    def __contains__(self, key: str) -> bool:
        return key in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    def generate(self, identity: bytes, req: GenerateRequest, received: float) -> None:
        """Admit at once what needs no tokenizing; a prompt or a chat goes to the
        intake's thread after the checks that cost nothing (a prompt's characters first)."""
        replies = self.replies

        def refuse(code: ErrorCode, message: str, field: str | None = None, request_id: str = req.id) -> None:
            replies.error(identity, request_id, code, message, field, v=req.v)

        if self.state() != "ready":
            refuse(ErrorCode.DRAINING, "the daemon is draining and accepts no new requests")
            return
        key = request_key(identity, req.id)
        if key in replies.requests or key in self.pending:
            # Not under req.id: an error is terminal for its id, and that id is the running request's.
            refuse(ErrorCode.INVALID_REQUEST, f"id: {req.id!r} is already in flight in this session; "
                   "the request was not run", "id", request_id="")
            return
        if replies.backlog(identity) >= SESSION_BACKLOG_LIMIT:
            refuse(ErrorCode.OVERLOADED, f"client too slow: {replies.backlog(identity)} replies unread "
                                         f"(limit {SESSION_BACKLOG_LIMIT}); read them before sending more")
            return
        in_flight = len(replies.requests) + len(self.pending)
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
        self.expect_step()
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
                self.admit(key, PendingPrompt(identity, req, received, deadline, None), ids)
            else:  # its constraint compiles on the intake's thread
                encoding = self.intake.submit(self._with_grammar, ids, params)
                self.pending[key] = PendingPrompt(identity, req, received, deadline, encoding)
            return
        if req.prompt is not None and (refusal := self.intake.refusal(req.prompt)) is not None:
            refuse(ErrorCode.INVALID_REQUEST, refusal, "prompt")
            return
        ids = None
        if req.prompt is not None and not self.pending and params.structured is None:
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
            self.admit(key, PendingPrompt(identity, req, received, deadline, None), ids)
            return
        if req.prompt is not None:
            encoding = self.intake.submit(self._prompt_ids, req.prompt, params)
        else:
            messages = [m.as_dict() for m in req.messages or []]
            tools = None if req.tools is None else [tool.as_dict() for tool in req.tools]
            encoding = self.intake.submit(self._chat_ids, messages, tools, params)
        self.pending[key] = PendingPrompt(identity, req, received, deadline, encoding)

    # ------------------------------------------------- on the intake's thread
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

    # ----------------------------------------------------------- admitting
    def encoded_prompts(self) -> None:
        """Admit the requests whose prompts the intake's thread has tokenized."""
        self.intake.clear_wakeups()
        for key, pending in list(self.pending.items()):
            if not pending.encoding.done():
                continue
            del self.pending[key]
            req = pending.request
            try:
                ids, grammar = pending.encoding.result()
            except Exception as exc:  # the tokenizer's (or a constraint's) failure is this request's alone
                self.replies.error(pending.identity, req.id, *encoding_failure(exc), v=req.v)
                continue
            self.admit(key, pending, ids, grammar)

    def admit(self, key: str, pending: PendingPrompt, ids: list[int], grammar: CompiledGrammar | None = None) -> None:
        """Hand a request with its prompt's token ids (and its compiled constraint) to the
        engine core, or refuse it."""
        req = pending.request
        try:
            engine = self.core.add(key, ids, req.sampling, pending.received, pending.deadline, req.cache_salt,
                                   grammar, speculative=req.speculative is not False)
        except AdmissionError as exc:
            self.replies.error(pending.identity, req.id, ErrorCode.INVALID_REQUEST, field_first(exc.field, str(exc)),
                               exc.field, v=req.v)
            return
        self.replies.requests[key] = ClientRequest(pending.identity, req.id, req.stream, engine, req.v)
        mark("admitted")

    # ------------------------------------------------------------- endings
    def end(self, key: str, reason: str) -> None:
        """A request ended (cancel, timeout, drain) while its prompt was being tokenized."""
        pending = self.pending.pop(key)
        self.replies.send(pending.identity, pending.final(reason))

    def expire(self, now: float) -> None:
        """End the waiting requests whose deadline has passed."""
        for key, pending in list(self.pending.items()):
            if pending.deadline is not None and now > pending.deadline:
                self.end(key, "timeout")

    def end_session(self, identity: bytes) -> None:
        """The client is gone: its prompts' ids are dropped when they come; no reply."""
        for key in [key for key, pending in self.pending.items() if pending.identity == identity]:
            del self.pending[key]

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """A terminal error for every request still waiting (engine death, shutdown)."""
        for key, pending in list(self.pending.items()):
            self.replies.error(pending.identity, pending.request.id, code, message, v=pending.request.v)
            self.pending.pop(key, None)
