"""BlockManager: accounting, slots, boundary crossing, exhaustion, watermark."""

from __future__ import annotations

import pytest

from hybridd.engine.block_manager import BlockManager
from hybridd.model.kv_cache import slot
from hybridd.engine.sequence import Sequence


def seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(1, n + 1)))


def test_allocate_and_free_accounting():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    a, b = seq(9, "a"), seq(4, "b")
    assert bm.can_allocate(9)
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert bm.num_free == 6 and bm.usage == pytest.approx(0.4)
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    assert bm.num_free == 9 and a.block_table == []
    bm.free(a)  # freeing again is a no-op
    assert bm.num_free == 9
    with pytest.raises(RuntimeError):
        bm.allocate(b)  # already holds blocks


def test_slot_is_block_times_size_plus_offset():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    filler, s = seq(4, "f"), seq(10, "s")
    bm.allocate(filler)
    bm.allocate(s)
    slots = [slot(s.block_table, p, bm.block_size) for p in range(10)]
    expected = [s.block_table[p // 4] * 4 + p % 4 for p in range(10)]
    assert slots == expected
    assert len(set(slots)) == 10 and all(filler.block_table[0] * 4 + i not in slots for i in range(4))


def test_append_slot_allocates_only_on_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.0)
    s = seq(3)
    bm.allocate(s)
    s.append_token(100)  # position 3: last slot of block 0
    assert bm.append_slot(s) == s.block_table[0] * 4 + 3 and len(s.block_table) == 1
    s.append_token(101)  # position 4: crosses into a new block
    assert bm.append_slot(s) == s.block_table[1] * 4 + 0 and len(s.block_table) == 2
    assert bm.num_free == 2


def test_append_slot_counts_a_token_in_flight():
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0.0)
    s = seq(2)
    bm.allocate(s)
    s.num_inflight_tokens = 1  # position 2 is on the device, not yet in output_token_ids
    assert bm.append_slot(s) == s.block_table[1] * 2


def test_exhaustion():
    bm = BlockManager(num_blocks=2, block_size=2, watermark=0.0)
    s = seq(4)
    assert not bm.can_allocate(5)
    bm.allocate(s)
    assert bm.num_free == 0 and bm.usage == 1.0
    s.append_token(7)
    assert not bm.can_append(s)
    with pytest.raises(RuntimeError, match="no free KV block"):
        bm.append_slot(s)
    other = seq(1, "o")
    assert not bm.can_allocate(1)
    with pytest.raises(RuntimeError):
        bm.allocate(other)


def test_watermark_reserves_blocks_for_growth():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.2)
    assert bm.watermark_blocks == 2 and bm.num_admissible_blocks == 8
    assert bm.can_allocate(32) and not bm.can_allocate(33)
    s = seq(32)
    bm.allocate(s)
    assert not bm.can_allocate(1)  # admission stops at the watermark...
    s.append_token(0)
    assert bm.can_append(s)  # ...but growth may use the reserve
    bm.append_slot(s)
    assert bm.num_free == 1


def test_invalid_configuration():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    with pytest.raises(ValueError, match="watermark"):
        BlockManager(4, 16, watermark=1.0)
