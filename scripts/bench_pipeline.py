"""Two-process pipeline overhead on the GPU: ITL through the decoupled runtime against
the same decode graphs replayed in one process, in one run.

    python scripts/bench_pipeline.py --out $OUT

Three figures per batch size (1 and 8), on the same random Llama-2-7B-shape weights:
- `gpu_step_s`: one decode step's GPU time (graph replay + greedy sampling, back to
  back, timed by CUDA events): the floor any ITL is bounded by;
- `in_process_itl_s`: the same graphs replayed in one process, the sampled tokens
  read back to the host every step (what a single-process engine does);
- `two_process_itl_s`: inter-token latency measured at the client through the
  context generator and the graph generator (ZeroMQ, CUDA IPC, events).
ITL close to the GPU step time means the GPU has no idle gap between steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from hybridd.model import KVCache, StepInputs, load_model  # noqa: E402
from hybridd.runtime import gc_pauses  # noqa: E402
from hybridd.runtime.buckets import BucketPlan  # noqa: E402
from hybridd.runtime.graph_runner import GraphRunner  # noqa: E402
from hybridd.kernels.selection import select_kernels  # noqa: E402
from hybridd.runtime.step_buffers import StepBuffers  # noqa: E402
from hybridd.stats import percentile, slowest  # noqa: E402

BLOCK = 16


def in_process(model_dir: Path, batches: list[int], prompt_len: int, tokens: int) -> dict:
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda", max_positions=4096)
    model.kernels = select_kernels("cuda")
    plan = BucketPlan.create([1, 2, 4, 8], [16], 1)
    width = 4096 // BLOCK
    kv = KVCache.allocate(model.config, 8 * width, BLOCK, torch.bfloat16, "cuda")
    buffers = StepBuffers.allocate(64, 8, width, model.config.vocab_size, "cuda")
    runner = GraphRunner(model, kv, buffers, plan)
    runner.capture_decode_graphs()
    results = {}
    for batch in batches:
        tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]

        def write_step(pos: int) -> None:
            """The step's inputs at `pos`; its tokens are the ones already on the device."""
            with torch.cuda.stream(runner.stream):
                tokens = buffers.input_ids[:batch].clone()
                buffers.write(StepInputs.decode([0] * batch, [pos] * batch, tables, BLOCK))
                buffers.input_ids[:batch].copy_(tokens)

        with torch.cuda.stream(runner.stream):
            buffers.input_ids[:batch].fill_(5)
        write_step(prompt_len)

        def one_step() -> None:
            runner.run(False, batch, batch)
            with torch.cuda.stream(runner.stream):
                buffers.input_ids[:batch].copy_(buffers.logits[:batch].argmax(-1))

        for _ in range(10):
            one_step()
        runner.stream.synchronize()
        # GPU time of back-to-back steps.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(runner.stream)
        for _ in range(tokens):
            one_step()
        end.record(runner.stream)
        end.synchronize()
        gpu_step = start.elapsed_time(end) / 1e3 / tokens
        # One process, tokens read back to the host each step; each step's GPU time too, to
        # tell a slow step on the GPU from a pause on the host.
        def synced_steps() -> tuple[list[float], list[float]]:
            itl, gpu = [], []
            last = time.perf_counter()
            for pos in range(prompt_len, prompt_len + tokens):
                write_step(pos)
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(runner.stream)
                one_step()
                after.record(runner.stream)
                with torch.cuda.stream(runner.stream):
                    host_tokens = buffers.input_ids[:batch].to("cpu", non_blocking=True)
                runner.stream.synchronize()  # the host has this step's tokens
                host_tokens.tolist()
                now = time.perf_counter()
                itl.append(now - last)
                gpu.append(before.elapsed_time(after) / 1e3)
                last = now
            return itl, gpu

        # As in the workers: what start-up made is frozen, the collector runs on what
        # serving makes (its pauses are timed); then the same loop with it off.
        gc_pauses.freeze_start_up()
        pauses: list[float] = []
        started: list[float] = []

        def time_collection(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                pauses.append(time.perf_counter() - started.pop())

        gc.callbacks.append(time_collection)
        try:
            itl, gpu = synced_steps()
        finally:
            gc.callbacks.remove(time_collection)
        gc.disable()
        try:
            itl_no_gc, _ = synced_steps()
        finally:
            gc.enable()
        results[batch] = {"gpu_step_s": gpu_step, "in_process_itl_p50_s": percentile(itl, 50),
                          "in_process_itl_p99_s": percentile(itl, 99),
                          "synced_gpu_step_p50_s": percentile(gpu, 50), "synced_gpu_step_p99_s": percentile(gpu, 99),
                          "slowest": [[i, itl[i], gpu[i]] for i in slowest(itl, 6)],
                          "gc_pauses": {"n": len(pauses), "total_s": sum(pauses), "max_s": max(pauses, default=0.0)},
                          "no_gc_itl_p50_s": percentile(itl_no_gc, 50), "no_gc_itl_p99_s": percentile(itl_no_gc, 99)}
    del runner, model, kv
    torch.cuda.empty_cache()
    return results


def two_process(model_dir: Path, batches: list[int], prompt_len: int, tokens: int) -> dict:
    from tests.engine_pair import EnginePair

    results = {}
    with tempfile.TemporaryDirectory() as run_dir:
        pair = EnginePair(Path(run_dir), model=str(model_dir), device="cuda", dtype="bfloat16",
                          decode_buckets=[1, 2, 4, 8], max_batch=8, prefill_buckets=[16, 128, 256],
                          max_prefill_tokens=256, compile_sampler=True, kv_cache_memory_fraction=0.3)
        try:
            pair.wait_ready(timeout=600)
            client = pair.client()
            g = torch.Generator().manual_seed(0)
            for batch in batches:
                for warm in (True, False):
                    rids = [client.send({"type": "generate",
                                         "prompt_token_ids": torch.randint(3, 32000, (prompt_len,), generator=g).tolist(),
                                         "sampling": {"max_tokens": 32 if warm else tokens, "temperature": 0.0,
                                                      "ignore_eos": True}})
                            for _ in range(batch)]
                    arrivals = {rid: [] for rid in rids}
                    done = set()
                    while len(done) < len(rids):
                        reply = client.recv(60)
                        if reply is None:
                            raise TimeoutError("no reply from the daemon")
                        if reply["id"] in arrivals:
                            if reply["type"] == "chunk":
                                arrivals[reply["id"]].append(time.perf_counter())
                            else:
                                done.add(reply["id"])
                if any(len(a) != tokens for a in arrivals.values()):
                    raise RuntimeError("streams did not deliver every token")
                gaps = [b - a for times in arrivals.values() for a, b in zip(times[1:], times[2:])]
                results[batch] = {"two_process_itl_p50_s": statistics.median(gaps),
                                  "two_process_itl_p99_s": sorted(gaps)[int(0.99 * (len(gaps) - 1))]}
            results["status"] = client.request({"type": "status"})["status"]
            client.close()
        finally:
            pair.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="two-process pipeline overhead")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--trace", type=Path, help="also trace both workers' kernels (batch 1) into this folder "
                        "and measure the GPU's idle gaps (scripts/gpu_idle_gaps.py)")
    args = parser.parse_args()
    if args.trace:
        import os

        # Inherited by the spawned workers: trace 200 steps after 100 of warm-up.
        os.environ["HYBRIDD_TRACE_DIR"] = str(args.trace)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from make_random_checkpoint import make_checkpoint

        args.model = make_checkpoint(Path(f"/tmp/hybridd-{args.preset}-normal-random"), args.preset)
    batches = [1, 8]
    one = in_process(args.model, batches, args.prompt_len, args.tokens)
    print("in-process:", json.dumps(one), flush=True)
    two = two_process(args.model, batches, args.prompt_len, args.tokens)
    rows = {b: {**one[b], **two[b]} for b in batches}
    if args.trace:
        import subprocess

        subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_idle_gaps.py"), str(args.trace)], check=False)
    for b in batches:
        rows[b]["overhead_ratio_p50"] = rows[b]["two_process_itl_p50_s"] / rows[b]["in_process_itl_p50_s"]
        rows[b]["itl_over_gpu_step"] = rows[b]["two_process_itl_p50_s"] / rows[b]["gpu_step_s"]
    (args.out / "bench_pipeline.json").write_text(json.dumps({"rows": rows, "status": two.get("status")}, indent=2,
                                                             default=str))
    ms = 1e3
    print("\nbatch | GPU step ms | 1-proc ITL p50/p99 ms | 2-proc ITL p50/p99 ms | 2-proc/1-proc | ITL/GPU step")
    for b, r in rows.items():
        print(f"{b:5d} | {r['gpu_step_s'] * ms:11.2f} | {r['in_process_itl_p50_s'] * ms:7.2f} / {r['in_process_itl_p99_s'] * ms:6.2f}"
              f"      | {r['two_process_itl_p50_s'] * ms:7.2f} / {r['two_process_itl_p99_s'] * ms:6.2f}      | "
              f"{r['overhead_ratio_p50']:13.3f} | {r['itl_over_gpu_step']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
