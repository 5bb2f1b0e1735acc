"""Scheduler: continuous batching over a paged toy model whose output depends on
reading its own KV back through slot mappings and block tables, so a wrong slot,
block table or recompute changes the tokens."""

from __future__ import annotations

import weakref

import pytest
import torch

from hybridd.engine.block_manager import BlockManager
from hybridd.protocol.messages import SamplingParams
from hybridd.engine.scheduler import BatchKind, ScheduledBatch, Scheduler
from hybridd.engine.sequence import Sequence, SequenceStatus

VOCAB = 1000


def next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 + len(context)) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class PagedToyModel:
    """Writes each step's input tokens into a paged 'KV cache' by slot mapping and
    predicts from the context read back through the block tables."""

    def __init__(self, bm: BlockManager) -> None:
        self.bs = bm.block_size
        self.kv = torch.full((bm.num_blocks * bm.block_size,), -1, dtype=torch.int64)

    def step(self, batch: ScheduledBatch, input_ids: torch.Tensor) -> list[int]:
        input_ids = torch.as_tensor(input_ids)
        assert int(batch.inputs.query_start_loc[-1]) == input_ids.numel() == batch.inputs.positions.size
        assert bool((input_ids >= 0).all())
        self.kv[batch.inputs.slot_mapping] = input_ids
        out = []
        for row in range(batch.num_seqs):
            last = int(batch.inputs.logits_indices[row])
            assert last == int(batch.inputs.query_start_loc[row + 1]) - 1
            length = int(batch.inputs.seq_lens[row])
            assert int(batch.inputs.positions[last]) == length - 1
            pos = torch.arange(length)
            slots = torch.as_tensor(batch.inputs.block_tables[row]).long()[pos // self.bs] * self.bs + pos % self.bs
            out.append(next_token(self.kv[slots].tolist()))
        return out


_MODELS: weakref.WeakKeyDictionary[BlockManager, PagedToyModel] = weakref.WeakKeyDictionary()


def toy_model(sched: Scheduler) -> PagedToyModel:
    """The one toy model over `sched`'s KV blocks: its cache outlives a run, as the
    daemon's does, so a later run's prefix-cache hits read what earlier runs wrote."""
    bm = sched.block_manager
    if bm not in _MODELS:
        _MODELS[bm] = PagedToyModel(bm)
    return _MODELS[bm]


def check_block_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    # Sequences share blocks of a common prefix (the prefix cache); a held block is never free.
    held = {b for s in sched.running for b in s.block_table}
    assert len(held) + bm.num_free == bm.num_blocks, "blocks leaked or held while free"
    assert all(not s.block_table for s in sched.waiting)


def run(sched: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    model = toy_model(sched)
    batches = []
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            assert not sched.has_work
            return batches
        check_block_invariants(sched)
        batches.append(batch)
        rows = model.step(batch, batch.inputs.input_ids)
        sched.postprocess(batch, [rows[r] for r in batch.sample_rows])
    raise AssertionError("scheduler did not finish")


def run_overlapped(sched: Scheduler, max_steps: int = 10_000) -> tuple[list[ScheduledBatch], set[str]]:
    """Schedule step N+1 before postprocessing step N; inputs still 'on the device'
    are gathered from earlier steps' sampled tokens by (step, row). Returns the
    batches and the ids of the requests that were preempted."""
    model = toy_model(sched)
    preempted: set[str] = set()
    sampled: dict[int, torch.Tensor] = {}
    pending: ScheduledBatch | None = None
    batches = []
    for _ in range(max_steps):
        batch = sched.schedule() if sched.has_work else None
        if batch is not None:
            check_block_invariants(sched)
            preempted |= {s.request_id for s in sched.waiting if s.status is SequenceStatus.PREEMPTED}
            ids = torch.from_numpy(batch.inputs.input_ids.copy())
            for i in (batch.input_src_step >= 0).nonzero().flatten().tolist() if batch.inputs_on_device else ():
                ids[i] = sampled[int(batch.input_src_step[i])][int(batch.input_src_row[i])]
            rows = model.step(batch, ids)
            sampled[batch.step_id] = torch.tensor([rows[r] for r in batch.sample_rows], dtype=torch.int64)
            batches.append(batch)
        if pending is not None:
            sched.postprocess(pending, sampled[pending.step_id].tolist())
        pending = batch
        if pending is None and not sched.has_work:
            return batches, preempted
    raise AssertionError("scheduler did not finish")


def make(num_blocks=64, block_size=4, max_batch=8, max_prefill_tokens=64, max_model_len=128, **kw) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, watermark=kw.pop("watermark", 0.0))
    return Scheduler(bm, max_batch, max_prefill_tokens, max_model_len, **kw)


def requests(n: int, seed: int = 0, max_tokens=(3, 20), prompt_len=(1, 30)) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        length = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (), generator=gen))
        prompt = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        mt = int(torch.randint(max_tokens[0], max_tokens[1] + 1, (), generator=gen))
        seqs.append(Sequence(f"req-{i}", prompt, SamplingParams(max_tokens=mt)))
    return seqs


def assert_complete(seqs: list[Sequence]) -> None:
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "length", s
        assert s.output_token_ids == reference(s.prompt_token_ids, s.params.max_tokens), s.request_id


def test_many_sequences_of_different_lengths_complete_correctly():
    sched = make(num_blocks=128)
    seqs = requests(30)
    for s in seqs:
        sched.add(s)
    batches = run(sched)
    assert_complete(seqs)
    assert sched.block_manager.num_free == sched.block_manager.num_blocks
    prefills = [b for b in batches if b.kind is BatchKind.PREFILL]
    decodes = [b for b in batches if b.kind is BatchKind.DECODE]
    # Each prompt's final chunk once: nothing was preempted here.
    assert sum(len(b.sample_rows) - b.num_decode_rows for b in prefills) == 30
    for b in prefills:
        assert b.num_tokens <= sched.max_prefill_tokens
        assert int(b.inputs.query_start_loc[-1]) == b.num_tokens
    for b in decodes:
        assert 1 <= b.num_seqs <= sched.max_batch
        assert b.inputs.block_tables.shape == (b.num_seqs, sched.block_table_width)
        assert not b.inputs_on_device
    assert max(b.num_decode_rows for b in batches) == sched.max_batch


def test_prompts_are_chunked_within_the_budget_and_share_it():
    """Prompts are admitted in order and share each step's budget: the short ones end in
    the first steps while the long one goes on in chunks, each starting where the KV
    written so far ends; decode rows come first and take their share of the budget."""
    sched = make(max_prefill_tokens=20)
    seqs = [Sequence(f"r{i}", [i + 1] * 7, SamplingParams(max_tokens=3)) for i in range(4)]
    long = Sequence("long", list(range(1, 46)), SamplingParams(max_tokens=3))
    seqs.insert(1, long)
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert [s.request_id for s in first.seqs] == ["r0", "long", "r1", "r2", "r3"]
    assert first.num_tokens == 20 and first.partial_rows == frozenset(range(5))
    rows = toy_model(sched).step(first, first.inputs.input_ids)
    sched.postprocess(first, [rows[r] for r in first.sample_rows])
    batches = [first] + run(sched)
    assert_complete(seqs)
    chunks_of_long = [b for b in batches if b.is_prefill and long in b.seqs[b.num_decode_rows:]]
    assert len(chunks_of_long) > 2
    ends = [int(b.inputs.seq_lens[b.seqs.index(long)]) for b in chunks_of_long]
    assert ends == sorted(ends) and ends[-1] == 45
    short_done = max(i for i, b in enumerate(batches) for s in b.sampled_seqs if s.request_id.startswith("r")
                     and s.num_output_tokens and b.is_prefill)
    assert short_done < batches.index(chunks_of_long[-1]), "a short prompt waited for the long one's prefill"
    for b in batches:
        assert b.num_tokens <= max(sched.max_prefill_tokens, b.num_decode_rows)
        assert all(len(b.seqs[r].token_ids) for r in range(b.num_decode_rows))


def test_fair_shares_split_the_budget():
    from hybridd.engine.scheduler import fair_shares

    assert fair_shares([7, 7, 100], 20) == [7, 7, 6]
    assert fair_shares([100, 3, 100], 21) == [9, 3, 9]
    assert fair_shares([1, 1], 10) == [1, 1]
    assert fair_shares([50, 50, 50], 3) == [1, 1, 1]
    assert sum(fair_shares([9, 40, 2, 77], 64)) == 64


def test_max_prefill_seqs_caps_rows_per_prefill():
    sched = make(max_prefill_seqs=3)
    for s in requests(5, prompt_len=(2, 4)):
        sched.add(s)
    assert sched.schedule().num_seqs == 3


def test_max_batch_caps_admission():
    sched = make(max_batch=2, max_prefill_tokens=100)
    for s in requests(5, prompt_len=(2, 4)):
        sched.add(s)
    batch = sched.schedule()
    assert batch.num_seqs == 2 and len(sched.running) == 2 and len(sched.waiting) == 3
    sched.postprocess(batch, [5, 6])
    assert sched.schedule().kind is BatchKind.DECODE  # no room: decode the running two


def test_preemption_by_recompute_completes_all_tokens():
    sched = make(num_blocks=16, block_size=4, max_batch=8, max_prefill_tokens=64)
    seqs = requests(10, seed=1, max_tokens=(20, 30), prompt_len=(5, 12))
    for s in seqs:
        sched.add(s)
    preempted: set[str] = set()
    model = toy_model(sched)
    while (batch := sched.schedule()) is not None:
        check_block_invariants(sched)
        preempted |= {s.request_id for s in sched.waiting if s.status is SequenceStatus.PREEMPTED}
        if batch.is_prefill:
            # A re-prefill covers prompt and the output generated so far, in chunks, after
            # the blocks of them still in the prefix cache.
            for row, s in enumerate(batch.seqs[batch.num_decode_rows:], start=batch.num_decode_rows):
                lo, hi = batch.inputs.query_start_loc[row : row + 2].tolist()
                start = int(batch.inputs.positions[lo])
                assert batch.inputs.input_ids[lo:hi].tolist() == s.token_ids[start:start + hi - lo]
        rows = model.step(batch, batch.inputs.input_ids)
        sched.postprocess(batch, [rows[r] for r in batch.sample_rows])
    assert len(preempted) >= 2
    assert_complete(seqs)
    assert sched.block_manager.num_free == 16


def test_preempted_sequence_returns_to_front_of_queue():
    sched = make(num_blocks=4, block_size=2, max_batch=4, max_prefill_tokens=64)
    a = Sequence("a", [1, 2], SamplingParams(max_tokens=4))
    b = Sequence("b", [3, 4], SamplingParams(max_tokens=4))
    c = Sequence("c", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=1))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"]  # c needs 3 blocks, 2 are free
    sched.postprocess(batch, [10, 11])
    batch = sched.schedule()  # decode at position 2: each takes its second block
    assert batch.kind is BatchKind.DECODE and [s.request_id for s in batch.seqs] == ["a", "b"]
    assert sched.block_manager.num_free == 0
    sched.postprocess(batch, [12, 13])
    sched.postprocess(sched.schedule(), [14, 15])  # position 3 still fits
    batch = sched.schedule()  # position 4: a needs a block, none is free: b is preempted
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert b.status is SequenceStatus.PREEMPTED and b.output_token_ids == [11, 13, 15] and not b.block_table


def test_overlapped_pipeline_one_step_ahead():
    sched = make(num_blocks=20, block_size=4, max_batch=4, max_prefill_tokens=32)
    seqs = requests(12, seed=2, max_tokens=(4, 25), prompt_len=(2, 15))
    for s in seqs:
        sched.add(s)
    batches, preempted = run_overlapped(sched)
    assert_complete(seqs)
    assert any(b.inputs_on_device for b in batches)
    assert preempted  # including sequences preempted with a token in flight
    assert sched.block_manager.num_free == 20


def test_overlapped_pipeline_computes_nothing_past_a_length_limit():
    # One step ahead, a sequence's last token is still in flight when the next step is
    # planned; max_tokens and max_model_len are known then, so no step is wasted on it.
    sched = make(num_blocks=200, max_model_len=40)
    seqs = requests(6, seed=3, max_tokens=(1, 12), prompt_len=(2, 10))
    long_one = Sequence("long", list(range(1, 31)), SamplingParams(max_tokens=100))  # max_model_len ends it
    for s in [*seqs, long_one]:
        sched.add(s)
    batches, preempted = run_overlapped(sched)
    assert not preempted
    assert_complete(seqs)
    assert long_one.finish_reason == "length" and len(long_one) == 40
    for s in [*seqs, long_one]:
        steps = sum(any(q is s for q in b.sampled_seqs) for b in batches)
        assert steps == s.num_output_tokens, (s.request_id, steps, s.num_output_tokens)


def test_abort_before_start_while_running_and_twice():
    sched = make()
    waiting, running, other = (Sequence(r, [1, 2, 3], SamplingParams(max_tokens=10)) for r in "wro")
    sched.add(running)
    sched.add(other)
    batch = sched.schedule()
    sched.postprocess(batch, [4, 5])
    sched.add(waiting)

    assert sched.abort("w") is waiting
    assert waiting.finish_reason == "cancelled" and waiting not in sched.waiting
    free_before = sched.block_manager.num_free
    assert sched.abort("r") is running
    assert running.finish_reason == "cancelled" and not running.block_table
    assert sched.block_manager.num_free == free_before + 1
    assert sched.abort("r") is None and sched.abort("w") is None and sched.abort("nope") is None

    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["o"]
    sched.postprocess(batch, [6])
    assert other.output_token_ids == [5, 6]


def test_abort_with_token_in_flight_discards_it():
    sched = make()
    s = Sequence("x", [1, 2, 3], SamplingParams(max_tokens=10))
    sched.add(s)
    batch = sched.schedule()
    assert sched.abort("x") is s
    assert sched.postprocess(batch, [42]) == []
    assert s.output_token_ids == [] and s.num_inflight_tokens == 0
    assert sched.schedule() is None and sched.block_manager.num_free == sched.block_manager.num_blocks


def test_eos_and_max_tokens_finish():
    sched = make(eos_token_ids=[0])
    s = Sequence("eos", [5, 6], SamplingParams(max_tokens=10))
    t = Sequence("len", [5, 6], SamplingParams(max_tokens=2))
    u = Sequence("ign", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    for x in (s, t, u):
        sched.add(x)
    batch = sched.schedule()
    assert sched.postprocess(batch, [7, 7, 0]) == []
    batch = sched.schedule()
    finished = sched.postprocess(batch, [0, 8, 9])
    assert finished == [s, t, u]
    assert (s.finish_reason, t.finish_reason, u.finish_reason) == ("stop", "length", "length")
    assert s.stop_reason == 0 and u.output_token_ids == [0, 9]


def test_max_model_len_finishes_with_length():
    sched = make(max_model_len=6)
    s = Sequence("m", [1, 2, 3, 4], SamplingParams(max_tokens=100))
    sched.add(s)
    run(sched)
    assert s.finish_reason == "length" and len(s) == 6


def test_rejects_requests_that_can_never_run():
    sched = make(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence("a", [1] * 64))
    with pytest.raises(ValueError, match="num_blocks"):
        sched.add(Sequence("b", [1] * 30, SamplingParams(max_tokens=10)))  # 40 tokens > 32 slots
    sched.add(Sequence("c", [1] * 30, SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(Sequence("c", [1]))


def test_invalid_configuration():
    bm = BlockManager(16, 4)
    with pytest.raises(ValueError, match="block_table_width"):
        Scheduler(bm, 8, 64, max_model_len=32, block_table_width=4)


# ---------------------------------------------------------------- n sequences (forks)


def run_forked_overlapped(sched: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    """`run_overlapped` for batches with forks: a fork samples its row's prediction,
    and the listed KV blocks are copied after the step wrote them (as the pipeline does)."""
    model = toy_model(sched)
    bs = sched.block_manager.block_size
    sampled: dict[int, list[int]] = {}
    pending: ScheduledBatch | None = None
    batches = []
    for _ in range(max_steps):
        batch = sched.schedule() if sched.has_work else None
        if batch is not None:
            bm = sched.block_manager
            held = {b for s in sched.running for b in s.block_table}
            assert len(held) + bm.num_free == bm.num_blocks, "blocks leaked"
            ids = torch.from_numpy(batch.inputs.input_ids.copy())
            for i in (batch.input_src_step >= 0).nonzero().flatten().tolist() if batch.inputs_on_device else ():
                ids[i] = sampled[int(batch.input_src_step[i])][int(batch.input_src_row[i])]
            rows = model.step(batch, ids)
            for src, dst in batch.kv_copies:
                model.kv[dst * bs:(dst + 1) * bs] = model.kv[src * bs:(src + 1) * bs]
            sampled[batch.step_id] = [rows[r] for r in batch.sample_rows]
            batches.append(batch)
        if pending is not None:
            sched.postprocess(pending, sampled[pending.step_id])
        pending = batch
        if pending is None and not sched.has_work:
            return batches
    raise AssertionError("scheduler did not finish")


def forked(request_id: str, prompt: list[int], n: int, max_tokens: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    seqs = [Sequence(request_id if i == 0 else f"{request_id}#{i}", prompt, params, index=i) for i in range(n)]
    seqs[0].forks = seqs[1:]
    return seqs


@pytest.mark.parametrize("prompt_len", [6, 8], ids=["partial-block", "full-blocks"])
def test_forks_share_one_prefill_and_read_the_prompt_kv(prompt_len):
    sched = make(num_blocks=64, block_size=4)
    prompt = list(range(100, 100 + prompt_len))
    group = forked("g", prompt, 3, 12)
    sched.add(group[0])
    others = requests(4, seed=3)
    for s in others:
        sched.add(s)
    batches = run_forked_overlapped(sched)
    prefill = next(b for b in batches if group[0] in b.seqs)
    assert [f for _, f in prefill.forks] == group[1:]
    assert sum(1 for b in batches for s in b.seqs[b.num_decode_rows:] if s.request_id.startswith("g")) == 1, \
        "the prompt is prefilled once"
    assert len(prefill.kv_copies) == (2 if prompt_len % 4 else 0)
    for seq in group:
        assert seq.output_token_ids == reference(prompt, 12), seq.request_id
    assert_complete(others)
    assert sched.block_manager.num_free == 64


def test_forks_survive_preemption_and_free_every_block():
    sched = make(num_blocks=14, block_size=4, max_batch=8)
    groups = [forked(f"g{i}", list(range(10 * i, 10 * i + 7)), 3, 14) for i in range(3)]
    for group in groups:
        sched.add(group[0])
    run_forked_overlapped(sched)
    assert sched.num_preemptions > 0
    for group in groups:
        for seq in group:
            assert seq.output_token_ids == reference(group[0].prompt_token_ids, 14), seq.request_id
    assert sched.block_manager.num_free == 14


def test_aborting_a_waiting_parent_queues_its_forks_alone():
    sched = make(num_blocks=64, block_size=4, max_batch=8)
    blocker = requests(1, seed=5)[0]
    group = forked("g", list(range(9)), 3, 5)
    sched.add(group[0])
    assert sched.abort("g") is group[0] and group[0].finish_reason == "cancelled"
    assert list(sched.waiting) == group[1:] and all(s.forks == [] for s in group)
    sched.add(blocker)
    run_forked_overlapped(sched)
    for seq in group[1:]:
        assert seq.output_token_ids == reference(group[0].prompt_token_ids, 5)
    # aborting a fork that still waits for its prefill takes it out of the group
    group = forked("h", list(range(9)), 3, 5)
    sched.add(group[0])
    assert sched.abort("h#2") is group[2] and group[0].forks == [group[1]]
    run_forked_overlapped(sched)
    assert group[1].output_token_ids == group[0].output_token_ids == reference(group[0].prompt_token_ids, 5)


def test_n_that_can_never_run_together_is_refused():
    with pytest.raises(ValueError, match="max_batch"):
        make(max_batch=2).add(forked("g", [1, 2, 3], 3, 4)[0])
    with pytest.raises(ValueError, match="KV blocks"):
        make(num_blocks=4, block_size=4).add(forked("g", [1, 2, 3, 4, 5], 4, 2)[0])
