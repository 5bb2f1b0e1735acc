"""The prefix cache: the hash chain over full blocks, refcounts, LRU eviction, salts,
and the scheduler that starts a sequence after its cached blocks — checked against the
paged toy model, whose output is wrong whenever a block it reads holds the wrong tokens."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.block_hashes import block_hash, chain_root, extend_block_hashes
from hybridd.engine.block_manager import BlockManager
from hybridd.engine.scheduler import BatchKind, Scheduler
from hybridd.engine.sequence import Sequence, SequenceStatus
from hybridd.protocol.messages import SamplingParams

from tests.test_engine_scheduler import (
    VOCAB, PagedToyModel, assert_complete, forked, make, reference, requests, run, run_forked_overlapped,
    run_overlapped, toy_model,
)

BS = 4


def computed(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` as the scheduler does and count its KV as written; returns its hit."""
    hit = bm.allocate(seq)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(seq)
    bm.cache_blocks(seq)
    return hit


# ---------------------------------------------------------------- the hash chain


def test_a_block_key_covers_every_token_before_it_and_the_salt():
    tokens = list(range(12))
    keys: list[bytes] = []
    extend_block_hashes(keys, tokens, BS, 3, None)
    assert len(set(keys)) == 3
    assert keys[1] == block_hash(keys[0], tokens[4:8])
    # the same block of tokens after another first block is another key
    other: list[bytes] = []
    extend_block_hashes(other, [99] + tokens[1:], BS, 3, None)
    assert other[1] != keys[1] and other[2] != keys[2]
    # extending in steps is the same chain
    stepwise: list[bytes] = []
    for n in range(1, 4):
        extend_block_hashes(stepwise, tokens, BS, n, None)
    assert stepwise == keys
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, BS, 3, "tenant-a")
    assert not set(salted) & set(keys)
    assert chain_root("a") != chain_root("b") != chain_root(None)
    with pytest.raises(ValueError, match="full blocks"):
        extend_block_hashes([], tokens, BS, 4, None)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_extending_the_chain_in_one_pass_keys_each_block_as_block_hash_does(block_size):
    """The keys of several blocks at once, from any point of the chain, are the chain of
    `block_hash` over each block (ids up to the 64-bit range, a salt): keys in the cache
    stay the same whatever the number of blocks keyed at a time."""
    tokens = [(i * 2_654_435_761) % (1 << 40) for i in range(8 * block_size + 3)]
    for salt in (None, "tenant-a"):
        expected = [chain_root(salt)]
        for index in range(8):
            expected.append(block_hash(expected[-1], tokens[index * block_size:(index + 1) * block_size]))
        for start in (0, 1, 5, 8):
            keys = expected[1:start + 1]
            extend_block_hashes(keys, tokens, block_size, 8, salt)
            assert keys == expected[1:]


# ---------------------------------------------------------------- the block manager


def test_a_new_sequence_reuses_the_longest_cached_prefix():
    bm = BlockManager(16, BS, watermark=0.0)
    a = Sequence("a", list(range(10)))
    assert computed(bm, a) == 0
    bm.free(a)
    assert bm.num_free == 16 and bm.num_cached_blocks == 2  # the partly filled third block is not cached
    b = Sequence("b", list(range(9)) + [77])  # all but the last token shared
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a_blocks(bm, list(range(8)))
    assert b.num_cached_tokens == 8
    c = Sequence("c", [5] + list(range(1, 10)))  # differs in the first block: nothing shared
    assert bm.allocate(c) == 0 and c.num_cached_tokens == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (30, 8)


def a_blocks(bm: BlockManager, prefix: list[int]) -> list[int]:
    """The cached blocks of a sequence starting with `prefix` (an uncounted lookup)."""
    return bm.cached_prefix(Sequence("probe", prefix + [0]))


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, BS, watermark=0.0)
    a = Sequence("a", list(range(8)))
    computed(bm, a)
    bm.free(a)
    again = Sequence("again", list(range(8)))
    assert bm.allocate(again) == 4  # not 8: the last token's logits are needed
    longer = Sequence("longer", list(range(9)))
    assert bm.allocate(longer) == 8


def test_shared_blocks_are_counted_and_freed_by_their_last_holder():
    bm = BlockManager(8, BS, watermark=0.0)
    a = Sequence("a", list(range(9)))
    computed(bm, a)
    b = Sequence("b", list(range(9)))
    assert computed(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_free == 8 - 4
    bm.free(a)
    assert bm.num_free == 8 - 3  # the shared two are still held by b
    # the blocks b holds are never handed out, however many are asked for
    others = [Sequence(f"o{i}", [100 + i] * 4) for i in range(5)]
    for other in others:
        bm.allocate(other)
    assert not set(b.block_table) & {blk for o in others for blk in o.block_table}
    assert bm.num_free == 0 and not bm.can_allocate(1)
    bm.free(b)
    for other in others:
        bm.free(other)
    assert bm.num_free == 8


def test_unheld_cached_blocks_are_evicted_least_recently_used_tail_first():
    bm = BlockManager(8, BS, watermark=0.0)
    old, new = Sequence("old", list(range(9))), Sequence("new", list(range(50, 59)))
    computed(bm, old)
    computed(bm, new)
    bm.free(old)  # old's blocks were released first: they are the least recently used
    bm.free(new)
    assert bm.num_cached_blocks == 4 and bm.num_free == 8
    # the two never used blocks go first, then old's: its partly filled block, then its
    # last full block before its first
    taker = Sequence("t", [7] * 16)
    bm.allocate(taker)
    assert len(a_blocks(bm, list(range(8)))) == 1, "old's second block was evicted, its first kept"
    assert len(a_blocks(bm, list(range(50, 58)))) == 2
    bm.free(taker)
    # a hit makes new's blocks recently used again: the next demand evicts others first
    reuse = Sequence("reuse", list(range(50, 59)))
    assert computed(bm, reuse) == 8
    bm.free(reuse)
    filler = Sequence("f", [8] * 20)
    bm.allocate(filler)
    assert a_blocks(bm, list(range(8))) == []
    assert len(a_blocks(bm, list(range(50, 58)))) == 2


def test_two_salts_never_share_a_block_and_one_salt_does():
    bm = BlockManager(16, BS, watermark=0.0)
    prompt = list(range(13))
    first = Sequence("a1", prompt, cache_salt="tenant-a")
    computed(bm, first)
    assert computed(bm, Sequence("b1", prompt, cache_salt="tenant-b")) == 0
    assert computed(bm, Sequence("none", prompt)) == 0
    second = Sequence("a2", prompt, cache_salt="tenant-a")
    assert computed(bm, second) == 12 and second.block_table[:3] == first.block_table[:3]


def test_blocks_filled_during_decode_become_cached():
    bm = BlockManager(16, BS, watermark=0.0)
    a = Sequence("a", [1, 2, 3, 4, 5])
    computed(bm, a)
    for token in (6, 7, 8, 9, 10):
        a.append_token(token)
        bm.append_slot(a)
        a.num_computed_tokens = a.last_position + 1
        bm.cache_blocks(a)
    assert bm.num_cached_blocks == 2  # tokens 1-4 and 5-8; 9-10 fill half a block
    follow_up = Sequence("b", list(range(1, 11)) + [11])
    assert bm.allocate(follow_up) == 8


def test_a_token_still_on_the_device_is_not_hashed():
    bm = BlockManager(16, BS, watermark=0.0)
    a = Sequence("a", [1, 2, 3])
    computed(bm, a)
    a.num_inflight_tokens = 1  # position 3 is sampled but not yet on the host
    bm.append_slot(a)
    a.num_computed_tokens = 4
    bm.cache_blocks(a)
    assert bm.num_cached_blocks == 0
    a.num_inflight_tokens = 0
    a.append_token(4)
    bm.cache_blocks(a)
    assert bm.num_cached_blocks == 1


def test_forks_share_the_cached_prefix_and_admission_counts_revived_blocks():
    bm = BlockManager(6, BS, watermark=0.0)
    computed(bm, (warm := Sequence("w", list(range(10)))))
    bm.free(warm)
    parent, *children = forked("g", list(range(10)), 3, 4)
    # 3 blocks of its own minus 2 cached, 2 fork copies, 2 cached blocks leaving the free queue
    assert bm.can_admit(parent)
    assert bm.allocate(parent) == 8
    for child in children:
        bm.fork(parent, child)
        assert child.block_table[:2] == parent.block_table[:2] and child.num_cached_tokens == 8
    assert bm.num_free == 6 - 5
    for seq in (parent, *children):
        bm.free(seq)
    assert bm.num_free == 6


def test_turned_off_nothing_is_cached_or_counted():
    bm = BlockManager(16, BS, watermark=0.0, enable_prefix_caching=False)
    a = Sequence("a", list(range(9)))
    computed(bm, a)
    bm.free(a)
    assert bm.allocate(Sequence("b", list(range(9)))) == 0
    assert bm.num_cached_blocks == 0 and (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


# ---------------------------------------------------------------- the scheduler over the toy model


def test_a_multi_turn_chat_prefills_only_the_new_turn():
    sched = make(num_blocks=64, block_size=BS, max_model_len=256)
    history = list(range(300, 311))
    written = 0  # tokens whose KV the previous turn wrote: all but its last output token
    for turn in range(4):
        seq = Sequence(f"turn{turn}", history, SamplingParams(max_tokens=6))
        sched.add(seq)
        batches = run(sched)
        prefill = batches[0]
        assert prefill.kind is BatchKind.PREFILL
        # the previous turn's prompt and output are cached, up to its last full block
        assert seq.num_cached_tokens == written // BS * BS
        assert int(prefill.inputs.positions[0]) == seq.num_cached_tokens
        assert prefill.num_tokens == len(history) - seq.num_cached_tokens
        assert seq.output_token_ids == reference(history, 6)
        written = len(seq) - 1
        history = seq.token_ids + [400 + turn] * 5
    bm = sched.block_manager
    assert bm.prefix_cache_hits > 0 and bm.num_free == bm.num_blocks


def test_prompts_sharing_all_but_one_token():
    sched = make(num_blocks=64, block_size=BS)
    base = list(range(500, 523))
    first = Sequence("first", base + [1], SamplingParams(max_tokens=5))
    sched.add(first)
    run(sched)
    variants = [Sequence(f"v{i}", base + [2 + i], SamplingParams(max_tokens=5)) for i in range(3)]
    for seq in variants:
        sched.add(seq)
    batches = run(sched)
    assert batches[0].num_tokens == 3 * (24 - 20)  # each row: the tokens after 5 cached blocks
    assert all(seq.num_cached_tokens == 20 for seq in variants)
    assert_complete([first, *variants])


def test_a_cached_prefix_evicted_mid_run_is_recomputed():
    sched = make(num_blocks=12, block_size=BS, max_batch=4)
    prefix = list(range(700, 716))
    first = Sequence("first", prefix + [1], SamplingParams(max_tokens=3))
    sched.add(first)
    run(sched)
    # others fill the cache; the prefix is evicted while they run, then asked for again
    crowd = requests(6, seed=11, max_tokens=(10, 16), prompt_len=(9, 15))
    for seq in crowd:
        sched.add(seq)
    again = Sequence("again", prefix + [2], SamplingParams(max_tokens=3))
    sched.add(again)
    run_overlapped(sched)
    assert again.num_cached_tokens < 16
    assert_complete([first, *crowd, again])


def test_n_sequences_of_a_cached_prompt():
    sched = make(num_blocks=64, block_size=BS)
    prompt = list(range(9))
    warm = Sequence("warm", prompt, SamplingParams(max_tokens=2))
    sched.add(warm)
    run(sched)
    group = forked("g", prompt, 3, 8)
    sched.add(group[0])
    batches = run_forked_overlapped(sched)
    assert batches[0].num_tokens == 1 and len(batches[0].forks) == 2
    for seq in group:
        assert seq.num_cached_tokens == 8 and seq.output_token_ids == reference(prompt, 8), seq.request_id
    assert sched.block_manager.num_free == 64


def test_preemption_under_kv_pressure_hits_its_own_blocks_again():
    sched = make(num_blocks=16, block_size=BS, max_batch=8)
    seqs = requests(10, seed=1, max_tokens=(20, 30), prompt_len=(5, 12))
    for seq in seqs:
        sched.add(seq)
    queries = sum(len(seq) for seq in seqs)
    run_overlapped(sched)
    assert sched.num_preemptions > 0
    assert_complete(seqs)
    # re-admissions are not queries: the counters are the clients' prompts alone
    assert sched.block_manager.prefix_cache_queries == queries
    assert sched.block_manager.num_free == 16


def test_prompts_at_max_model_len():
    sched = make(num_blocks=64, block_size=BS, max_model_len=32)
    prompt = list(range(800, 831))  # 31 tokens: one to generate
    for name in ("cold", "warm"):
        seq = Sequence(name, prompt, SamplingParams(max_tokens=5))
        sched.add(seq)
        run(sched)
        assert seq.finish_reason == "length" and seq.output_token_ids == reference(prompt, 1)
        assert seq.num_cached_tokens == (0 if name == "cold" else 28)


def test_with_and_without_the_cache_the_outputs_match():
    outputs = {}
    for enabled in (True, False):
        bm = BlockManager(20, BS, watermark=0.0, enable_prefix_caching=enabled)
        sched = Scheduler(bm, 4, 64, 128)
        shared = list(range(900, 913))
        seqs = [Sequence(f"s{i}", shared + [i] * (i % 3 + 1), SamplingParams(max_tokens=12)) for i in range(8)]
        for seq in seqs:
            sched.add(seq)
        run_overlapped(sched)
        outputs[enabled] = [seq.output_token_ids for seq in seqs]
        assert (bm.prefix_cache_hits > 0) is enabled
    assert outputs[True] == outputs[False]


# ---------------------------------------------------------------- keys registered after the step's send


def test_a_cold_prompt_is_keyed_one_block_before_its_step_and_the_rest_after():
    """The lookup keys a cold prompt's first block only; the scheduled step's blocks are
    keyed and registered at the block manager's next use (the next scheduling)."""
    sched = make(num_blocks=64, block_size=BS)
    cold = Sequence("cold", list(range(1000, 1014)), SamplingParams(max_tokens=2))  # 3 full blocks and 2 tokens
    sched.add(cold)
    sched.schedule()
    assert len(cold.block_hashes) == 1
    assert sched.block_manager.num_cached_blocks == 3 and len(cold.block_hashes) == 3


def _stepped(model: PagedToyModel, batch, sampled: dict[int, list[int]]) -> None:
    """Run `batch` on the toy model, its inputs still on the device gathered from the
    earlier steps' sampled tokens (the overlapped pipeline)."""
    ids = torch.from_numpy(batch.inputs.input_ids.copy())
    for i in (batch.input_src_step >= 0).nonzero().flatten().tolist() if batch.inputs_on_device else ():
        ids[i] = sampled[int(batch.input_src_step[i])][int(batch.input_src_row[i])]
    rows = model.step(batch, ids)
    for src, dst in batch.kv_copies:
        model.kv[dst * model.bs:(dst + 1) * model.bs] = model.kv[src * model.bs:(src + 1) * model.bs]
    sampled[batch.step_id] = [rows[r] for r in batch.sample_rows]


def test_a_second_prompt_scheduled_before_the_deferred_keys_are_registered_finds_them():
    """B, with A's prefix, is admitted in the scheduling right after A's step, A's token
    still in flight and A's blocks' keys not computed yet: B's lookup registers them
    first, starts after A's blocks (the same blocks) and reads the right KV through them."""
    sched = make(num_blocks=64, block_size=BS)
    bm = sched.block_manager
    model, sampled = toy_model(sched), {}
    prefix = list(range(1100, 1112))
    a = Sequence("a", prefix + [1, 2], SamplingParams(max_tokens=6))
    b = Sequence("b", prefix + [3], SamplingParams(max_tokens=6))
    sched.add(a)
    first = sched.schedule()
    assert bm._deferred and len(a.block_hashes) == 1  # A's blocks offered, not keyed or registered
    _stepped(model, first, sampled)
    sched.add(b)
    # B's lookup straight on the block manager, before anything else used it: it hits.
    assert bm.cached_prefix(b) == a.block_table[:3]
    second = sched.schedule()
    assert second.seqs == [a, b] and b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert second.num_tokens == 2  # A's decode row and B's last token
    _stepped(model, second, sampled)
    sched.postprocess(first, sampled[first.step_id])
    sched.postprocess(second, sampled[second.step_id])
    run_overlapped(sched)
    assert_complete([a, b])


def test_a_deferred_offer_registers_the_blocks_of_its_time():
    """An offer fixes its blocks when made: what the sequence computes after it is
    registered by a later offer, not by the deferred one (as offering at once would)."""
    bm = BlockManager(16, BS, watermark=0.0)
    a = Sequence("a", list(range(13)))
    bm.allocate(a)
    a.status = SequenceStatus.RUNNING
    a.num_computed_tokens = 4
    bm.defer_cache_blocks(a)
    a.num_computed_tokens = 12  # a later chunk, not offered yet
    assert bm.cached_prefix(Sequence("probe", list(range(13)))) == a.block_table[:1]
    bm.defer_cache_blocks(a)
    assert bm.cached_prefix(Sequence("probe", list(range(13)))) == a.block_table[:3]


class RegisteredAtOnce(BlockManager):
    """The block manager as it was: every offer registered when made."""

    def defer_cache_blocks(self, seq: Sequence) -> None:
        self.cache_blocks(seq)


def _shared_prefix_workload(seed: int) -> list[list[Sequence]]:
    """Waves of requests over a few shared prefixes (some with n sequences), added while
    the earlier ones run: chunked prompts, cache hits on blocks registered a step ago,
    eviction and preemption under a small KV cache."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(0, VOCAB, (int(torch.randint(4, 26, (), generator=gen)),), generator=gen).tolist()
                for _ in range(3)]
    waves = []
    for wave in range(6):
        seqs = []
        for i in range(int(torch.randint(1, 4, (), generator=gen))):
            prefix = prefixes[int(torch.randint(0, 3, (), generator=gen))]
            tail = torch.randint(0, VOCAB, (int(torch.randint(0, 7, (), generator=gen)),), generator=gen).tolist()
            max_tokens = int(torch.randint(2, 12, (), generator=gen))
            n = 2 if int(torch.randint(0, 4, (), generator=gen)) == 0 else 1
            seqs.append(forked(f"w{wave}-{i}", prefix + tail + [wave, i], n, max_tokens))
        waves.append(seqs)
    return waves


@pytest.mark.parametrize("seed", range(6))
def test_deferred_registration_schedules_exactly_as_registering_at_once(seed):
    """The same waves through the block manager that registers at once and through the
    one that defers to after the send: every step's rows, block tables and cached
    prefixes, and the cache's index after every step, are the same."""
    traces = []
    for manager in (RegisteredAtOnce, BlockManager):
        bm = manager(14, BS, watermark=0.0)
        sched = Scheduler(bm, 4, 16, 128, chunk_tokens=8)
        model = PagedToyModel(bm)
        waves = _shared_prefix_workload(seed)
        trace, sampled, pending = [], {}, None
        for step in range(10_000):
            if step % 3 == 0 and waves:
                for group in waves.pop(0):
                    sched.add(group[0])
            batch = sched.schedule() if sched.has_work else None
            if batch is not None:
                _stepped(model, batch, sampled)
                bm.register_deferred()  # what the next use of the block manager does first
                rows = [(seq.request_id, list(seq.block_table), seq.num_cached_tokens) for seq in batch.seqs]
                trace.append((batch.kind, rows, sorted(bm._cached.items())))
            if pending is not None:
                sched.postprocess(pending, sampled[pending.step_id])
            pending = batch
            if pending is None and not sched.has_work and not waves:
                break
        assert bm.prefix_cache_hits > 0 and bm.num_free == bm.num_blocks
        traces.append((trace, bm.prefix_cache_hits, sched.num_preemptions))
    assert traces[0] == traces[1]
