"""On the GPU: every decode and prefill graph against the eager path on the same padded
inputs (bitwise), over many replays with changing inputs, KV cache included; and
background prefill capture while decode graphs replay in another thread."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
DECODE = (1, 2, 4, 8, 16, 24, 32)
PREFILL = (16, 32, 64, 128, 256, 512)


@pytest.fixture(scope="module")
def model():
    return load_model_for_runner()


def load_model_for_runner():
    from tests.random_checkpoint import make_checkpoint

    from hybridd.model import load_model
    from hybridd.kernels.selection import select_kernels

    preset = os.environ.get("HYBRIDD_GPU_RUNNER_PRESET", "llama-1b")
    path = make_checkpoint(Path(f"/tmp/hybridd-{preset}-normal-random"), preset)
    m = load_model(path, dtype=torch.bfloat16, device="cuda", max_positions=2048)
    m.kernels = select_kernels("cuda")
    return m


def make_runner(model, use_graphs: bool, budget: int = 4 << 30, prefill=PREFILL, mixed_tokens: int | None = None,
                kv_dtype: torch.dtype = torch.bfloat16):
    from hybridd.model import KVCache
    from hybridd.runtime.buckets import BucketPlan
    from hybridd.runtime.graph_runner import GraphRunner
    from hybridd.runtime.step_buffers import StepBuffers

    plan = BucketPlan.create(list(DECODE), list(prefill), max_prefill_seqs=4, mixed_tokens=mixed_tokens)
    kv = KVCache.allocate(model.config, 40 * 64, BLOCK, kv_dtype, "cuda")
    buffers = StepBuffers.allocate(plan.max_prefill_tokens, plan.max_rows, 64, model.config.vocab_size, "cuda")
    return GraphRunner(model, kv, buffers, plan, use_graphs=use_graphs, memory_budget_bytes=budget)


class Seqs:
    """A pool of sequences with fixed block tables and random lengths."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tables = [list(range(i * 64, i * 64 + 64)) for i in range(n)]
        self.lengths = torch.randint(5, 300, (n,), generator=g).tolist()
        self.tokens = [torch.randint(3, 32000, (L,), generator=g).tolist() for L in self.lengths]
        self.g = g

    def prefill_step(self, idx: list[int]):
        from hybridd.model import StepInputs

        prompts = [self.tokens[i] for i in idx]
        return StepInputs.prefill(prompts, [self.tables[i] for i in idx], BLOCK)

    def decode_step(self, idx: list[int]):
        from hybridd.model import StepInputs

        toks = [int(torch.randint(3, 32000, (1,), generator=self.g)) for _ in idx]
        pos = [len(self.tokens[i]) for i in idx]
        for i, t in zip(idx, toks):
            self.tokens[i].append(t)
        return StepInputs.decode(toks, pos, [self.tables[i] for i in idx], BLOCK)


def run_step(runner, step):
    """The step's rows written on the serving stream (never the legacy default stream,
    which is illegal while the background thread captures), then run."""
    with torch.cuda.stream(runner.stream):
        runner.buffers.write(step)
    return runner.run(step.is_prefill, step.num_tokens, step.num_seqs)


def run_both(graph_runner, eager_runner, step):
    """The graph path, and the eager path on the same padded shape."""
    shape = run_step(graph_runner, step)
    with torch.cuda.stream(eager_runner.stream):
        eager_runner.buffers.write(step)  # padded past its rows: the eager run reads the bucket's shape
    assert not eager_runner.run(shape.is_prefill, shape.tokens, shape.seqs).graph
    # Per-stream waits only: a device-wide synchronize is illegal while a capture runs.
    graph_runner.stream.synchronize()
    eager_runner.stream.synchronize()
    n = step.num_seqs
    return shape, graph_runner.buffers.logits[:n].clone(), eager_runner.buffers.logits[:n].clone()


@torch.inference_mode()
def test_precompiled_kernels_are_loaded_by_the_warm_ups_not_compiled(model, tmp_path, monkeypatch):
    """First in this module, so that the runner's kernels are not in memory yet."""
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    from hybridd.runtime.kernel_precompile import CompilePool

    graphs = make_runner(model, True)
    with CompilePool(4) as pool:
        report = graphs.precompile_kernels(pool)
    assert report is not None and report.failed == {}, report
    assert report.kernels > 0 and report.missing == report.kernels, report
    compiled = []
    knobs.compilation.listener = lambda *, src, cache_hit, **_: compiled.append((src.name, cache_hit))
    try:
        graphs.capture_decode_graphs()
        graphs.warm_up_prefill()
        for size in PREFILL:
            assert graphs._capture("prefill", size)
    finally:
        knobs.compilation.listener = None
    assert compiled, "the warm-ups loaded no kernel: the dry runs compiled or launched them"
    assert not [name for name, hit in compiled if not hit], f"compiled after the precompile: {compiled}"
    eager = make_runner(model, False)
    seqs = Seqs(4, seed=5)
    for step in (seqs.prefill_step([0, 1]), seqs.decode_step([0, 1]), seqs.decode_step([0])):
        shape, got, ref = run_both(graphs, eager, step)
        assert shape.graph and torch.equal(got, ref)


@torch.inference_mode()
def test_every_bucket_graph_equals_eager_bitwise(model):
    graphs = make_runner(model, True)
    eager = make_runner(model, False)
    graphs.capture_decode_graphs()
    for size in PREFILL:
        assert graphs._capture("prefill", size)
    not_uploaded = [key for key, stats in graphs.stats.items() if stats.captured and not stats.uploaded]
    assert not not_uploaded, f"graphs not uploaded before their first replay: {not_uploaded}"
    seqs = Seqs(32, seed=1)
    used = set()
    # Prefill every sequence, in groups whose token counts land in every prefill bucket.
    order = sorted(range(32), key=lambda i: seqs.lengths[i])
    groups, cur = [], []
    for i in order:
        if len(cur) == 4 or sum(seqs.lengths[j] for j in cur) + seqs.lengths[i] > 512:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    for group in groups:
        shape, got, ref = run_both(graphs, eager, seqs.prefill_step(group))
        used.add(("prefill", shape.bucket))
        assert shape.graph
        assert torch.equal(got, ref), f"prefill bucket {shape.bucket}"
    # Decode with batch sizes that hit every bucket, with padded rows, many replays.
    sizes = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 32] * 4
    g = torch.Generator().manual_seed(7)
    for n in sizes:
        idx = torch.randperm(32, generator=g)[:n].tolist()
        shape, got, ref = run_both(graphs, eager, seqs.decode_step(idx))
        used.add(("decode", shape.bucket))
        assert shape.graph
        assert torch.equal(got, ref), f"decode bucket {shape.bucket} with {n} rows"
    real_blocks = graphs.kv_cache.num_blocks
    assert torch.equal(graphs.kv_cache.arena[:, :, :real_blocks], eager.kv_cache.arena[:, :, :real_blocks])
    assert {b for k, b in used if k == "decode"} == set(DECODE)
    snapshot = graphs.snapshot()
    assert snapshot["graph_bytes"] <= 4 << 30


@torch.inference_mode()
def test_fp8_kv_cache_graphs_equal_eager_bitwise(model):
    """With an FP8 KV cache (`kv_cache_dtype = "fp8"`): the scale arena is a fixed buffer
    like the values', so the captured decode and prefill graphs give the eager path's
    logits, values and scales bit for bit over prefills and decode replays."""
    graphs = make_runner(model, True, prefill=(64, 512), kv_dtype=torch.float8_e4m3fn)
    eager = make_runner(model, False, prefill=(64, 512), kv_dtype=torch.float8_e4m3fn)
    graphs.capture_decode_graphs()
    for size in (64, 512):
        assert graphs._capture("prefill", size)
    seqs = Seqs(8, seed=3)
    for i in range(8):  # 5 to 299 tokens each: the 64- and 512-token buckets
        shape, got, ref = run_both(graphs, eager, seqs.prefill_step([i]))
        assert shape.graph and torch.equal(got, ref), f"prefill bucket {shape.bucket}"
    g = torch.Generator().manual_seed(5)
    for n in [1, 3, 8, 5, 2, 8, 1] * 3:
        idx = torch.randperm(8, generator=g)[:n].tolist()
        shape, got, ref = run_both(graphs, eager, seqs.decode_step(idx))
        assert shape.graph and torch.equal(got, ref), f"decode bucket {shape.bucket} with {n} rows"
    real = graphs.kv_cache.num_blocks
    assert torch.equal(graphs.kv_cache.arena[:, :, :real].view(torch.uint8),
                       eager.kv_cache.arena[:, :, :real].view(torch.uint8))
    assert torch.equal(graphs.kv_cache.scales[:, :, :real], eager.kv_cache.scales[:, :, :real])
    assert graphs.kv_cache.scales[:, :, :real].ne(1).any()  # the graphs wrote scales


@torch.inference_mode()
def test_background_capture_during_decode_replays(model):
    graphs = make_runner(model, True)
    eager = make_runner(model, False)
    graphs.capture_decode_graphs()
    seqs = Seqs(8, seed=3)
    for i in range(8):  # one at a time: every prompt fits the largest prefill bucket
        step = seqs.prefill_step([i])
        run_step(graphs, step)
        run_step(eager, step)
    mismatches = []
    stop = threading.Event()
    steps = [0]

    def decode_loop():
        g = torch.Generator().manual_seed(11)
        with torch.inference_mode():
            while not stop.is_set():
                n = int(torch.randint(1, 9, (1,), generator=g))
                _, got, ref = run_both(graphs, eager, seqs.decode_step(list(range(n))))
                if not torch.equal(got, ref):
                    mismatches.append(steps[0])
                steps[0] += 1

    for size in PREFILL:  # demand, so every bucket is wanted
        graphs.plan_step(True, size, 1)
    worker = threading.Thread(target=decode_loop)
    worker.start()
    graphs.start_background_capture()
    import time

    deadline = time.time() + 120
    while not all(graphs.stats[("prefill", s)].captured for s in PREFILL) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    stop.set()
    worker.join()
    graphs.stop_background_capture()
    assert all(graphs.stats[("prefill", s)].captured for s in PREFILL)
    assert steps[0] > 20 and not mismatches
    # A prefill through the freshly captured graphs is still right.
    shape, got, ref = run_both(graphs, eager, seqs.prefill_step([0]))
    assert shape.graph and torch.equal(got, ref)


@torch.inference_mode()
def test_captures_that_evict_never_stall_the_decode_thread(model):
    """Demand flips between two prefill buckets that the budget cannot hold together, so
    the background thread evicts one and captures the other, again and again, while
    decode graphs replay on another thread, in a process whose start-up objects are
    frozen as a worker's are. Evicted graphs are destroyed once their replays have run,
    outside the runner's lock; no decode step waits for a capture (a capture that held
    the GIL counting the frozen objects stalled them for 26-32 ms in the daemon), and the graph of the
    last demanded bucket still equals the eager path."""
    import time

    from hybridd.runtime import gc_pauses
    from hybridd.stats import slowest

    # No other bucket competes for the budget (no mixed graphs either).
    graphs = make_runner(model, True, prefill=(16, 256, 512), mixed_tokens=0)
    eager = make_runner(model, False, prefill=(16, 256, 512), mixed_tokens=0)
    graphs.capture_decode_graphs()
    assert graphs._capture("prefill", 16)

    def hold_only(target, other):
        """The budget: the graphs held now, less `other`, and `target`'s need; with `other`
        held too it is a byte short, so capturing `target` evicts `other`."""
        held = sum(st.bytes for key, st in graphs.stats.items() if st.captured and key[1] != other)
        charged = graphs.stats[("prefill", other)].bytes
        assert charged > 0, f"bucket {other} is charged nothing: evicting it would not make room"
        graphs.memory_budget_bytes = held + graphs._estimate_bytes("prefill", target) + charged - 1

    assert graphs._capture("prefill", 256)
    destroyed = []
    destroy = graphs._destroy
    # (what, start, end) of each capture and destruction, for a long gap's message.
    spans: list[tuple[str, float, float]] = []

    def counting_destroy(retired):
        destroyed.extend(retired)
        start = time.perf_counter()
        destroy(retired)
        spans.append((f"destroy {len(retired)}", start, time.perf_counter()))

    graphs._destroy = counting_destroy
    capture = graphs._capture

    def capture_then_hold(is_prefill, size):  # nothing more fits until the next cycle says so
        start = time.perf_counter()
        done = capture(is_prefill, size)
        spans.append((f"capture {size}", start, time.perf_counter()))
        with graphs._lock:
            graphs.memory_budget_bytes = graphs.graph_bytes()
        return done

    graphs._capture = capture_then_hold
    gc_pauses.freeze_start_up()
    seqs = Seqs(4, seed=5)
    for i in range(4):  # the eager runner at the graph's padded shape, so that both caches agree
        run_both(graphs, eager, seqs.prefill_step([i]))
    stop = threading.Event()
    gaps = []
    gap_ends = []
    step = seqs.decode_step([0, 1])
    run_both(graphs, eager, step)  # both caches hold its keys and values, which the replays below rewrite

    def decode_loop():  # graph replays only: the thread needs the GIL as briefly as the daemon's
        with torch.inference_mode():
            with torch.cuda.stream(graphs.stream):
                graphs.buffers.write(step)
            last = time.perf_counter()
            while not stop.is_set():
                graphs.run(False, step.num_tokens, step.num_seqs)
                graphs.stream.synchronize()
                now = time.perf_counter()
                gaps.append(now - last)
                gap_ends.append(now)
                last = now

    def captured(size):
        return graphs.stats[("prefill", size)].captured

    worker = threading.Thread(target=decode_loop)
    worker.start()
    hold_only(512, 256)
    graphs.start_background_capture()
    try:
        for cycle in range(6):
            assert captured(256) != captured(512), f"cycle {cycle}: the budget held both or neither"
            target, other = (512, 256) if captured(256) else (256, 512)
            with graphs._lock:
                hold_only(target, other)
            while graphs.stats[("prefill", target)].demand <= graphs.stats[("prefill", other)].demand:
                graphs.plan_step(True, target, 1)
            deadline = time.time() + 60
            while not captured(target) and time.time() < deadline:
                time.sleep(0.01)
            assert captured(target), f"cycle {cycle}: {target} not captured"
    finally:
        stop.set()
        worker.join()
        graphs.stop_background_capture()
    evictions = sum(graphs.stats[("prefill", s)].evictions for s in (256, 512))
    assert evictions >= 6 and len(destroyed) >= 4, (evictions, len(destroyed))
    # What evicted graphs left in the pool is charged to the graphs that took it over, or to none.
    snapshot = graphs.snapshot()
    assert snapshot["graph_bytes"] + snapshot["unowned_pool_bytes"] == snapshot["pool_bytes"], snapshot
    assert len(gaps) > 50
    steady = sorted(gaps)[len(gaps) // 2]
    [worst] = slowest(gaps, 1)
    end = gap_ends[worst]
    start = end - gaps[worst]
    during = [f"{what} {(a - start) * 1e3:+.1f}..{(b - start) * 1e3:+.1f} ms" for what, a, b in spans
              if a < end and b > start]
    assert gaps[worst] < steady + 0.012, (
        f"a decode step waited {gaps[worst] * 1e3:.1f} ms (median {steady * 1e3:.2f} ms), step {worst} of "
        f"{len(gaps)}; overlapping it, from its start: {during or 'no capture or destruction'}")
    _, got, ref = run_both(graphs, eager, seqs.decode_step([0, 1, 2, 3]))
    assert torch.equal(got, ref)
    from hybridd.model import StepInputs

    # 200 tokens: bucket 256, the last one demanded and captured.
    shape, got, ref = run_both(graphs, eager, StepInputs.prefill([list(range(3, 203))], [seqs.tables[3]], BLOCK))
    assert shape.graph and shape.bucket == 256 and torch.equal(got, ref)


def hold_all_but(sliver: int) -> list[torch.Tensor]:
    """Allocations that leave at most about `sliver` bytes of the device free. Taken in
    pieces, halved whenever one fails: one allocation of all that `mem_get_info` reports
    free can fail where the driver keeps some of it back."""
    held = []
    piece = 1 << 30
    while piece >= 1 << 20:
        free, _ = torch.cuda.mem_get_info()
        if free - piece < sliver:
            piece //= 2
            continue
        try:
            held.append(torch.empty(piece, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            piece //= 2
    return held


@torch.inference_mode()
def test_capture_out_of_memory_disables_bucket(model):
    from hybridd.model import KVCache
    from hybridd.runtime.buckets import BucketPlan
    from hybridd.runtime.graph_runner import GraphRunner
    from hybridd.runtime.step_buffers import StepBuffers

    plan = BucketPlan.create([1], [16, 512], max_prefill_seqs=1)
    kv = KVCache.allocate(model.config, 64, BLOCK, torch.bfloat16, "cuda")
    buffers = StepBuffers.allocate(512, 1, 4, model.config.vocab_size, "cuda")
    runner = GraphRunner(model, kv, buffers, plan)
    # Hold all but a sliver of the GPU's memory: capturing the 512-token prefill runs out.
    torch.cuda.empty_cache()
    hog = hold_all_but(4 << 20)
    try:
        captured = runner._capture("prefill", 512)
    finally:
        del hog
        torch.cuda.empty_cache()  # the hog's memory back to the device, not kept cached
    # Out of memory as PyTorch's allocator says it, or as cuBLAS does when the thread's
    # handle is created under the hog (the first test of a process to use cuBLAS there).
    assert not captured, f"the 512-token capture fitted in the {4 << 20} bytes left beside the hog"
    reason = runner.stats[("prefill", 512)].disabled
    assert any(word in reason for word in ("OutOfMemory", "memory", "ALLOC_FAILED")), reason
    assert runner._capture("prefill", 16), runner.stats[("prefill", 16)].disabled
    assert runner._capture("decode", 1), runner.stats[("decode", 1)].disabled


def test_an_invalidated_capture_disables_only_its_bucket(model, monkeypatch):
    """A capture that the CUDA runtime invalidates (here a synchronize inside the step,
    as a first cuBLAS call or a lazy compile would) disables its bucket; the pool stops
    recording for it, so the next bucket still captures and replays."""
    runner = make_runner(model, use_graphs=True)
    body = runner._step_body

    def synchronizing_body(view, logits):
        body(view, logits)
        if view.num_tokens == 64:
            torch.cuda.synchronize()

    monkeypatch.setattr(runner, "_step_body", synchronizing_body)
    assert not runner._capture("prefill", 64)
    assert "capture failed" in runner.stats[("prefill", 64)].disabled
    monkeypatch.setattr(runner, "_step_body", body)
    assert runner._capture("prefill", 128), runner.stats[("prefill", 128)].disabled
    assert runner._capture("prefill", 16), runner.stats[("prefill", 16)].disabled


PREFILL_BEFORE_READY = r"""
import sys, torch
sys.path.insert(0, sys.argv[1] + "/tests")
sys.path.insert(0, sys.argv[1])
import test_gpu_graph_runner as t
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

def compiled():
    # (kernel name, specialisation) of every Triton kernel of hybridd compiled so far.
    kernels = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("hybridd."):
            for value in vars(module).values():
                value = value.fn if isinstance(value, Autotuner) else value
                if isinstance(value, JITFunction):
                    kernels.add(value)
    return {(k.fn.__name__, str(key)) for k in kernels for caches in k.device_caches.values() for key in caches[0]}

model = t.load_model_for_runner()
with torch.inference_mode():
    runner = t.make_runner(model, True)
    runner.capture_decode_graphs()
    runner.warm_up_prefill()
    warmed = compiled()
    seqs = t.Seqs(8, seed=5)
    for i in range(8):
        t.run_step(runner, seqs.prefill_step([i]))
    runner.stream.synchronize()
    assert not any(runner.stats[("prefill", size)].captured for size in t.PREFILL)  # all ran eagerly
after = compiled()
print("compiled while serving:", sorted(after - warmed))
print("kernels", len(warmed), len(after))
"""


def test_prefill_kernels_compile_before_ready(tmp_path):
    """In a fresh process (no kernel compiled yet): after the start's decode capture and
    `warm_up_prefill`, eager prefills on the serving thread, as requests that come before
    the background thread captures their bucket run, compile no Triton kernel."""
    import subprocess

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    result = subprocess.run([sys.executable, "-c", PREFILL_BEFORE_READY, str(ROOT)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    warmed, after = (int(n) for n in result.stdout.split("kernels")[-1].split())
    assert warmed > 0 and after == warmed, result.stdout[-3000:]


def test_a_capture_is_not_charged_for_what_serving_allocates_meanwhile(model):
    """The serving thread allocates while the background thread captures (eager steps of
    buckets not captured yet; the other worker too, on the same GPU): the graph's cost is
    what its capture added to the graphs' pool, not the device memory that went
    meanwhile. The driver's own memory for each graph, which the pool does not hold, is
    measured beside it (the free-memory drop of a capture with nothing else running)."""
    graphs = make_runner(model, use_graphs=True)
    graphs.capture_decode_graphs()
    quiet = {}
    for size in (16, 64):
        free_before = torch.cuda.mem_get_info()[0]
        assert graphs._capture("prefill", size)
        quiet[size] = (free_before - torch.cuda.mem_get_info()[0], graphs.stats[("prefill", size)].bytes)
    print("prefill bucket: (free-memory drop, pool growth) in bytes, nothing else running:", quiet)
    for drop, charged in quiet.values():
        assert charged <= drop  # the pool's growth is part of what the device gave
    held = []
    body = graphs._step_body

    def body_with_serving_allocating(view, logits):
        side = threading.Thread(target=lambda: held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda")))
        side.start()
        side.join()
        body(view, logits)

    graphs._step_body = body_with_serving_allocating
    torch.cuda.empty_cache()  # no cached block can serve the 256 MiB: the device gives them
    free_before = torch.cuda.mem_get_info()[0]
    try:
        assert graphs._capture("prefill", 32)
    finally:
        graphs._step_body = body
    assert len(held) == 1 and free_before - torch.cuda.mem_get_info()[0] >= 256 << 20
    charged = graphs.stats[("prefill", 32)].bytes
    assert charged < 64 << 20, f"the 32-token graph was charged {charged} bytes"


@torch.inference_mode()
def test_a_serving_thread_bound_to_the_stream_runs_steps_without_switching_streams(model, monkeypatch):
    """`serve_from_this_thread`: the thread's own steps go to the serving stream with no
    `torch.cuda.stream` switch, give the logits a switching thread gets, and leave every
    other thread's current stream as it was."""
    graphs = make_runner(model, use_graphs=True, prefill=(16, 32))
    graphs.capture_decode_graphs()
    from hybridd.model import StepInputs

    tables = [list(range(0, 64)), list(range(64, 128))]
    prefill = StepInputs.prefill([[11 + i for i in range(20)], [300 + i for i in range(9)]], tables, BLOCK)
    decode = StepInputs.decode([5, 6], [20, 9], tables, BLOCK)
    switches = []
    stream_context = torch.cuda.stream

    def counting_stream(stream):
        switches.append(threading.get_ident())
        return stream_context(stream)

    def serve(results):
        try:
            with torch.inference_mode():  # thread-local, as the stream is
                graphs.serve_from_this_thread()
                results["current"] = torch.cuda.current_stream()
                monkeypatch.setattr(torch.cuda, "stream", counting_stream)
                for step in (prefill, decode):
                    graphs.buffers.write(step)  # on the thread's current stream: the serving stream
                    results[step.is_prefill] = (graphs.run(step.is_prefill, step.num_tokens, step.num_seqs),
                                                graphs.buffers.logits[: step.num_seqs].clone())
                graphs.stream.synchronize()
        except BaseException as exc:
            results["error"] = exc
        finally:
            monkeypatch.setattr(torch.cuda, "stream", stream_context)

    bound: dict = {}
    server = threading.Thread(target=serve, args=(bound,))
    server.start()
    server.join()
    if "error" in bound:
        raise bound["error"]
    assert bound["current"] == graphs.stream
    assert server.ident not in switches, "the bound thread switched streams for its steps"
    assert torch.cuda.current_stream() != graphs.stream, "binding changed another thread's current stream"
    assert bound[False][0].graph, "the decode step did not replay its graph"
    # Unbound, this thread switches to the serving stream per step; same inputs, same logits.
    for step in (prefill, decode):
        shape = run_step(graphs, step)
        graphs.stream.synchronize()
        assert shape == bound[step.is_prefill][0]
        torch.testing.assert_close(graphs.buffers.logits[: step.num_seqs], bound[step.is_prefill][1], rtol=0, atol=0)
