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
    decode: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    prefill: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS
    max_prefill_seqs: int = 8

    @classmethod
    def create(
        cls, decode: list[int] | tuple[int, ...], prefill: list[int] | tuple[int, ...], max_prefill_seqs: int = 8
    ) -> BucketPlan:
        if max_prefill_seqs <= 0:
            raise ValueError("max_prefill_seqs must be positive")
        return cls(normalize(decode, "decode_buckets"), normalize(prefill, "prefill_buckets"), max_prefill_seqs)

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
