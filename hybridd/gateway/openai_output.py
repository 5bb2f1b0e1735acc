"""How the gateway writes OpenAI's objects: completions and chat completions, whole or
as server-sent chunks, with their choices, logprobs and usage.

One `Job` is one daemon request: a prompt (or a chat) with its `n` sequences, which
become the choices `base … base + n − 1` of the response. Logprobs come from the
daemon (computed from the distribution each token was sampled from) and are written
in the endpoint's format: the legacy `tokens` / `token_logprobs` / `top_logprobs` /
`text_offset` lists for completions, `content` entries for chat.

A streamed text chunk is most of what is written, the first token's among them: its
event is two pre-encoded halves around the choice's index and the JSON-encoded text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from hybridd.client import GenerateResult, TokenLogprob
from hybridd.gateway.tool_call_reader import ArgumentsPiece, CallOpened, Event, parse
from hybridd.gateway.tool_calls import ToolPlan
from hybridd.protocol.messages import PromptLogprob

_encode = msgspec.json.encode

DONE_EVENT = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass
class Job:
    """One daemon request: its prompt or chat, its sampling (with `n`), its prefix-cache
    salt, and where its choices go in the response."""

    base: int  # the index of its first choice
    prompt: str | list[int] | None
    sampling: dict[str, Any]
    messages: list[dict[str, Any]] | None = None
    echo: str = ""
    echo_logprobs: int | None = None  # completions with echo: the prompt's tokens lead the logprobs, this many top
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: written beside the choices
    cache_salt: str | None = None  # the salt sent (the request's, or its tenant's)
    speculative: bool | None = None  # False: no speculative decoding for it
    request_id: str | None = None  # its id on the wire: the HTTP request's id (and its prompt's index)
    result: GenerateResult | None = None
    offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset, per sequence
    tools: list[dict[str, Any]] | None = None  # a chat's tools, as the wire's ToolSpecs
    tool_plan: ToolPlan | None = None  # what its tool_choice asks, and how calls are read
    structured_param: str | None = None  # the body field that asked for its structured output


@dataclass
class Reply:
    """How one endpoint writes its objects (completion or chat completion)."""

    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        # The text chunk's event, as `event(self._object(".chunk", [choice], None))` writes it.
        kind = b"chat.completion.chunk" if self.chat else b"text_completion"
        self._delta_head = (b'data: {"id":' + _encode(self.id) + b',"object":"' + kind + b'","created":'
                            + b"%d" % self.created + b',"model":' + _encode(self.model) + b',"choices":[{"index":')
        self._delta_text = b',"delta":{"content":' if self.chat else b',"text":'
        self._delta_tail = (b'},' if self.chat else b',') + b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'

    def _object(self, suffix: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        kind = "chat.completion" + suffix if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}

    def logprobs(self, job: Job, sequence: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [{
                "token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode()),
                "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                                 for t in e.top_logprobs],
            } for e in entries]}
        offset = job.offsets.get(sequence, len(job.echo))
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.text)
        job.offsets[sequence] = offset
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.text: t.logprob for t in e.top_logprobs} for e in entries],
                "text_offset": offsets}

    def echo_logprobs(self, job: Job, sequence: int, logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
        """Completions with echo and logprobs: the prompt's tokens first, as OpenAI writes
        them (the first has no logprob; its text is what the others' texts leave of the prompt)."""
        entries = job.result.prompt_logprobs if job.result is not None else None
        if logprobs is None or job.echo_logprobs is None or not entries:
            return logprobs
        rest = "".join(e.text for e in entries[1:])
        first = job.echo[:len(job.echo) - len(rest)] if job.echo.endswith(rest) else ""
        tokens = [first] + [e.text for e in entries[1:]]
        offsets, offset = [], 0
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = job.echo_logprobs
        return {"tokens": tokens + logprobs["tokens"],
                "token_logprobs": [None] + [e.logprob for e in entries[1:]] + logprobs["token_logprobs"],
                "top_logprobs": [None] + [{t.text: t.logprob for t in e.top_logprobs[:top]} for e in entries[1:]]
                + logprobs["top_logprobs"],
                "text_offset": offsets + logprobs["text_offset"]}

    # ------------------------------------------------------------ streaming

    def start(self, index: int) -> bytes | None:
        """The opening event of a choice: the chat role; nothing for completions."""
        if not self.chat:
            return None
        return event(self._object(".chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}], None))

    def delta(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        if logprobs is None:
            return b"".join((self._delta_head, b"%d" % index, self._delta_text, _encode(text), self._delta_tail))
        if self.chat:
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return event(self._object(".chunk", [choice], None))

    def read_delta(self, index: int, events: list[Event], logprobs: dict[str, Any] | None = None) -> bytes:
        """A chat choice's text as its tool-call reader read it, in order: content as content
        deltas, calls as `tool_calls` deltas (a call's first entry with its id, type and name,
        then its arguments' pieces); the logprobs ride on the first."""
        out: list[bytes] = []
        text = ""
        calls: list[dict[str, Any]] = []
        for item in [*events, None]:
            if calls and not isinstance(item, (CallOpened, ArgumentsPiece)):
                out.append(self._tool_calls(index, calls, logprobs))
                calls, logprobs = [], None
            if text and not isinstance(item, str):
                out.append(self.delta(index, text, logprobs))
                text, logprobs = "", None
            if isinstance(item, str):
                text += item
            elif isinstance(item, ArgumentsPiece) and calls and calls[-1]["index"] == item.index \
                    and "id" not in calls[-1]:
                calls[-1]["function"]["arguments"] += item.text
            elif item is not None:
                if any(call["index"] == item.index for call in calls):
                    # One entry per call in a chunk: older clients do not merge two.
                    out.append(self._tool_calls(index, calls, logprobs))
                    calls, logprobs = [], None
                calls.append({"index": item.index, "id": item.id, "type": "function",
                              "function": {"name": item.name, "arguments": ""}} if isinstance(item, CallOpened)
                             else {"index": item.index, "function": {"arguments": item.text}})
        if logprobs is not None:
            out.append(self.delta(index, "", logprobs))
        return b"".join(out)

    def _tool_calls(self, index: int, calls: list[dict[str, Any]], logprobs: dict[str, Any] | None) -> bytes:
        return event(self._object(".chunk", [{"index": index, "delta": {"tool_calls": calls}, "logprobs": logprobs,
                                              "finish_reason": None}], None))

    def finish(self, index: int, reason: str) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        return event(self._object(".chunk", [choice], None))

    def usage_event(self, jobs: list[Job]) -> bytes:
        return event(self._object(".chunk", [], usage(jobs)))

    # ------------------------------------------------------------ whole

    def whole(self, jobs: list[Job]) -> dict[str, Any]:
        choices = []
        for job in jobs:
            assert job.result is not None
            for choice in job.result.choices:
                logprobs = self.logprobs(job, choice.index, choice.logprobs)
                text = job.echo + choice.text
                if self.chat:
                    message: dict[str, Any] = {"role": "assistant", "content": text}
                    reason = choice.finish_reason
                    if job.tool_plan is not None and job.tool_plan.reads_calls:
                        content, calls = parse(text, job.tool_plan)
                        if calls:
                            message = {"role": "assistant", "content": content or None,
                                       "tool_calls": [call.openai() for call in calls]}
                            reason = tool_calls_reason(reason)
                    choices.append({"index": job.base + choice.index, "message": message, "logprobs": logprobs,
                                    "finish_reason": reason})
                else:
                    choices.append({"index": job.base + choice.index, "text": text,
                                    "logprobs": self.echo_logprobs(job, choice.index, logprobs),
                                    "finish_reason": choice.finish_reason})
                    if job.prompt_logprobs is not None:
                        choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(job.result.prompt_logprobs,
                                                                              job.prompt_logprobs)
        whole = self._object("", choices, usage(jobs))
        if self.chat and jobs[0].prompt_logprobs is not None:
            whole["prompt_logprobs"] = vllm_prompt_logprobs(jobs[0].result.prompt_logprobs, jobs[0].prompt_logprobs)
        return whole


def vllm_prompt_logprobs(entries: list[PromptLogprob | None] | None, top: int) -> list[dict[str, Any] | None]:
    """vLLM's form: per prompt token (the first None), its id and its `top` alternatives'
    ids, each with its logprob, rank and text."""
    out: list[dict[str, Any] | None] = []
    for entry in entries or []:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.text}
                  for rank, t in enumerate(entry.top_logprobs[:top], 1)}
        ranked[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.text}
        out.append(ranked)
    return out


def tool_calls_reason(reason: str) -> str:
    """A choice that called tools ends with `tool_calls` (when it ended by itself)."""
    return "tool_calls" if reason == "stop" else reason


def usage(jobs: list[Job]) -> dict[str, Any]:
    """The prompt counted once per prompt (its n sequences share it), as OpenAI counts it;
    `prompt_tokens_details.cached_tokens`: those of its tokens the prefix cache held."""
    prompt = sum(job.result.usage.prompt_tokens for job in jobs if job.result is not None)
    completion = sum(job.result.usage.completion_tokens for job in jobs if job.result is not None)
    cached = sum(job.result.usage.cached_tokens for job in jobs if job.result is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
