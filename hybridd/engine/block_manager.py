"""KV-cache block allocation: which arena blocks each sequence owns.

Blocks `0 .. num_blocks-1` are real block ids of the graph generator's KV arena; a
token lives in the slot of `hybridd.model.kv_cache.slot`. Admission (`can_allocate`) keeps a watermark of free
blocks in reserve so that running sequences can still grow; growth (`append_slot`)
may use every free block.

Sequences forked from one prompt (a request's `n` sequences) share the prompt's full
blocks: a block is counted by the sequences that hold it and returns to the free list
when the last one lets go. The prompt's last, partly filled block is not shared, since
each sequence writes its own tokens into it: a fork gets a fresh block that the step
pipeline fills with a device copy of the original (`fork` returns the pair).
"""

from __future__ import annotations

from collections import deque

from hybridd.engine.sequence import Sequence
from hybridd.model import kv_cache


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
        self._refs: dict[int, int] = {}  # block -> how many sequences hold it

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
        return kv_cache.blocks_for(num_tokens, self.block_size)

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

    def fork_blocks(self, num_tokens: int) -> int:
        """New blocks one fork of a `num_tokens`-long sequence takes: its copy of the last
        block when that block is partly filled, else none."""
        return 1 if num_tokens % self.block_size else 0

    def can_allocate_forked(self, num_tokens: int, num_forks: int) -> bool:
        """Room for a sequence of `num_tokens` and `num_forks` forks of it, above the watermark."""
        need = self.blocks_for(num_tokens) + num_forks * self.fork_blocks(num_tokens)
        return self.num_free - need >= self.watermark_blocks

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` the blocks of `parent`'s tokens: the full ones shared, the partly
        filled last one as a fresh block. Returns (source, destination) of the block to
        copy on the device, or None when every block is full."""
        if child.block_table:
            raise RuntimeError(f"{child.request_id} already holds blocks")
        full = len(parent) // self.block_size
        shared = parent.block_table[:full]
        for block_id in shared:
            self._refs[block_id] += 1
        child.block_table = list(shared)
        if len(parent.block_table) == full:
            return None
        if not self._free:
            raise RuntimeError(f"{child.request_id} needs a block to fork into, none free")
        copy = self._take()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or self.num_free > 0

    def append_slot(self, seq: Sequence) -> int:
        """Make room for the token at `seq.last_position`; return its slot."""
        if self._needs_block(seq):
            if not self._free:
                raise RuntimeError(f"no free KV block for {seq.request_id}")
            seq.block_table.append(self._take())
        return kv_cache.slot(seq.block_table, seq.last_position, self.block_size)

    def free(self, seq: Sequence) -> None:
        """Let go of all of `seq`'s blocks (a shared one is freed by its last holder); a
        sequence without blocks is a no-op."""
        for block_id in reversed(seq.block_table):
            self._refs[block_id] -= 1
            if not self._refs[block_id]:
                del self._refs[block_id]
                self._free.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _needs_block(self, seq: Sequence) -> bool:
        return seq.last_position // self.block_size >= len(seq.block_table)

    def _take(self) -> int:
        block_id = self._free.popleft()
        self._refs[block_id] = 1
        return block_id
