"""Prompt lookup: the n-gram drafter, which needs no model.

It matches the last n tokens of a sequence (prompt and output so far) against the
earlier ones, longest n first (from `max_n` down to `min_n`), and proposes the tokens
that followed the latest earlier occurrence (a repeating span is continued as the loop
it is). Text that repeats or quotes its context
(code edits, summaries, extraction, a passage continued from the prompt) is drafted
well; other text simply gets no draft.

Each sequence keeps an index, per n, from an n-gram to where its latest occurrence
that some token followed ends; it grows with the tokens, so a proposal costs one
lookup per n, not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.drafter import NO_DRAFT, Draft


class _Index:
    """The n-grams of one sequence's tokens, each to the end of its latest occurrence
    that a token follows."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this index are in `ends`

    def extend(self, tokens: list[int]) -> None:
        # An n-gram ending at `end` (exclusive) is followed by tokens[end] when end < len(tokens).
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.ends[n][tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def continuation(self, tokens: list[int], count: int) -> list[int]:
        for n in reversed(self.sizes):
            if len(tokens) <= n:
                continue
            end = self.ends[n].get(tuple(tokens[-n:]))
            if end is not None:
                # What followed, copied on past the sequence's end as an overlapping copy
                # would (LZ77): a loop of period len(tokens) - end is drafted as that loop.
                period = len(tokens) - end
                return [tokens[end + i % period] for i in range(count)]
        return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min {min_n} <= max {max_n}")
        self.sizes = range(min_n, max_n + 1)
        self._indexes: dict[str, _Index] = {}

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[Draft]:
        drafts = []
        for seq, count in zip(seqs, max_tokens, strict=True):
            if count <= 0:
                drafts.append(NO_DRAFT)
                continue
            index = self._indexes.get(seq.request_id)
            if index is None:
                index = self._indexes[seq.request_id] = _Index(self.sizes)
            tokens = seq.token_ids
            index.extend(tokens)
            drafts.append(Draft(index.continuation(tokens, count)))
        return drafts

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
