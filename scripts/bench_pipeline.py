"""The same decode graphs replayed in one process: the bench's `in_process` part, for
the two-process overhead target (ITL through both workers over this ITL).

Per batch size: `gpu_step_s`, one decode step's GPU time (graph replay and greedy
sampling back to back, CUDA events), the floor any ITL is bounded by; the ITL of the
graphs replayed in one process with the sampled tokens read back to the host each step
(what a single-process engine does), with the garbage collector's pauses timed, and
again with the collector off.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from hybridd.kernels.selection import select_kernels
from hybridd.model import KVCache, StepInputs, load_model
from hybridd.runtime import gc_pauses
from hybridd.runtime.buckets import BucketPlan
from hybridd.runtime.graph_runner import GraphRunner
from hybridd.runtime.step_buffers import StepBuffers
from hybridd.stats import percentile, slowest
from scripts.timing import BLOCK

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
