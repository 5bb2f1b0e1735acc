"""Shape buckets: the decode batch sizes and prefill token counts that get a graph.

One place for the defaults and for the rule that picks a bucket (the smallest that
fits, found with bisect).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def normalize(buckets: list[int] | tuple[int, ...], name: str) -> tuple[int, ...]:
    if not buckets:
        raise ValueError(f"{name}: at least one bucket is required")
    if any((not isinstance(b, int)) or isinstance(b, bool) or b <= 0 for b in buckets):
        raise ValueError(f"{name}: buckets must be positive integers, got {list(buckets)}")
    return tuple(sorted(set(buckets)))


def pick(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest bucket that holds `n`, or None when `n` exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class BucketPlan:
    """The buckets that get a graph. A prefill bucket's graph holds `max_prefill_seqs`
    rows, as many sequences as a step without running streams has; a step that carries
    running streams' decode rows beside prompt chunks (chunked prefill) can have up to
    `max_rows`, and the `mixed` buckets (token counts up to such a step's budget) get a
    second graph of that many rows. Rows cost a graph even when they are padding (the
    prefill attention's programs, the LM head), so a prompt alone never pays for them."""

    decode: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    prefill: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS
    max_prefill_seqs: int = 8
    mixed: tuple[int, ...] = ()

    @classmethod
    def create(
        cls, decode: list[int] | tuple[int, ...], prefill: list[int] | tuple[int, ...], max_prefill_seqs: int = 8,
        mixed_tokens: int | None = None,
    ) -> BucketPlan:
        """`mixed_tokens`: the most tokens of a step beside running streams (the chunk
        budget); every prefill bucket up to the one that holds it gets a mixed graph
        (None: every prefill bucket; 0: none, such steps run eagerly)."""
        if max_prefill_seqs <= 0:
            raise ValueError("max_prefill_seqs must be positive")
        decode, prefill = normalize(decode, "decode_buckets"), normalize(prefill, "prefill_buckets")
        mixed: tuple[int, ...] = ()
        if decode[-1] > max_prefill_seqs and mixed_tokens != 0:
            limit = prefill[-1] if mixed_tokens is None else (pick(prefill, mixed_tokens) or prefill[-1])
            mixed = tuple(b for b in prefill if b <= limit)
        return cls(decode, prefill, max_prefill_seqs, mixed)

    @property
    def max_batch(self) -> int:
        return self.decode[-1]

    def within(self, max_batch: int) -> BucketPlan:
        """The plan with its decode buckets up to `max_batch` (one of them) only."""
        return BucketPlan(tuple(b for b in self.decode if b <= max_batch), self.prefill, self.max_prefill_seqs)

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill[-1]

    @property
    def max_rows(self) -> int:
        """Rows of the logits buffer and of every prefill graph: the most sequences one
        step can have. A chunked-prefill step carries every running stream's decode row
        beside its prompt chunks, so it can have max_batch rows, more than max_prefill_seqs."""
        return max(self.max_batch, self.max_prefill_seqs)

    def rows(self, kind: str) -> int:
        """Rows of a graph of `kind`: "prefill" or "mixed" (a decode graph's are its size)."""
        return self.max_rows if kind == "mixed" else self.max_prefill_seqs

    def step_kind(self, num_seqs: int) -> str:
        """The graph kind of a prefill step of `num_seqs` rows."""
        return "prefill" if num_seqs <= self.max_prefill_seqs or not self.mixed else "mixed"
