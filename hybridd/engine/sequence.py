"""One generated sequence: its tokens, text, logprobs, status, KV blocks and timings.

A `Sequence` is the one record of a sequence's output: the scheduler appends its
tokens and text, the context generator its logprobs, and the client's final reply
is read from it. A `Sequence` is host-side state only. Its `block_table` lists the KV-arena blocks
that hold its cache; `num_computed_tokens` counts the tokens whose KV the scheduled
steps write (or that a prefix-cache hit found already written). In the overlapped pipeline a sampled token may still be on the device
when the next step is scheduled; `num_inflight_tokens` counts those.

A request for `n` sequences has n `Sequence`s with the same prompt, `index` 0 … n−1.
The first one is queued and carries the others in `forks` until its prefill, which
they share: they are forked from it there (same prompt KV, their own first token).
Sequence i of a seeded request samples with a seed derived from (seed, i), so the n
outputs are distinct and each reproducible; sequence 0 uses the seed itself.

A request with structured output gives each of its sequences a grammar matcher of its
own (`grammar`, see `hybridd.engine.grammar`), which every appended token advances.
"""

from __future__ import annotations

import enum
import random
import time
from typing import TYPE_CHECKING

from hybridd.protocol.messages import PromptLogprob, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from hybridd.engine.detokenizer import IncrementalDetokenizer
    from hybridd.engine.stop_criteria import StopCriteria

# Seeds for unseeded requests: drawn once at admission so that a preempted and
# recomputed request keeps sampling the same stream.
_seed_source = random.SystemRandom()
_SEED_MASK = 2**63 - 1


def derived_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of a request seeded with `seed` (splitmix64 of both)."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _SEED_MASK


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        index: int = 0,
        cache_salt: str | None = None,
        speculative: bool = True,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params if params is not None else SamplingParams()
        self.index = index
        self.seed: int = (derived_seed(self.params.seed, index) if self.params.seed is not None
                          else _seed_source.getrandbits(63))
        # Sequences waiting to be forked from this one at its prefill (see the module docstring).
        self.forks: list[Sequence] = []
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Prefix cache: the salt that keys this sequence's blocks (sequences share KV
        # blocks only under the same salt), the hash chain of its full blocks so far,
        # and how many prompt tokens its first admission found cached.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        self.num_inflight_tokens = 0
        # Whether the engine may draft tokens for it (a request can turn speculation off).
        self.speculative = speculative
        # (step id, row) of the step that samples the in-flight token, for the
        # overlapped pipeline to gather it from that step's device output.
        self.inflight_source: tuple[int, int] | None = None
        # Timings (time.monotonic()): received, first scheduled, first and latest output token, finished.
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # Text output, filled by the scheduler's postprocess when a tokenizer is set.
        self.detokenizer: IncrementalDetokenizer | None = None
        self.stop_criteria: StopCriteria | None = None
        self.output_text = ""
        self.new_text = ""  # what the last postprocess added to output_text
        # One per output token when the request asked for logprobs, else None.
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs else None
        # Structured output: what the output may be next (an llguidance matcher), else None.
        self.grammar = None
        # One per prompt token recorded so far when the request asked for its prompt's
        # logprobs (the first token's is None: nothing precedes it); sequence 0 only.
        self.prompt_logprobs: list[PromptLogprob | None] | None = (
            [None] if getattr(self.params, "prompt_logprobs", None) is not None and index == 0 else None)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not all recorded yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def last_position(self) -> int:
        """Position of the newest token, counting one still on the device."""
        return len(self) + self.num_inflight_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.consume_token(token_id)

    @property
    def grammar_ended(self) -> bool:
        """The structured output is complete (its end of sequence accepted): nothing may follow."""
        return self.grammar is not None and (self.grammar.is_stopped() or self.grammar.is_error())

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
