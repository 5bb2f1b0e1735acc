"""When a sequence stops, and which of its text may be streamed.

One `StopCriteria` per sequence, fed each new token and the text the detokenizer
produced for it. Finish reasons, in order of precedence:

- EOS (unless `ignore_eos`) or a `stop_token_ids` token -> "stop"; the token's own
  text is not emitted.
- a stop string -> "stop"; the output is cut before it. A stop string may span
  tokens, so any tail of the text that could still become one is held back: a
  streamed chunk never contains part of a stop string.
- `max_tokens` output tokens, or `max_model_len` tokens in all -> "length".

When the sequence finishes for another reason than a stop string, held-back text
is released.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from hybridd.protocol.messages import SamplingParams


@dataclass(frozen=True, slots=True)
class StopResult:
    text: str  # what may be streamed now
    finish_reason: str | None = None  # "stop" | "length" | None
    stop_reason: str | int | None = None  # the stop string or stop token that matched


class StopCriteria:
    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stop_strings = tuple(params.stop)
        self.max_model_len = max_model_len
        self.held = ""

    def check(self, token_id: int, new_text: str, num_output_tokens: int, num_tokens: int) -> StopResult:
        """Judge `token_id` and its detokenized `new_text`; the sequence, with the token
        appended, has `num_output_tokens` output tokens and `num_tokens` in all."""
        if token_id in self.eos_token_ids or token_id in self.stop_token_ids:
            return StopResult(self._release(), "stop", token_id)

        text = self.held + new_text
        cut = self._find_stop(text)
        if cut is not None:
            index, stop = cut
            self.held = ""
            return StopResult(text[:index], "stop", stop)

        if num_output_tokens >= self.params.max_tokens or num_tokens >= self.max_model_len:
            self.held = text
            return StopResult(self._release(), "length")

        hold = self._partial_stop_suffix(text)
        self.held = text[len(text) - hold :] if hold else ""
        return StopResult(text[: len(text) - hold])

    def _release(self) -> str:
        text, self.held = self.held, ""
        return text

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
