"""The graph runner's bucket selection, padding, budget and eviction, with the real
runner code on the CPU (where a "graph" replays the same step body eagerly)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from hybridd.model import KVCache, StepInputs, load_model
from hybridd.runtime.buckets import BucketPlan, pick
from hybridd.runtime.graph_runner import GraphRunner, StepShape
from hybridd.runtime.step_buffers import StepBuffers
from tests.tiny_models import build_tiny_model

BLOCK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", path)
    return load_model(path, dtype=torch.float32)


def make_runner(model, decode=(1, 2, 4, 8), prefill=(16, 32, 64), budget=1 << 40, **kw):
    plan = BucketPlan.create(list(decode), list(prefill), max_prefill_seqs=4)
    kv = KVCache.allocate(model.config, 64, BLOCK, torch.float32, "cpu")
    buffers = StepBuffers.allocate(max(plan.max_prefill_tokens, plan.max_batch), plan.max_rows, 16, model.config.vocab_size, "cpu")
    return GraphRunner(model, kv, buffers, plan, memory_budget_bytes=budget, **kw)


def run_step(runner: GraphRunner, step: StepInputs) -> StepShape:
    """What the two workers do for one step: the context generator writes its rows, the
    graph generator runs it."""
    runner.buffers.write(step)
    return runner.run(step.is_prefill, step.num_tokens, max(step.num_seqs, step.num_logit_rows))


@torch.inference_mode()
@pytest.mark.parametrize("captured", [True, False], ids=["graph", "eager"])
def test_a_prefill_step_gives_the_logits_of_every_row_its_sequences_list(model, captured):
    """Rows per sequence as the scheduler lists them (a sequence's last k tokens): the
    logits of each such token, in order, through a replayed prefill graph and eagerly;
    the next step, with one row each, reads no stale row."""
    runner = make_runner(model)
    if captured:  # 7 logits rows: more than max_prefill_seqs, so the mixed graph of max_rows rows
        assert runner._capture("mixed", 32)
    prompts, tables = [[5, 9, 11, 3, 7], list(range(3, 20))], [[0, 1, 2], [3, 4, 5]]
    step = StepInputs.prefill(prompts, tables, BLOCK, logit_rows=[5, 2])
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4, 20, 21]
    shape = run_step(runner, step)
    assert shape.graph == captured
    ref_kv = KVCache.allocate(model.config, 64, BLOCK, torch.float32, "cpu")
    hidden = model(StepInputs.prefill(prompts, tables, BLOCK), ref_kv)
    expected = model.compute_logits(hidden, torch.tensor([0, 1, 2, 3, 4, 20, 21]))
    assert torch.allclose(runner.buffers.logits[:7], expected, rtol=1e-5, atol=1e-5)
    run_step(runner, StepInputs.prefill([[8, 8, 8]], [[6]], BLOCK))
    assert runner.buffers.logits_indices[:7].tolist() == [2, 0, 0, 0, 0, 0, 0]


def test_pick_smallest_bucket_that_fits():
    buckets = (1, 2, 4, 8, 16, 24, 32)
    assert [pick(buckets, n) for n in (1, 2, 3, 5, 17, 24, 25, 32, 33)] == [1, 2, 4, 8, 24, 24, 32, 32, None]
    with pytest.raises(ValueError, match="decode_buckets"):
        BucketPlan.create([0, 4], [16])


def test_a_prompt_alone_replays_a_graph_of_max_prefill_seqs_rows_and_a_mixed_step_one_of_max_rows():
    """Padding rows cost a graph (the prefill attention's programs, the LM head): a step of
    prompts alone takes a prefill graph of max_prefill_seqs rows; only a step with more
    rows, decode rows beside prompt chunks, takes a mixed graph of max_rows, and only
    token counts up to the chunk budget get one."""
    plan = BucketPlan.create([1, 8, 32], [16, 64, 256, 1024], max_prefill_seqs=8, mixed_tokens=200)
    assert plan.mixed == (16, 64, 256)
    assert (plan.rows("prefill"), plan.rows("mixed"), plan.max_rows) == (8, 32, 32)
    assert [plan.step_kind(n) for n in (1, 8, 9, 32)] == ["prefill", "prefill", "mixed", "mixed"]
    alone = BucketPlan.create([1, 4], [16, 64], max_prefill_seqs=8)
    assert alone.mixed == () and alone.step_kind(8) == "prefill" and alone.rows("prefill") == alone.max_rows
    assert BucketPlan.create([1, 32], [16, 64], max_prefill_seqs=8, mixed_tokens=0).mixed == ()


@torch.inference_mode()
def test_padded_graph_steps_equal_plain_forward(model):
    """Prefill and decode through padded buckets give the logits of the unpadded forward,
    and padded rows write nothing to the KV cache."""
    runner = make_runner(model)
    runner.capture_decode_graphs()
    for size in runner.plan.prefill:
        assert runner._capture("prefill", size)
    prompts = [[5, 9, 11, 3, 7], list(range(3, 20)), [42] * 9]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    ref_kv = KVCache.allocate(model.config, 64, BLOCK, torch.float32, "cpu")

    shape = run_step(runner, StepInputs.prefill(prompts, tables, BLOCK))
    # 31 tokens pad to 32, 3 seqs to max_prefill_seqs (a prompt alone never pays for a mixed step's rows)
    assert (shape.graph, shape.tokens, shape.seqs) == (True, 32, runner.plan.max_prefill_seqs)
    ref = model.forward_logits(StepInputs.prefill(prompts, tables, BLOCK), ref_kv)
    assert torch.allclose(runner.buffers.logits[:3], ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(runner.kv_cache.arena[:, :, :9], ref_kv.arena[:, :, :9], atol=1e-6)
    assert runner.kv_cache.arena[:, :, 9:-1].abs().sum() == 0  # nothing written past real blocks

    tokens = ref.argmax(-1).tolist()
    positions = [len(p) for p in prompts]
    for _ in range(6):
        shape = run_step(runner, StepInputs.decode(tokens, positions, tables, BLOCK))
        assert (shape.graph, shape.tokens) == (True, 4)
        ref = model.forward_logits(StepInputs.decode(tokens, positions, tables, BLOCK), ref_kv)
        assert torch.allclose(runner.buffers.logits[:3], ref, rtol=1e-5, atol=1e-5)
        tokens = ref.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    assert torch.allclose(runner.kv_cache.arena[:, :, :9], ref_kv.arena[:, :, :9], atol=1e-6)
    decode4 = runner.stats[("decode", 4)]
    assert decode4.replays == 6 and decode4.eager_runs == 0


@torch.inference_mode()
def test_mixed_steps_of_a_full_batch_and_prompt_chunks_replay_mixed_graphs(model):
    """A chunked-prefill step carries a decode row for every running stream before its
    prompt chunk: with a full batch (max_batch rows, more than max_prefill_seqs) it replays
    a captured prefill bucket. Its decode rows give the logits of a decode step, the
    prompt's final chunk those of the whole prompt prefilled at once, and the chunks write
    the KV the whole prompt writes."""
    runner = make_runner(model)
    for kind, size in [("prefill", s) for s in runner.plan.prefill] + [("mixed", s) for s in runner.plan.mixed]:
        assert runner._capture(kind, size)
    plan = runner.plan
    streams = plan.max_batch - 1
    assert streams + 1 > plan.max_prefill_seqs
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (5 + i,), generator=g).tolist() for i in range(streams)]
    long_prompt = torch.randint(3, 300, (40,), generator=g).tolist()
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(streams)]
    long_table = list(range(3 * streams, 3 * streams + 6))
    ref_kv = KVCache.allocate(model.config, 64, BLOCK, torch.float32, "cpu")

    shape = run_step(runner, StepInputs.prefill(prompts, tables, BLOCK))
    assert (shape.graph, shape.seqs) == (True, plan.max_rows)
    ref = model.forward_logits(StepInputs.prefill(prompts, tables, BLOCK), ref_kv)
    assert torch.allclose(runner.buffers.logits[:streams], ref, rtol=1e-5, atol=1e-5)
    tokens, positions = ref.argmax(-1).tolist(), [len(p) for p in prompts]

    for lo, hi in ((0, 20), (20, 40)):
        step = StepInputs.prefill([[t] for t in tokens] + [long_prompt[lo:hi]], tables + [long_table], BLOCK,
                                  start_positions=positions + [lo])
        shape = run_step(runner, step)
        assert (shape.graph, shape.tokens, shape.seqs) == (True, 32, plan.max_rows), shape
        ref = model.forward_logits(StepInputs.decode(tokens, positions, tables, BLOCK), ref_kv)
        assert torch.allclose(runner.buffers.logits[:streams], ref, rtol=1e-4, atol=1e-4)
        tokens, positions = ref.argmax(-1).tolist(), [p + 1 for p in positions]
    whole = model.forward_logits(StepInputs.prefill([long_prompt], [long_table], BLOCK), ref_kv)
    assert torch.allclose(runner.buffers.logits[streams], whole[0], rtol=1e-4, atol=1e-4)
    used = 3 * streams + 5  # the long prompt's 40 tokens fill 5 blocks
    assert torch.allclose(runner.kv_cache.arena[:, :, :used], ref_kv.arena[:, :, :used], atol=1e-5)
    assert runner.stats[("mixed", 32)].replays == 2 and runner.stats[("mixed", 32)].eager_runs == 0


def test_written_steps_are_padded_past_their_rows():
    """`write` leaves every row past a step's own as padding (slot -1, position 0, length-1
    sequences over block 0, starting where the real tokens end), whatever larger step the
    alternating host mirror held before: graphs read it with no padding pass of their own."""
    buffers = StepBuffers.allocate(64, 8, 4, 32, "cpu")
    big = StepInputs.prefill([list(range(3, 30)), [7] * 20, [9] * 10], [[1, 2, 3, 4], [5, 6, 7], [8, 9]], BLOCK)
    small = StepInputs.prefill([[5, 6, 7]], [[3]], BLOCK)
    for step in (big, big, small, StepInputs.decode([4, 5], [3, 9], [[3], [4, 5]], BLOCK), small):
        buffers.write(step)
        n, s = step.num_tokens, step.num_seqs
        assert buffers.input_ids[:n].tolist() == step.input_ids.tolist()
        assert buffers.slot_mapping[:n].tolist() == step.slot_mapping.tolist()
        assert buffers.query_start_loc[: s + 1].tolist() == step.query_start_loc.tolist()
        assert (buffers.input_ids[n:] == 0).all() and (buffers.positions[n:] == 0).all()
        assert (buffers.slot_mapping[n:] == -1).all()
        assert (buffers.seq_lens[s:] == 1).all() and (buffers.logits_indices[s:] == 0).all()
        assert (buffers.block_tables[s:] == 0).all()
        assert (buffers.query_start_loc[s + 1 :] == n).all()
        width = step.block_tables.shape[1]
        assert (buffers.block_tables[:s, width:] == 0).all()


def test_uncaptured_buckets_run_eagerly_and_count(model):
    runner = make_runner(model)
    shape = run_step(runner, StepInputs.decode([5, 6, 7], [3, 4, 5], [[0], [1], [2]], BLOCK))
    assert not shape.graph and shape.tokens == 3
    assert runner.stats[("decode", 4)].eager_runs == 1
    # Over the largest bucket: eager at the exact size.
    assert not runner.plan_step(False, 9, 9).graph
    assert not runner.plan_step(True, 65, 1).graph
    # A prefill graph holds max_prefill_seqs rows; a mixed graph as many as a step can have
    # (max_rows), past max_prefill_seqs.
    plan = runner.plan
    assert not runner.plan_step(True, 20, 5).graph
    runner._capture("prefill", 64)
    runner._capture("mixed", 64)
    assert plan.max_prefill_seqs < 5 < plan.max_rows
    assert runner.plan_step(True, 20, 3) == StepShape(True, 64, plan.max_prefill_seqs, True, 64)
    assert runner.plan_step(True, 20, 5) == StepShape(True, 64, plan.max_rows, True, 64)
    assert not runner.plan_step(True, 20, plan.max_rows + 1).graph


def test_the_snapshot_lists_every_bucket_with_every_field(model):
    """`status` reads the buckets from the graph generator's snapshot: each bucket's every
    field, as the dataclass holds them (captured, counted, disabled ones alike)."""
    runner = make_runner(model)
    run_step(runner, StepInputs.decode([5, 6, 7], [3, 4, 5], [[0], [1], [2]], BLOCK))
    runner._capture("prefill", 64)
    runner.stats[("decode", 8)].disabled = "over the memory budget"
    buckets = runner.snapshot()["buckets"]
    assert buckets == [dataclasses.asdict(stats) for stats in runner.stats.values()]
    assert {"kind": "decode", "size": 4, "eager_runs": 1}.items() <= buckets[2].items()
    assert any(b["kind"] == "prefill" and b["size"] == 64 and b["captured"] for b in buckets)
    assert any(b["disabled"] == "over the memory budget" for b in buckets)


def test_prefill_pads_into_larger_bucket_only_when_cheap(model):
    runner = make_runner(model, prefill=(16, 32, 64), pad_factor=2.0)
    runner._capture("prefill", 64)
    assert runner.plan_step(True, 20, 1).bucket == 64  # 32 missing, 64 <= 2 x 32
    assert not runner.plan_step(True, 10, 1).graph  # 64 > 2 x 16: eager is cheaper
    assert runner.stats[("prefill", 16)].eager_runs == 1
    assert runner.stats[("prefill", 16)].demand == 1


def test_background_capture_most_demanded_first(model):
    runner = make_runner(model, decode=(1, 2, 4), prefill=(16, 32, 64))  # no mixed graphs
    for _ in range(3):
        runner.plan_step(True, 50, 1)  # demand for 64
    runner.plan_step(True, 20, 1)  # demand for 32
    order = []
    original = runner._capture

    def recording(kind, size):
        order.append(size)
        return original(kind, size)

    runner._capture = recording
    runner.start_background_capture()
    deadline = time.time() + 30
    while not all(runner.stats[("prefill", s)].captured for s in (16, 32, 64)) and time.time() < deadline:
        time.sleep(0.01)
    runner.stop_background_capture()
    assert order == [64, 32, 16]
    assert all(runner.stats[("prefill", s)].captured for s in (16, 32, 64))


def test_memory_budget_evicts_least_recently_used(model):
    probe = make_runner(model, decode=(1, 2, 4), prefill=(16, 32, 64))  # no mixed graphs
    cost = {s: probe._estimate_bytes("prefill", s) for s in (16, 32, 64)}
    # Room for the decode graphs plus the two smaller prefill graphs, not all three.
    decode_cost = sum(probe._estimate_bytes("decode", s) for s in probe.plan.decode)
    budget = decode_cost + cost[16] + cost[32] + cost[64] // 2
    runner = make_runner(model, decode=(1, 2, 4), prefill=(16, 32, 64), budget=budget)
    runner.capture_decode_graphs()
    runner.plan_step(True, 10, 1)
    runner.plan_step(True, 20, 1)
    runner._capture("prefill", 16)
    runner._capture("prefill", 32)
    assert runner.graph_bytes() <= budget
    # 64 is as little wanted as the others: capturing it would evict them, so it waits.
    assert runner._next_prefill_bucket() is None
    for _ in range(5):
        runner.plan_step(True, 60, 1)
    runner.plan_step(True, 10, 1)  # 16 was used more recently than 32
    runner.run(True, 10, 1)
    assert runner._next_prefill_bucket() == ("prefill", 64)
    with runner._lock:
        runner._evict_for(cost[64], runner.stats[("prefill", 64)].demand)
    assert not runner.stats[("prefill", 32)].captured and runner.stats[("prefill", 32)].evictions == 1
    runner._capture("prefill", 64)
    assert runner.stats[("prefill", 64)].captured and runner.stats[("prefill", 16)].captured
    assert runner.graph_bytes() <= budget


def test_failed_capture_disables_bucket_and_keeps_serving(model, capfd, monkeypatch):
    runner = make_runner(model, decode=(1,), prefill=(16, 1024))
    forward = model.forward

    def out_of_memory_past_512_tokens(step, kv_cache):
        # The device's memory running out, as a capture of a large bucket can meet it.
        if step.num_tokens > 512:
            raise torch.OutOfMemoryError(f"cannot allocate the activations of {step.num_tokens} tokens")
        return forward(step, kv_cache)

    monkeypatch.setattr(model, "forward", out_of_memory_past_512_tokens)
    assert not runner._capture("prefill", 1024)
    stats = runner.stats[("prefill", 1024)]
    assert not stats.captured and "capture failed" in stats.disabled
    err = capfd.readouterr().err
    assert "graph_capture_failed" in err and "1. lower graph_memory_budget_mb" in err and "4. set use_cuda_graphs" in err
    assert runner._capture("prefill", 16)
    run_step(runner, StepInputs.prefill([[4, 5, 6]], [[0]], BLOCK))
    assert runner.buffers.logits[0].abs().sum() > 0


def test_graphs_disabled_always_eager(model):
    runner = make_runner(model, use_graphs=False)
    runner.capture_decode_graphs()
    assert not any(s.captured for s in runner.stats.values())
    assert not runner.plan_step(False, 2, 2).graph


class CountingCondition(type(threading.Condition())):
    """The runner's condition, counting the wake-ups it sends the capture thread."""

    def __init__(self, lock):
        super().__init__(lock)
        self.notified = 0

    def notify_all(self):
        self.notified += 1
        super().notify_all()


def test_only_demand_for_an_uncaptured_bucket_wakes_the_capture_thread(model):
    runner = make_runner(model, prefill=(16, 32, 64))
    assert runner._capture("prefill", 16)
    runner._demand_changed = CountingCondition(runner._lock)
    for _ in range(5):
        assert runner.plan_step(True, 10, 1).bucket == 16  # its graph serves it: nothing to capture
    assert runner._demand_changed.notified == 0
    assert runner.stats[("prefill", 16)].demand == 5
    assert not runner.plan_step(True, 200, 1).graph  # larger than any bucket: no capture either
    runner.plan_step(True, 50, 1)  # demand for 64, which has no graph yet
    assert runner._demand_changed.notified == 1


def test_prefill_warm_up_covers_the_smallest_bucket_and_the_first_past_the_skinny_rows():
    """A capturing thread warms up where its captures will first call each library: the
    smallest bucket (the skinny kernels) and the first bucket whose projections go to
    cuBLAS (its first call in a thread creates a handle, which would invalidate a capture)."""
    from hybridd.runtime.graph_runner import prefill_warm_up_sizes

    assert prefill_warm_up_sizes([16, 32, 64, 128], 32) == [16, 64]
    assert prefill_warm_up_sizes([128, 16, 64], 32) == [16, 64]
    assert prefill_warm_up_sizes([16, 32], 32) == [16]  # no bucket reaches cuBLAS
    assert prefill_warm_up_sizes([64, 128], 32) == [64]  # the smallest is already past
    assert prefill_warm_up_sizes([16, 64], 0) == [16]  # torch kernels: cuBLAS from the smallest on
