"""What a call of the SDK returns: a whole generation (all n of its sequences), a streamed
chunk, the daemon's health."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridd.protocol.messages import Choice, PromptLogprob, Timings, TokenLogprob, Usage


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished request. `text`, `token_ids`, `finish_reason` and `logprobs` are the
    first sequence's; `choices` holds all n of them (index 0 … n−1)."""

    id: str
    text: str  # the whole completion
    token_ids: list[int]
    finish_reason: str  # stop or length (other endings raise)
    usage: Usage  # the prompt counted once, the completion tokens of every sequence
    timings: Timings
    logprobs: list[TokenLogprob] | None = None  # when asked for: one per token id
    choices: list[Choice] = field(default_factory=list)
    # When asked for (`prompt_logprobs=k`): one per prompt token, the first None.
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    id: str
    index: int  # which of the request's n sequences (0 when n = 1)
    text: str  # new text of that sequence since its previous chunk
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # when asked for: one per token id


@dataclass(frozen=True, slots=True)
class Health:
    state: str  # the daemon's lifecycle state
    ok: bool  # true when generate requests are accepted
