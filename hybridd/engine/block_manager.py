"""KV-cache block allocation: which arena blocks each sequence owns.

Blocks `0 .. num_blocks-1` are real block ids of the graph generator's KV arena; a
token at position p of a sequence lives in slot `block_table[p // block_size] *
block_size + p % block_size`. Admission (`can_allocate`) keeps a watermark of free
blocks in reserve so that running sequences can still grow; growth (`append_slot`)
may use every free block.
"""

from __future__ import annotations

from collections import deque

from hybridd.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_admissible_blocks(self) -> int:
        """The most blocks one sequence can be admitted with, on an empty cache."""
        return self.num_blocks - self.watermark_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, num_tokens: int) -> bool:
        return self.num_free - self.blocks_for(num_tokens) >= self.watermark_blocks

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens (default: all of them)."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds blocks")
        n = self.blocks_for(len(seq) if num_tokens is None else num_tokens)
        if n > self.num_free:
            raise RuntimeError(f"{seq.request_id} needs {n} blocks, {self.num_free} free")
        seq.block_table = [self._take() for _ in range(n)]

    def can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or self.num_free > 0

    def append_slot(self, seq: Sequence) -> int:
        """Make room for the token at `seq.last_position`; return its slot."""
        if self._needs_block(seq):
            if not self._free:
                raise RuntimeError(f"no free KV block for {seq.request_id}")
            seq.block_table.append(self._take())
        return self.slot(seq, seq.last_position)

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks; a sequence without blocks is a no-op."""
        for block_id in reversed(seq.block_table):
            self._used.remove(block_id)
            self._free.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _needs_block(self, seq: Sequence) -> bool:
        return seq.last_position // self.block_size >= len(seq.block_table)

    def _take(self) -> int:
        block_id = self._free.popleft()
        self._used.add(block_id)
        return block_id
