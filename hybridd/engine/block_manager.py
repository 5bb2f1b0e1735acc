"""KV-cache block allocation and the prefix cache: which arena blocks each sequence
holds, and which full blocks of KV already written a new sequence can reuse.

Blocks `0 .. num_blocks-1` are real block ids of the graph generator's KV arena; a
token lives in the slot of `hybridd.model.kv_cache.slot`. Admission (`can_admit`) keeps
a watermark of free blocks in reserve so that running sequences can still grow; growth
(`append_slot`) may use every free block.

A block is counted by the sequences that hold it and becomes free when the last one
lets go. Sequences forked from one prompt (a request's `n` sequences) share the
prompt's full blocks; the prompt's last, partly filled block is not shared, since each
sequence writes its own tokens into it: a fork gets a fresh block that the step
pipeline fills with a device copy of the original (`fork` returns the pair).

Prefix cache (vLLM's design: `v1/core/block_pool.py`): a full block whose KV a step
writes is indexed by its key in the hash chain of `block_hashes` (its tokens, every
token before them, the request's `cache_salt`). A new sequence starts with the longest
run of cached blocks that begins its tokens and prefills only the rest, from the
first position after them; at least its last token is always computed, for the
logits it samples from. A cached block that no sequence holds stays in the free queue
with its KV: it is reused on a hit, and evicted only when the queue hands it out as a
fresh block. The free queue is the LRU: blocks are handed out from its front and
return to its back, a sequence's last block first, so that the tail of a prefix goes
before its head. A block some sequence holds is never in the queue, so it is never
evicted; a block in the cache is full, so no sequence writes into it. Registering a
block when its step is scheduled is safe: the steps run in order, so every later
reader or writer of it runs after that step.

A new sequence's lookup keys its blocks only as far as it needs: the first alone, the
rest when that one hits, so a cold prompt hashes one block before its step is sent.
The scheduler offers a scheduled step's blocks with `defer_cache_blocks`: which blocks
is fixed then, their keys and their registration wait for the block manager's next use
(the next scheduling, a lookup, a block handed out or let go: after the step's send)
and run in the order offered. Nothing changes the cache, those blocks or their tables
in between, so the cache holds the same whenever anything reads or changes it.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridd.engine.block_hashes import extend_block_hashes
from hybridd.engine.sequence import Sequence, SequenceStatus
from hybridd.model import kv_cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = least recently used
        self._refs: dict[int, int] = {}  # block -> how many sequences hold it
        self._cached: dict[bytes, int] = {}  # block key -> the block holding that KV
        self._key_of: dict[int, bytes] = {}  # the inverse, for eviction
        self._registered: dict[str, int] = {}  # request id -> how many of its first blocks were offered to the cache
        self._deferred: list[tuple[Sequence, int]] = []  # (sequence, its full blocks) offered, not registered yet
        # Prompt tokens of newly admitted sequences, and how many of them were found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included: each can be handed out."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        self.register_deferred()
        return len(self._cached)

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
        """Room above the watermark for `num_tokens` tokens in fresh blocks."""
        return self.num_free - self.blocks_for(num_tokens) >= self.watermark_blocks

    def fork_blocks(self, num_tokens: int) -> int:
        """New blocks one fork of a `num_tokens`-long sequence takes: its copy of the last
        block when that block is partly filled, else none."""
        return 1 if num_tokens % self.block_size else 0

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` would start with: the longest run of its first full
        blocks found in the cache, short of its last token. Keys only what the lookup
        reads: the first block's, and the others' once that one is cached."""
        if not self.enable_prefix_caching:
            return []
        self.register_deferred()
        most = (len(seq) - 1) // self.block_size
        if not most:
            return []
        hashes = seq.block_hashes
        if not hashes:
            extend_block_hashes(hashes, self._tokens(seq, 1), self.block_size, 1, seq.cache_salt)
        cached = self._cached
        block = cached.get(hashes[0])
        if block is None:
            return []
        if len(hashes) < most:
            extend_block_hashes(hashes, self._tokens(seq, most), self.block_size, most, seq.cache_salt)
        hits = [block]
        for key in hashes[1:most]:
            block = cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        """Room above the watermark for `seq` (its cached prefix reused) and the forks it
        carries. A cached block no one holds leaves the free queue when reused. `hits`:
        its `cached_prefix`, when the caller looked it up (an admission looks up once)."""
        if hits is None:
            hits = self.cached_prefix(seq)
        fresh = self.blocks_for(len(seq)) - len(hits) + len(seq.forks) * self.fork_blocks(len(seq))
        revived = sum(1 for block in hits if block not in self._refs) if hits else 0
        return self.num_free - fresh - revived >= self.watermark_blocks

    def allocate(self, seq: Sequence, num_tokens: int | None = None, hits: list[int] | None = None) -> int:
        """Give `seq` blocks for its first `num_tokens` tokens (default: all of them),
        starting with its cached prefix (`hits`, when the caller looked it up with no
        change to the cache since); return how many of its tokens that prefix holds,
        whose KV is already written. A new sequence's query and hits are counted."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds blocks")
        if hits is None:
            hits = self.cached_prefix(seq)
        else:
            self.register_deferred()
        fresh = self.blocks_for(len(seq) if num_tokens is None else num_tokens) - len(hits)
        revived = sum(1 for block in hits if block not in self._refs) if hits else 0
        if max(fresh, 0) + revived > self.num_free:
            raise RuntimeError(f"{seq.request_id} needs {max(fresh, 0) + revived} blocks, {self.num_free} free")
        for block in hits:
            self._hold(block)
        seq.block_table = hits + self._take_many(fresh)
        self._registered[seq.request_id] = len(hits)
        cached_tokens = len(hits) * self.block_size
        if seq.status is SequenceStatus.WAITING:
            seq.num_cached_tokens = cached_tokens
            if self.enable_prefix_caching:
                self.prefix_cache_queries += len(seq)
                self.prefix_cache_hits += cached_tokens
        return cached_tokens

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` the blocks of `parent`'s tokens: the full ones shared, the partly
        filled last one as a fresh block. Returns (source, destination) of the block to
        copy on the device, or None when every block is full."""
        if child.block_table:
            raise RuntimeError(f"{child.request_id} already holds blocks")
        self.register_deferred()
        full = len(parent) // self.block_size
        shared = parent.block_table[:full]
        for block_id in shared:
            self._refs[block_id] += 1
        child.block_table = list(shared)
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_tokens = parent.num_cached_tokens
        self._registered[child.request_id] = min(self._registered.get(parent.request_id, 0), full)
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

    def reserve(self, seq: Sequence, last_position: int) -> int:
        """Blocks for `seq`'s positions up to `last_position` (a verify step's draft
        tokens), as far as free blocks reach; returns how many positions past
        `seq.last_position` its blocks then hold, at most up to `last_position`."""
        while len(seq.block_table) * self.block_size <= last_position and self._free:
            seq.block_table.append(self._take())
        held = min(last_position, len(seq.block_table) * self.block_size - 1)
        return max(0, held - seq.last_position)

    def trim(self, seq: Sequence) -> None:
        """Let go of `seq`'s blocks past its tokens: those a verify step reserved for
        draft tokens the target rejected. They were never offered to the cache."""
        self.register_deferred()
        keep = self.blocks_for(len(seq))
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self._refs[block_id] -= 1
            if not self._refs[block_id]:
                del self._refs[block_id]
                self._free[block_id] = None

    def cache_blocks(self, seq: Sequence) -> None:
        """Offer the cache `seq`'s full blocks whose KV the scheduled steps write
        (`num_computed_tokens`) and whose tokens the host knows (a token sampled on the
        device is not in `seq` yet). A key already cached keeps its block."""
        if not self.enable_prefix_caching:
            return
        self.register_deferred()
        self._register(seq, self._offered(seq))

    def defer_cache_blocks(self, seq: Sequence) -> None:
        """`cache_blocks(seq)` as of now, keyed and registered at the block manager's
        next use: a scheduled step's blocks after the step's send."""
        if self.enable_prefix_caching and (full := self._offered(seq)) > self._registered.get(seq.request_id, 0):
            self._deferred.append((seq, full))

    def register_deferred(self) -> None:
        """Register what `defer_cache_blocks` offered, in the order offered. Until then
        nothing has changed the cache, the offered blocks or their sequences' tables."""
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for seq, full in deferred:
                self._register(seq, full)

    def _offered(self, seq: Sequence) -> int:
        """How many of `seq`'s first blocks are full, written and of tokens on the host."""
        return min(seq.num_computed_tokens, len(seq), len(seq.block_table) * self.block_size) // self.block_size

    def _tokens(self, seq: Sequence, blocks: int) -> list[int]:
        """A list that begins with `seq`'s tokens of its first `blocks` blocks: its prompt
        when they are all in it (`token_ids` copies prompt and output into a new list)."""
        return seq.prompt_token_ids if blocks * self.block_size <= seq.num_prompt_tokens else seq.token_ids

    def _register(self, seq: Sequence, full: int) -> None:
        """Index `seq`'s blocks from the first not offered yet up to `full` by their keys."""
        start = self._registered.get(seq.request_id, 0)
        if full <= start:
            return
        if len(seq.block_hashes) < full:
            extend_block_hashes(seq.block_hashes, self._tokens(seq, full), self.block_size, full, seq.cache_salt)
        for index in range(start, full):
            block = seq.block_table[index]
            key = seq.block_hashes[index]
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key
        self._registered[seq.request_id] = full

    def free(self, seq: Sequence) -> None:
        """Let go of all of `seq`'s blocks (a shared one is freed by its last holder); its
        full computed blocks stay cached. A sequence without blocks is a no-op."""
        self.cache_blocks(seq)
        for block_id in reversed(seq.block_table):
            self._refs[block_id] -= 1
            if not self._refs[block_id]:
                del self._refs[block_id]
                self._free[block_id] = None
        self._registered.pop(seq.request_id, None)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _needs_block(self, seq: Sequence) -> bool:
        return seq.last_position // self.block_size >= len(seq.block_table)

    def _hold(self, block_id: int) -> None:
        """One more holder of a cached block (out of the free queue if it was unheld)."""
        if block_id in self._refs:
            self._refs[block_id] += 1
        else:
            del self._free[block_id]
            self._refs[block_id] = 1

    def _take_many(self, count: int) -> list[int]:
        """`count` fresh blocks: the least recently used free ones, evicted from the cache."""
        self.register_deferred()
        free, key_of, cached, refs = self._free, self._key_of, self._cached, self._refs
        taken = []
        for _ in range(count):
            block_id, _ = free.popitem(last=False)
            key = key_of.pop(block_id, None)
            if key is not None:
                del cached[key]
            refs[block_id] = 1
            taken.append(block_id)
        return taken

    def _take(self) -> int:
        """A fresh block: the least recently used free one, evicted from the cache."""
        return self._take_many(1)[0]
