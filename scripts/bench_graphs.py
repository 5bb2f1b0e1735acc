"""Benchmark of the static domain on the GPU: graph replay against eager and the floor.

One command, Llama-2-7B shape in bf16 (random weights, or --model DIR):

    python scripts/bench_graphs.py --out $OUT

Measures the device's copy bandwidth (the decode floor is weight bytes over it);
decode step time at batch 1, 8, 32 for graph replay (fused Triton kernels), eager
(same kernels), a plain graph of the unfused torch path, and the floor; capture time
and memory per bucket and in total; decode step p50/p99 while the background thread
captures prefill buckets, against steady state; prefill time per bucket, graph vs
eager. Prints a table and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from hybridd.model import KVCache, StepInputs, load_model  # noqa: E402
from hybridd.runtime.buckets import BucketPlan  # noqa: E402
from hybridd.runtime.graph_runner import GraphRunner  # noqa: E402
from hybridd.kernels.selection import select_kernels  # noqa: E402
from hybridd.runtime.step_buffers import StepBuffers  # noqa: E402
from hybridd.stats import percentile  # noqa: E402

BLOCK = 16


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes read plus written per second for a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return nbytes / statistics.median(times)


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times)


def decode_step(batch: int, context: int, tables: list[list[int]]) -> StepInputs:
    return StepInputs.decode([7] * batch, [context] * batch, tables, BLOCK)


def prefill_step(tokens: int, table: list[int]) -> StepInputs:
    return StepInputs.prefill([[11] * tokens], [table], BLOCK)


def captured_runner(model, decode_batches: list[int], prefill_tokens: list[int], width: int,
                    timeout_s: float = 120.0) -> GraphRunner:
    """A graph runner over a fresh KV cache (`width` blocks per sequence of the largest
    batch) and fresh step buffers, its decode graphs captured and its prefill graphs
    captured by its background thread, as the graph generator does (waited for up to
    `timeout_s`; a bucket that failed or ran out of time is left eager)."""
    from hybridd.config import Config

    device = model.device
    plan = BucketPlan.create(list(decode_batches), list(prefill_tokens), Config().max_prefill_seqs)
    kv = KVCache.allocate(model.config, max(decode_batches) * width, BLOCK, model.dtype, device)
    buffers = StepBuffers.allocate(max(plan.max_batch, plan.max_prefill_tokens), plan.max_rows, width,
                                   model.config.vocab_size, device)
    runner = GraphRunner(model, kv, buffers, plan, use_graphs=True)
    runner.capture_decode_graphs()
    for tokens in prefill_tokens:
        runner.plan_step(True, tokens, 1)
    runner.start_background_capture()
    deadline = time.monotonic() + timeout_s
    stats = [runner.stats[("prefill", tokens)] for tokens in prefill_tokens]
    while not all(s.captured or s.disabled for s in stats) and time.monotonic() < deadline:
        time.sleep(0.05)
    runner.stop_background_capture()
    return runner


def stepper(runner: GraphRunner, step: StepInputs):
    """Writes the step's rows once (on the serving stream); returns what runs it again:
    the graph generator's part of a step (pick the bucket, pad, replay)."""
    with torch.cuda.stream(runner.stream):
        runner.buffers.write(step)

    def run():
        return runner.run(step.is_prefill, step.num_tokens, step.num_seqs)

    return run


def time_steps(runner: GraphRunner, fn, iters: int) -> list[float]:
    """Per-step wall time of fn() and a wait on the serving stream, in seconds."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        runner.stream.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def median_gpu_time(fn, iters: int, stream: torch.cuda.Stream | None = None, per_round: int = 1,
                    idle_s: float = 0.0) -> float:
    """Median GPU time per call of fn() by CUDA events on `stream` (default: the current
    one), in seconds: `per_round` calls between two events, over `iters` rounds. With one
    call a round the time includes the host's launch of it onto an idle GPU; with several,
    the host launches each call while the GPU still runs the one before, as the daemon's
    pipeline does, so the time is the GPU's own (with the gaps between calls). `idle_s`:
    the GPU idles that long before each round, as before a request's first step."""
    times = []
    for _ in range(iters):
        if idle_s:
            time.sleep(idle_s)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(stream)
        for _ in range(per_round):
            fn()
        e.record(stream)
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / per_round)
    return statistics.median(times)


def time_calls_in_graph(calls: list, min_calls: int = 24) -> float:
    """Median GPU seconds per call of `calls` (functions that launch kernels), captured in
    turn, at least `min_calls` of them, in one CUDA graph and replayed five times: the
    calls run back to back as a step's kernels do."""
    reps = max(1, -(-min_calls // len(calls)))
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # capture_begin/end directly: torch.cuda.graph() would run gc and empty the cache each time.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        for _ in range(reps):
            for call in calls:
                call()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    seconds = median_gpu_time(graph.replay, 5)
    del graph
    return seconds / (reps * len(calls))


def time_gpu(runner: GraphRunner, fn, iters: int, per_round: int = 1) -> float:
    """Median GPU time per call of fn() on the runner's stream, in seconds (`median_gpu_time`)."""
    return median_gpu_time(fn, iters, runner.stream, per_round)


def main() -> int:
    parser = argparse.ArgumentParser(description="graph runner benchmark")
    parser.add_argument("--model", type=Path, help="local HF model directory (default: random Llama-2-7B shape)")
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache")
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}

    results["copy_bandwidth_Bps"] = bw = copy_bandwidth()
    results["bf16_matmul_flops"] = flops = matmul_rate()

    if args.model is None:
        from make_random_checkpoint import make_checkpoint

        args.model = make_checkpoint(Path(f"/tmp/hybridd-{args.preset}-normal-random"), args.preset)
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=torch.bfloat16, device="cuda", max_positions=4096)
    results["load_s"] = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results["weight_bytes"] = weight_bytes
    results["decode_floor_s"] = floor = weight_bytes / bw

    decode_buckets = [1, 2, 4, 8, 16, 24, 32]
    prefill_buckets = [16, 32, 64, 128, 256, 512, 1024, 2048]
    plan = BucketPlan.create(decode_buckets, prefill_buckets, max_prefill_seqs=4)
    max_blocks = 4096 // BLOCK
    kv = KVCache.allocate(model.config, 32 * max_blocks, BLOCK, torch.bfloat16, "cuda")
    tables = [list(range(i * max_blocks, (i + 1) * max_blocks)) for i in range(32)]

    def runner(kernels: str, graphs: bool) -> GraphRunner:
        model.kernels = select_kernels("cuda", kernels)
        buffers = StepBuffers.allocate(plan.max_prefill_tokens, plan.max_rows, max_blocks, model.config.vocab_size, "cuda")
        return GraphRunner(model, kv, buffers, plan, use_graphs=graphs, memory_budget_bytes=1 << 30)

    # Start to ready: decode graphs, largest first.
    fused = runner("triton", True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fused.capture_decode_graphs()
    torch.cuda.synchronize()
    results["decode_capture_s"] = time.perf_counter() - t0
    eager = runner("triton", False)

    decode = {}
    for batch in (1, 8, 32):
        step = decode_step(batch, args.context, tables[:batch])
        run_graph, run_eager = stepper(fused, step), stepper(eager, step)
        for _ in range(5):
            run_graph()
            run_eager()
        decode[batch] = {
            "graph_s": time_gpu(fused, run_graph, args.iters),
            "eager_s": time_gpu(eager, run_eager, max(10, args.iters // 4)),
            "graph_wall_s": statistics.median(time_steps(fused, run_graph, args.iters)),
        }
    # A plain graph of the unfused torch path, for comparison with the fused kernels.
    model.kernels = select_kernels("cuda", "torch")
    plain = GraphRunner(model, kv, StepBuffers.allocate(64, 32, max_blocks, model.config.vocab_size, "cuda"),
                        BucketPlan.create([1, 8, 32], [16], 4), memory_budget_bytes=1 << 30)
    plain.capture_decode_graphs()
    for batch in (1, 8, 32):
        run_plain = stepper(plain, decode_step(batch, args.context, tables[:batch]))
        decode[batch]["unfused_graph_s"] = time_gpu(plain, run_plain, args.iters)
        decode[batch]["floor_s"] = floor
    del plain
    model.kernels = select_kernels("cuda", "triton")
    results["decode"] = decode

    # Step time while the background thread captures every prefill bucket, against steady state.
    run_one = stepper(fused, decode_step(1, args.context, tables[:1]))
    steady = time_steps(fused, run_one, 300)
    for size in prefill_buckets:
        fused.plan_step(True, size, 1)
    during: list[float] = []
    t0 = time.perf_counter()
    fused.start_background_capture()
    while not all(fused.stats[("prefill", s)].captured or fused.stats[("prefill", s)].disabled
                  for s in prefill_buckets):
        during.extend(time_steps(fused, run_one, 20))
    background_s = time.perf_counter() - t0
    fused.stop_background_capture()
    results["background_capture"] = {
        "steady_p50_s": percentile(steady, 50), "steady_p99_s": percentile(steady, 99),
        "during_p50_s": percentile(during, 50), "during_p99_s": percentile(during, 99),
        "steps_during": len(during), "capture_wall_s": background_s,
    }

    prefill = {}
    for size in prefill_buckets:
        step = prefill_step(size, tables[0])
        run_graph, run_eager = stepper(fused, step), stepper(eager, step)
        shape = run_graph()
        run_eager()
        prefill[size] = {
            "graph": shape.graph,
            "graph_s": time_gpu(fused, run_graph, 20),
            "eager_s": time_gpu(eager, run_eager, 20),
            "floor_s": max(weight_bytes / bw, 2 * weight_bytes / 2 * size / flops),
        }
    results["prefill"] = prefill
    snap = fused.snapshot()
    results["graphs"] = snap
    (args.out / "bench_graphs.json").write_text(json.dumps(results, indent=2, default=str))

    ms = 1e3
    print(f"\ndevice {results['device']}  copy bw {bw / 1e12:.2f} TB/s  bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    print(f"weights {weight_bytes / 1e9:.2f} GB  decode floor {floor * ms:.2f} ms  load {results['load_s']:.1f} s")
    print(f"decode graphs captured in {results['decode_capture_s']:.2f} s (start to ready after load)")
    print("\nbatch | graph ms | x floor | eager ms | unfused graph ms | floor ms")
    for b, d in decode.items():
        print(f"{b:5d} | {d['graph_s'] * ms:8.2f} | {d['graph_s'] / floor:7.2f} | {d['eager_s'] * ms:8.2f} | "
              f"{d['unfused_graph_s'] * ms:16.2f} | {floor * ms:.2f}")
    bc = results["background_capture"]
    print(f"\nB=1 step p50/p99 steady {bc['steady_p50_s'] * ms:.2f}/{bc['steady_p99_s'] * ms:.2f} ms; during capture "
          f"{bc['during_p50_s'] * ms:.2f}/{bc['during_p99_s'] * ms:.2f} ms (p99 ratio {bc['during_p99_s'] / bc['steady_p99_s']:.3f}, "
          f"{bc['steps_during']} steps over {bc['capture_wall_s']:.1f} s)")
    print("\nprefill tokens | graph ms | eager ms | floor ms")
    for t, p in prefill.items():
        print(f"{t:14d} | {p['graph_s'] * ms:8.2f} | {p['eager_s'] * ms:8.2f} | {p['floor_s'] * ms:.2f}  {'(graph)' if p['graph'] else '(eager)'}")
    print("\nbucket        | captured | MiB    | capture s")
    for s in snap["buckets"]:
        print(f"{s['kind']:7s} {s['size']:5d} | {str(s['captured']):8s} | {s['bytes'] / 2**20:6.1f} | {s['capture_s']:.3f}")
    print(f"graph memory total {snap['graph_bytes'] / 2**20:.1f} MiB (pool segments {snap['pool_bytes'] / 2**20:.1f} MiB), budget {snap['memory_budget_bytes'] / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
