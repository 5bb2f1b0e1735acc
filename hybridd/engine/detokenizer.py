"""Incremental detokenization of one sequence's output tokens.

Uses the prefix-offset / read-offset method of vLLM and TGI: decode a short window
that ends at the newest token, and emit only what it adds beyond the text of the
same window without the unread tokens. Decoding a window with a few tokens of left
context keeps spacing right for tokenizers whose decoding depends on the neighbour,
and text that ends in U+FFFD (a UTF-8 character split across tokens) is held back
until the character completes, so a stream never shows a replacement character
mid-way.
"""

from __future__ import annotations

from typing import Protocol

# Tokens of left context decoded with the first output token, as in vLLM.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_ids)
        self.prefix_offset = max(len(self.token_ids) - INITIAL_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text

    def flush(self) -> str:
        """Emit whatever is still held back, replacement characters included."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
