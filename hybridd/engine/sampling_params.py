"""Per-request sampling parameters and their validation.

`SamplingParams` is the single definition of what a client may ask of the sampler
and the stop criteria; `validate` is the single place their limits are enforced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridd.protocol.limits import MAX_N, MAX_TOP_LOGPROBS

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# OpenAI's documented range for presence/frequency penalties.
MAX_ABS_ADDITIVE_PENALTY = 2.0


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off; a value >= vocab size is off as well
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # sequences sharing the prompt (one prefill)
    logprobs: bool = False  # logprob of each sampled token
    top_logprobs: int = 0  # and of this many most likely alternatives

    def __post_init__(self) -> None:
        # OpenAI clients send `stop` either as one string or as a list.
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first field that is out of range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both off) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be a 64-bit signed integer or None, got {self.seed!r}")
        if (
            not _is_real(self.repetition_penalty)
            or not math.isfinite(self.repetition_penalty)
            or self.repetition_penalty <= 0
        ):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_ADDITIVE_PENALTY <= value <= MAX_ABS_ADDITIVE_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_ABS_ADDITIVE_PENALTY}, {MAX_ABS_ADDITIVE_PENALTY}], got {value!r}"
                )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
