"""Incremental detokenization of one sequence's output tokens.

The prefix-offset / read-offset method of vLLM and TGI: decode a short window that
ends at the newest token, and emit only what it adds beyond the text of the same window
without the unread tokens. Decoding a window with a few tokens of left context keeps
spacing right for tokenizers whose decoding depends on the neighbour, and text that
ends in U+FFFD (a UTF-8 character split across tokens) is held back until the character
completes, so a stream never shows a replacement character mid-way.

For a tokenizer backed by the `tokenizers` library (a "fast" tokenizer that does not
clean up tokenization spaces), that library's `DecodeStream` runs the method in Rust,
token by token; other tokenizers take two Python-side decodes a token
(docs/lab/experiments.md, "bench_detokenizer", compares the two). A decode step detokenizes one
token per sequence on the context generator's critical path.
"""

from __future__ import annotations

from typing import Any, Protocol

# Tokens of left context decoded with the first output token, as in vLLM.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of one sequence's output, token by token. The output ids are the
    sequence's own (passed to each call); only the prompt's last few ids are kept
    here, as the first output tokens' left context."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context = list(prompt_ids[max(len(prompt_ids) - INITIAL_CONTEXT_TOKENS, 0) :])
        # Offsets into the context followed by the output ids.
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self._backend, self._stream = _decode_stream(tokenizer, self.context, skip_special_tokens)
        self._fed = 0  # output ids fed to the stream
        self._emitted = 0  # output ids fed when it last returned text

    def add(self, output_ids: list[int]) -> str:
        """The text that the newest of `output_ids` (the output so far) completes, possibly empty."""
        if self._stream is None:
            return self._add_window(output_ids)
        text = ""
        for token in output_ids[self._fed :]:
            self._fed += 1
            chunk = self._stream.step(self._backend, token)
            if chunk:
                text += chunk
                self._emitted = self._fed
        return text

    def _add_window(self, output_ids: list[int]) -> str:
        end = len(self.context) + len(output_ids)
        prefix_text = self._decode(output_ids, self.prefix_offset, self.read_offset)
        full_text = self._decode(output_ids, self.prefix_offset, end)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, end
        return full_text[len(prefix_text) :]

    def flush(self, output_ids: list[int]) -> str:
        """Emit whatever is still held back, replacement characters included."""
        end = len(self.context) + len(output_ids)
        if self._stream is not None:  # the window's offsets, from what the stream has emitted
            self.read_offset = len(self.context) + self._emitted
            self.prefix_offset = max(self.read_offset - INITIAL_CONTEXT_TOKENS, 0)
            self._fed = self._emitted = len(output_ids)
        prefix_text = self._decode(output_ids, self.prefix_offset, self.read_offset)
        full_text = self._decode(output_ids, self.prefix_offset, end)
        self.prefix_offset = self.read_offset = end
        return full_text[len(prefix_text) :]

    def _decode(self, output_ids: list[int], start: int, end: int) -> str:
        n = len(self.context)
        window = output_ids[start - n : end - n] if start >= n else self.context[start:] + output_ids[: end - n]
        return self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)


def _decode_stream(tokenizer: Any, context: list[int], skip_special_tokens: bool) -> tuple[Any, Any]:
    """The `tokenizers` backend and a `DecodeStream` primed with `context`, or (None, None)
    where the window path must serve: no such backend, a tokenizer whose `decode` cleans up
    tokenization spaces (the stream would not), or a `tokenizers` without the stream."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None, None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None, None
    try:
        stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # a tokenizers release without `ids`: prime it with the context, output dropped
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token in context:
            stream.step(backend, token)
    return backend, stream
