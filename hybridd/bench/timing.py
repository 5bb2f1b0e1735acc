"""The benchmark's one timing library: what a stream looks like at the client and its
summaries, the device's ceilings (copy bandwidth, matmul rate), GPU time by CUDA events,
and a graph runner built as the graph generator builds one.

torch is imported inside the functions that need it: the bench's top level stays light.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from hybridd.stats import percentile

BLOCK = 16


# ----------------------------------------------------------------------------- at the client


@dataclass
class StreamRecord:
    """One streamed generation seen by the client: send time and each chunk's arrival."""

    sent: float
    times: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


SAMPLING = {"temperature": 0.0, "ignore_eos": True}  # greedy, always max_tokens tokens


def timed_stream(client, ids: list[int], max_tokens: int, timeout: float = 600.0) -> tuple[StreamRecord, list[int]]:
    """One generation streamed through `hybridd.Client.stream`: its timings and its tokens."""
    record, out = StreamRecord(time.perf_counter()), []
    for chunk in client.stream(ids, max_tokens=max_tokens, timeout=timeout, **SAMPLING):
        record.times.append(time.perf_counter())
        record.tokens += len(chunk.token_ids)
        out.extend(chunk.token_ids)
    return record, out


async def async_timed_stream(client, ids: list[int], max_tokens: int, timeout: float = 600.0,
                             **options) -> StreamRecord:
    """One generation streamed through `hybridd.AsyncClient.stream` (`options`: e.g. `structured`)."""
    record = StreamRecord(time.perf_counter())
    async for chunk in client.stream(ids, max_tokens=max_tokens, timeout=timeout, **SAMPLING, **options):
        record.times.append(time.perf_counter())
        record.tokens += len(chunk.token_ids)
    return record


def concurrent_streams(endpoint: str, prompts: list[list[int]], max_tokens: int, timeout: float = 600.0,
                       **options) -> list[StreamRecord]:
    """One concurrent stream per prompt, on one `hybridd.AsyncClient` (one event loop, no threads)."""
    import asyncio

    from hybridd.client import AsyncClient

    async def run() -> list[StreamRecord]:
        async with AsyncClient(endpoint, timeout=timeout) as client:
            return list(await asyncio.gather(*(async_timed_stream(client, p, max_tokens, timeout, **options)
                                               for p in prompts)))

    return asyncio.run(run())


def itl_summary(gaps: list[float]) -> dict[str, Any]:
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {"n": len(gaps), "p50_s": p50, "p99_s": p99, "p99_over_p50": (p99 / p50) if p50 and p99 else None,
            "mean_s": statistics.fmean(gaps) if gaps else None, "max_s": max(gaps) if gaps else None}


def ttft_summary(samples: list[float]) -> dict[str, Any]:
    return {"n": len(samples), "median_s": statistics.median(samples) if samples else None,
            "min_s": min(samples) if samples else None, "max_s": max(samples) if samples else None,
            "samples_s": samples}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


# ----------------------------------------------------------------------------- the device


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes read plus written per second for a large device-to-device copy."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return nbytes / median_time(lambda: dst.copy_(src), 10, cuda=True)


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an n × n × n product."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n**3 / median_time(lambda: a @ b, 10, cuda=True)


def device_ceilings(device: str) -> dict:
    """Copy bandwidth and matmul rate: bf16 on CUDA, float32 (hybridd's dtype there) on the CPU."""
    import torch

    if device == "cuda":
        bw, flops = copy_bandwidth(), matmul_rate()
        torch.cuda.empty_cache()
        return {"name": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "matmul_flops": flops,
                "matmul_dtype": "bfloat16"}
    src = torch.empty(64 << 20, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    dst.copy_(src)  # warm-ups
    a @ b
    bw = 2 * src.numel() / median_time(lambda: dst.copy_(src), 6, cuda=False)
    flops = 2 * 512**3 / median_time(lambda: a @ b, 6, cuda=False)
    return {"name": platform.processor() or platform.machine(), "copy_bandwidth_Bps": bw, "matmul_flops": flops,
            "matmul_dtype": "float32"}


def median_time(fn, iters: int, cuda: bool, stream=None, per_round: int = 1) -> float:
    """Median seconds per call of fn() with `per_round` calls a round, over `iters` rounds:
    GPU time by CUDA events on `stream` (default: the current one), else host time. With
    one call a round the time includes the host's launch onto an idle GPU; with several,
    each launch overlaps the call before, as in the daemon's pipeline."""
    times = []
    for _ in range(iters):
        if cuda:
            import torch

            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(stream)
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        if cuda:
            e.record(stream)
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / per_round)
        else:
            times.append((time.perf_counter() - t0) / per_round)
    return statistics.median(times)


# ----------------------------------------------------------------------------- a graph runner


def decode_step(batch: int, context: int, tables: list[list[int]]):
    from hybridd.model import StepInputs

    return StepInputs.decode([7] * batch, [context] * batch, tables, BLOCK)


def prefill_step(tokens: int, table: list[int]):
    from hybridd.model import StepInputs

    return StepInputs.prefill([[11] * tokens], [table], BLOCK)


def captured_runner(model, decode_batches, prefill_tokens, width: int, timeout_s: float = 120.0):
    """A graph runner over a fresh KV cache (`width` blocks per sequence of the largest
    batch) and fresh step buffers, its decode graphs captured and its prefill graphs
    captured by its background thread, as the graph generator does (waited for up to
    `timeout_s`; a bucket that failed or ran out of time is left eager)."""
    from hybridd.config import Config
    from hybridd.model import KVCache
    from hybridd.runtime.buckets import BucketPlan
    from hybridd.runtime.graph_runner import GraphRunner
    from hybridd.runtime.step_buffers import StepBuffers

    plan = BucketPlan.create(list(decode_batches), list(prefill_tokens), Config().max_prefill_seqs)
    kv = KVCache.allocate(model.config, max(decode_batches) * width, BLOCK, model.dtype, model.device)
    buffers = StepBuffers.allocate(max(plan.max_batch, plan.max_prefill_tokens), plan.max_rows, width,
                                   model.config.vocab_size, model.device)
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


def stepper(runner, step):
    """Writes the step's rows once (on the serving stream); returns what runs it again:
    the graph generator's part of a step (pick the bucket, pad, replay)."""
    import torch

    with torch.cuda.stream(runner.stream):
        runner.buffers.write(step)

    def run():
        return runner.run(step.is_prefill, step.num_tokens, step.num_seqs)

    return run
