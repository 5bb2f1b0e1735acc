"""Structured output: a request's constraint compiled into a grammar, a matcher per
sequence that follows its output token by token, and the allowed-token bitmask of a
step's rows (`token_bitmask`), filled on the host while the GPU runs the step.

Constraints (`StructuredOutput` on the wire) compile with llguidance (the choice and its
measurement: docs/lab/experiments.md, "grammar_engines"): a JSON schema, any JSON
object, a regex, a Lark grammar (a GBNF one is translated) or a choice among strings.
Compiling runs off the serving loop (on the intake's thread, which waits at most
`structured_compile_timeout_s` for this module's own compile thread) and its result is
kept by the constraint's text, least recently used dropped first; each sequence gets its
own copy of the compiled matcher. A constraint that does not compile, or not in time, is
a `StructuredOutputError` naming the request's field.

How the state advances with the overlapped pipeline: a step's mask depends on every
token its sequences sampled before it, and the host schedules one step ahead, so the
token of step t is on the device when step t+1 is launched. The step pipeline therefore
builds step t+1's mask late: after the forward is enqueued, it retires the steps in
flight (each accepted token advances its sequence's matcher, in `Sequence.append_token`),
fills the mask while the GPU runs the forward, and enqueues sampling behind it. Only
batches with a constrained row wait so; a sequence whose grammar has ended finishes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import llguidance.torch
import msgspec
import torch

from hybridd.engine.token_bitmask import allow_all
from hybridd.log import get_logger
from hybridd.protocol.messages import StructuredOutput

if TYPE_CHECKING:
    from hybridd.engine.sequence import Sequence

log = get_logger("grammar")

# The whitespace JSON may have between its tokens: at most a line break and an indent, as
# compact and pretty-printed JSON have it, so that a model that would write whitespace
# for ever (small ones do) still reaches the end of its document.
JSON_WHITESPACE = r"(\x0A?[\x20\x09]{0,16})?"
_PUNCTUATION = frozenset("\\.^$|?*+()[]{}-#&~\"'/")


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; `field` names the request's field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: a fresh matcher, copied for each sequence that follows it."""

    kind: str
    matcher: llguidance.LLMatcher

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.matcher.deep_copy()


def _field(structured: StructuredOutput) -> str:
    return f"sampling.structured.{structured.kind}"


def choice_regex(choices: Seq[str]) -> str:
    """A regex matching exactly one of `choices` (ASCII punctuation escaped)."""
    return "(" + "|".join("".join("\\" + c if c in _PUNCTUATION else c for c in choice) for choice in choices) + ")"


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (not yet checked: the matcher does that)."""
    options = {"whitespace_pattern": JSON_WHITESPACE}
    if structured.json is not None:
        try:
            schema = msgspec.json.decode(structured.json)
        except msgspec.DecodeError as error:
            raise StructuredOutputError(_field(structured), f"is not JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(_field(structured), "a JSON schema is an object (or true)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(structured.json, defaults=options)
        except ValueError as error:
            raise StructuredOutputError(_field(structured), str(error)) from None
    if structured.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
    if structured.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(structured.regex)
    if structured.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex(choice_regex(structured.choice))
    grammar = structured.grammar or ""
    if "::=" in grammar:  # GBNF (llama.cpp's, as vLLM's guided_grammar takes it)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as error:  # noqa: BLE001  the translator raises what it likes on bad input
            raise StructuredOutputError(_field(structured), f"is not a grammar: {error}") from None
    return llguidance.LLMatcher.grammar_from_lark(grammar)


class GrammarCompiler:
    """Compiles constraints for one tokenizer, with a bounded time and an LRU cache.
    Thread-safe (the intake's thread compiles; the loop only copies matchers)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Seq[int], *, timeout_s: float = 10.0,
                 cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        # A compile that overruns its time goes on here, unwaited for (llguidance's own
        # limits end it); two threads, so that one such compile does not hold up the next.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        # The vocabulary's view for llguidance (about a second for 128k tokens) is built
        # here, beside the daemon's start, not before it is ready; the first compile waits.
        self._tokenizer = self._pool.submit(llguidance.hf.from_tokenizer, tokenizer, n_vocab=vocab_size,
                                            eos_token=list(eos_token_ids) or None)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self._tokenizer.result()

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        key = (structured.kind, _text(structured))
        with self._lock:
            if (compiled := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return compiled
        grammar = grammar_text(structured)
        future = self._pool.submit(self._matcher, grammar)
        try:
            matcher = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise StructuredOutputError(_field(structured), f"took longer than {self.timeout_s:g} s to compile "
                                        "(structured_compile_timeout_s)") from None
        if matcher.is_error():
            raise StructuredOutputError(_field(structured), _reason(matcher.get_error()))
        compiled = CompiledGrammar(structured.kind, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            # The first mask builds the lexer's start state (the slowest mask by far):
            # here, once per compiled constraint, not on the serving loop.
            scratch = allow_all(1, self.vocab_size)
            llguidance.torch.fill_next_token_bitmask(matcher.deep_copy(), scratch, 0)
        return matcher

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _text(structured: StructuredOutput) -> str:
    if structured.choice is not None:
        return "\0".join(structured.choice)
    return structured.json or structured.regex or structured.grammar or ""


def _reason(error: str) -> str:
    # llguidance prefixes its messages with where they came from; the first lines say what.
    return " ".join(error.split())[:1000]


class TokenMasks:
    """Fills the allowed-token bitmask of a step's rows from their sequences' matchers."""

    def __init__(self, vocab_size: int, max_rows: int, pin_memory: bool = False, depth: int = 4) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        # Host buffers in turn: a step's copy to the device may still be reading the one before.
        self._buffers = [allow_all(max_rows, vocab_size, pin_memory) for _ in range(depth)]
        self._turn = 0
        self._executor: llguidance.LLExecutor | None = None  # its threads, at the first constrained step

    def fill(self, seqs: Seq[Sequence]) -> torch.Tensor | None:
        """int32 [len(seqs), words]: row i allows what sequence i's grammar allows next (every
        token for a sequence without one); None when no sequence has a grammar."""
        rows = [(seq.grammar, row) for row, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        mask = self._mask(len(seqs))
        live = [(matcher, row) for matcher, row in rows if not matcher.is_error()]
        if live:
            llguidance.torch.fill_next_token_bitmask_par(self._executor_once(), live, mask)
        return mask

    def fill_verify(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]]) -> torch.Tensor | None:
        """The masks of a verify step's rows (len(drafts[i]) + 1 for sequence i, in order): a
        sequence's row j allows what its grammar allows after its draft's first j tokens
        (which its grammar accepts: `Speculator.drafts` cut them so); each matcher is left
        where it was. None when no sequence has a grammar."""
        rows, first = [], 0
        for seq, draft in zip(seqs, drafts, strict=True):
            if seq.grammar is not None:
                rows.append((seq.grammar, first, list(draft)))
            first += len(draft) + 1
        if not rows:
            return None
        mask = self._mask(first)
        live = [row for row in rows if not row[0].is_error()]
        drafted = [row for row in live if row[2]]
        undrafted = [(matcher, row) for matcher, row, draft in live if not draft]  # llguidance wants a draft there
        if drafted:
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(self._executor_once(), drafted, mask)
        if undrafted:
            llguidance.torch.fill_next_token_bitmask_par(self._executor_once(), undrafted, mask)
        return mask

    def _mask(self, rows: int) -> torch.Tensor:
        """The next host buffer's first `rows` rows, every token allowed."""
        buffer = self._buffers[self._turn % len(self._buffers)]
        self._turn += 1
        if rows > buffer.shape[0]:
            raise ValueError(f"{rows} rows, but the masks were made for {buffer.shape[0]}")
        mask = buffer[:rows]
        mask.fill_(-1)
        return mask

    def _executor_once(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor
