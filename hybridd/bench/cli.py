"""hybridd against its peers and the hardware floor, in one command, on the same weights.

The benchmark's entry point (`hybridd bench ...`, or `python -m hybridd.bench ...`), its
arguments, its parts and their order, and the report it writes (bench.json, the table):

    hybridd bench --out $OUT/llama2-7b --budget-s 470                      # Llama-2-7B shape, bf16
    hybridd bench --out $OUT/llama3-8b --preset llama3-8b --budget-s 470   # Llama-3-8B shape
    hybridd bench --out $OUT --model /path/to/hf   # any local Hugging Face directory
    hybridd bench --out /tmp/b --device cpu --preset tiny --quick   # CI smoke, seconds
    hybridd bench --out $OUT/fp8 --parts ceilings,checkpoint,breakdown_fp8,fp8   # FP8 against bf16

Parts, in order: `ceilings` (copy bandwidth, matmul rate: the floors), `checkpoint`
(random weights of the preset's shape unless `--model`), `breakdown` (each step's
kernels by category: breakdown.py); then the real daemon (`hybridd start`), measured
at the client through the SDK: `hybridd_eager` (graphs off), `hybridd` (start phases on
empty compile caches, ITL during background capture, TTFT at 10-500 tokens, batch-1 ITL,
1-32 streams, graph memory, what the HTTP gateway adds: gateway.py), VARIANTS (one
setting changed), `capture_evict` (capture.py), `mixed_load` and `prefix_reuse`
(mixed.py), `structured` (structured.py), `speculation` and
`speculation_steps` (speculation.py), `speculation_client` (a daemon with prompt
lookup against one without, on the preset's weights made predictable, at set acceptance
lengths and 32 streams), `breakdown_fp8` and `fp8` (the model
quantized to FP8: its steps against the FP8 floor; a bf16 and an FP8 daemon on the same
weights, and FP8 weights with an FP8 KV cache), and the peers on the same weights: `hf_eager`, `hf_static` (transformers
`generate()`, static cache and torch.compile). A part is skipped, the reason recorded,
where `--budget-s` would be exceeded; a failure is recorded and the run goes on;
bench.json is rewritten after every part. docs/lab/benchmarks.md reads the figures;
plot with `python docs/lab/benchmarks_plot.py OUT/*/bench.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridd import environment
from hybridd.stats import percentile, slowest
from hybridd.bench.daemon import Daemon
from hybridd.bench.timing import (StreamRecord, concurrent_streams, device_ceilings, itl_summary, random_prompt, ratio,
                            timed_stream, ttft_summary)

# The checkout (or site-packages) the package runs from: git and the source digest read it.
ROOT = Path(__file__).resolve().parent.parent.parent

TTFT_LENGTHS = (10, 32, 128, 256, 500)
ITL_PROMPT = 128
ITL_TOKENS = 256
# Gaps of each ITL stream whose place in the stream is reported (the largest).
SLOWEST_GAPS = 6
CONCURRENCY = (1, 4, 16, 32)
GiB = 1 << 30

# The daemon with one setting changed, each timed against the `hybridd` part (the
# default): (its settings, what it changes, why it is skipped on the CPU).
VARIANTS = {
    "hybridd_no_mps": ({"cuda_mps": "off"}, "Without MPS", "MPS is a CUDA feature"),
    "hybridd_no_pdl": ({"pdl": False}, "Without PDL", "programmatic dependent launch is a CUDA feature"),
    "hybridd_unfused": ({"gemm_fusions": "none"}, "No fused neighbours", "the fusions are in the Triton projection"),
    # Polling keeps a core per worker busy: off by default, measured for a client that keeps the daemon busy.
    "hybridd_poll": ({"busy_poll_s": 0.05}, "Polling workers", "polling workers on the CPU take the forward's cores"),
    "hybridd_no_wake": ({"step_wake_poll_s": 0}, "No step wake-up", "the wake-up it leaves out is a fraction of a CPU step"),
}
# Run after the peers: they fit only where the budget leaves time.
LATE_VARIANTS = ("hybridd_poll", "hybridd_no_wake")

# Estimated seconds per part on an H200 with the Llama-2-7B / Llama-3-8B shape (the budget check uses them).
ESTIMATE_S_7B = {"ceilings": 8, "checkpoint": 60, "breakdown": 45, "hybridd_eager": 50, "hybridd": 110,
                 "capture_evict": 60, "hf_eager": 45, "hf_static": 60, "mixed_load": 60,
                 "prefix_reuse": 45, "structured": 150, "speculation": 90,
                 "speculation_steps": 110, "speculation_client": 200, "breakdown_fp8": 45,
                 "fp8": 170} | dict.fromkeys(VARIANTS, 60)
ESTIMATE_S_SMALL = {"ceilings": 3, "checkpoint": 5, "breakdown": 10, "hybridd_eager": 12, "hybridd": 20,
                    "capture_evict": 20, "hf_eager": 8, "hf_static": 60, "mixed_load": 30,
                    "prefix_reuse": 30, "structured": 60, "speculation": 60,
                    "speculation_steps": 60, "speculation_client": 60, "breakdown_fp8": 10,
                    "fp8": 45} | dict.fromkeys(VARIANTS, 20)
# What --skip may name: the parts, and the HTTP gateway's figures inside the hybridd part.
SKIPPABLE = frozenset(ESTIMATE_S_7B) | {"gateway"}
LARGE_PRESETS = ("llama2-7b", "llama3-8b")
# What a preset measures unless --skip says otherwise: the second shape runs the parts that
# show its kernels and latency (breakdown, TTFT, ITL, streams, forced capture, peers), so that
# it fits 10 minutes.
PRESET_SKIP = {"llama3-8b": ("hybridd_eager", *VARIANTS, "gateway")}


# ----------------------------------------------------------------------------- clients


class SdkClient:
    """The SDK as a user gets it: `hybridd.Client.stream()` for one stream (its default
    reply path), `hybridd.AsyncClient` (one event loop, no threads) for concurrent streams.
    Every hybridd figure is taken at this client."""

    first_record: StreamRecord | None = None  # the first request it made, if any

    def __init__(self, endpoint: str):
        from hybridd.client import Client

        self.endpoint = endpoint
        self._client = Client(endpoint, timeout=60.0)
        self._client.health()  # a ring is attached on connecting; its answer comes first
        path = "replies by the reply ring" if self._client._session.ring_attached else "replies by its socket alone"
        self.kind = f"sdk (hybridd.Client.stream: {path}; AsyncClient.stream for concurrent streams)"

    def stream(self, prompt, max_tokens, timeout=300.0) -> StreamRecord:
        return self.stream_tokens(prompt, max_tokens, timeout)[0]

    def stream_tokens(self, prompt, max_tokens, timeout=300.0) -> tuple[StreamRecord, list[int]]:
        return timed_stream(self._client, prompt, max_tokens, timeout)

    def ttft(self, ids: list[int], max_tokens: int) -> float:
        record = self.stream(ids, max_tokens)
        if record.ttft is None:
            raise RuntimeError("hybridd streamed no token")
        return record.ttft

    def gaps(self, ids: list[int], max_tokens: int) -> list[float]:
        record = self.stream(ids, max_tokens)
        if record.tokens != max_tokens:
            raise RuntimeError(f"hybridd streamed {record.tokens} tokens, expected {max_tokens}")
        return record.gaps

    def streams(self, prompts, max_tokens, timeout=300.0) -> list[StreamRecord]:
        return concurrent_streams(self.endpoint, prompts, max_tokens, timeout)

    def status(self):
        return self._client.status(timeout=10)

    def close(self):
        self._client.close()


def open_client(endpoint: str) -> SdkClient:
    """The SDK, its first request (a 2-token stream) kept as `first_record`."""
    client = SdkClient(endpoint)
    try:
        client.first_record = client.stream([5, 6, 7], 2, timeout=120)
    except BaseException:
        client.close()
        raise
    return client


# ----------------------------------------------------------------------------- hybridd server


def compile_cache_entries() -> dict[str, int]:
    """Files in the on-disk Triton and Inductor caches (where the workers will look): a
    start with empty caches compiles every kernel and sampling path, later starts load them."""
    import getpass

    dirs = {
        "triton": environment.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache"),
        "inductor": environment.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
    }
    return {name: sum(len(files) for _, _, files in os.walk(d)) for name, d in dirs.items()}


COMPILE_CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def on_empty_compile_caches(fn):
    """fn() with Triton's and Inductor's caches in a new directory (removed afterwards), as
    the workers spawned meanwhile will find them: a start there is a first start on the
    host (it compiles every kernel)."""
    with tempfile.TemporaryDirectory(prefix="hybridd-caches-", ignore_cleanup_errors=True) as root:
        previous = environment.export({name: f"{root}/{name.lower()}" for name in COMPILE_CACHE_VARS})
        try:
            return fn()
        finally:
            environment.restore(previous)


class HybriddServer(Daemon):
    """The real daemon (`hybridd start`) on `model` with `overrides` as its settings; its
    start split by the lifecycle phases its log records (logged at info)."""

    def __init__(self, model: Path, device: str, ready_timeout: float, **overrides):
        self.compile_caches_at_spawn = compile_cache_entries()
        super().__init__({"model": str(model), "device": device, **overrides, "log_level": "info"}, ready_timeout)
        self.health_ok = self.ready
        self.events = self.phases()

    def first(self, worker: str, phase: str) -> float | None:
        """When `worker` first reported `phase`, on this process's perf_counter clock."""
        return next((self.spawned + t for t, w, p, _ in self.events if w == worker and p == phase), None)

    def startup(self) -> dict[str, Any]:
        t0 = self.spawned
        loading, capturing = self.first("graph", "loading"), self.first("graph", "capturing")
        ready = self.first("context", "ready") or self.health_ok

        def since(t: float | None, origin: float | None) -> float | None:
            return t - origin if t is not None and origin is not None else None

        return {
            "spawn_to_ready_s": ready - t0,
            "spawn_to_health_ok_s": self.health_ok - t0,
            "interpreter_and_imports_s": since(loading, t0),
            "weights_load_s": since(capturing, loading),  # weights, KV arena and buffers allocated
            "after_weights_to_ready_s": since(ready, capturing),  # decode capture + handshake
            "compile_cache_files_at_spawn": self.compile_caches_at_spawn,
            "phases": [{"t_s": t, "worker": w, "phase": p, "detail": d} for t, w, p, d in self.events],
        }


# ----------------------------------------------------------------------------- hybridd measurements


def measure_ttft(stream_fn, lengths, reps: int, vocab: int, rng: random.Random, deadline: float) -> dict:
    """TTFT per prompt length at batch 1: one warm-up, then `reps` timed (fewer past the deadline)."""
    out = {}
    for n in lengths:
        stream_fn(random_prompt(rng, n, vocab), 1)
        samples = []
        for i in range(reps):
            if i >= 2 and time.perf_counter() > deadline:
                break
            ttft = stream_fn(random_prompt(rng, n, vocab), 1)
            samples.append(ttft)
        out[str(n)] = ttft_summary(samples)
    return out


def measure_itl(stream_fn, prompt_len: int, tokens: int, runs: int, vocab: int, rng: random.Random,
                deadline: float) -> dict:
    """Inter-token gaps of `runs` streams of `tokens` tokens after `prompt_len` (one warm-up first)."""
    stream_fn(random_prompt(rng, prompt_len, vocab), min(tokens, 32))
    gaps, per_run = [], []
    for i in range(runs):
        if i >= 1 and time.perf_counter() > deadline:
            break
        g = stream_fn(random_prompt(rng, prompt_len, vocab), tokens)
        gaps.extend(g)
        # Where in the stream the slowest gaps fell: at the same token each run (a step that
        # costs more there) or anywhere (a pause on the host).
        per_run.append({"p50_s": percentile(g, 50), "p99_s": percentile(g, 99), "n": len(g),
                        "slowest": [[i, g[i]] for i in slowest(g, SLOWEST_GAPS)]})
    return {**itl_summary(gaps), "prompt_tokens": prompt_len, "tokens": tokens, "runs": per_run}


def measure_concurrency(client: SdkClient, levels, prompt_len: int, tokens: int, vocab: int,
                        rng: random.Random) -> dict:
    client.streams([random_prompt(rng, prompt_len, vocab) for _ in range(max(levels))], min(tokens, 8))  # warm-up
    out = {}
    for n in levels:
        records = client.streams([random_prompt(rng, prompt_len, vocab) for _ in range(n)], tokens)
        start = min(r.sent for r in records)
        end = max(r.times[-1] for r in records if r.times)
        first = max(r.times[0] for r in records if r.times)  # every stream is decoding after this
        total = sum(r.tokens for r in records)
        decode_tokens = sum(sum(1 for t in r.times if t > first) for r in records)
        gaps = [g for r in records for g in r.gaps]
        out[str(n)] = {
            "streams": n, "prompt_tokens": prompt_len, "tokens_per_stream": tokens, "tokens": total,
            "tokens_per_s": total / (end - start),
            "decode_tokens_per_s": decode_tokens / (end - first) if end > first else None,
            "ttft_median_s": statistics.median([r.ttft for r in records if r.ttft is not None]),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "itl_n": len(gaps),
        }
    return out


def prefill_capture_state(status: dict) -> tuple[int, int, float]:
    """(prefill and mixed buckets captured or disabled, those buckets, the sum of their capture seconds)."""
    prefill = [b for b in status.get("buckets", []) if b.get("kind") in ("prefill", "mixed")]
    done = sum(1 for b in prefill if b.get("captured") or b.get("disabled"))
    return done, len(prefill), sum(b.get("capture_s") or 0.0 for b in prefill if b.get("captured"))


def measure_during_capture(client: SdkClient, server: HybriddServer, vocab: int, rng: random.Random,
                           tokens: int, max_s: float, early_s: float = 2.0) -> dict:
    """Batch-1 streams back to back from the moment the daemon is ready, while the graph
    generator's background thread captures prefill buckets, then in steady state.

    The capture thread starts when the graph generator reports `ready` and captures one
    bucket after another, so [that moment, + the sum of the buckets' capture_s] lies
    inside the capture period: gaps arriving in it are "during". That window can close
    before the first request's first token (which pays the sampler's lazy torch.compile
    and an eager prefill), so the gaps of the first `early_s` seconds after the first
    token are reported too ("early"). Gaps arriving after a status reply first shows every
    prefill bucket captured (or disabled), and after the early window, are "steady"."""
    t_start = server.first("graph", "ready") or server.health_ok
    records: list[StreamRecord] = [client.first_record] if client.first_record else []
    t_observed_done = None
    done_state = (0, 0, 0.0)
    stable_since = None
    began = time.perf_counter()
    while time.perf_counter() - began < max_s:
        record = client.stream(random_prompt(rng, 16, vocab), tokens)
        records.append(record)
        now = time.perf_counter()
        if t_observed_done is None:
            state = prefill_capture_state(client.status())
            # Done: every bucket captured/disabled, or no progress for 3 s (the budget blocks the rest).
            if state[:2] != done_state[:2]:
                stable_since = now
            if (state[1] and state[0] == state[1]) or (stable_since and now - stable_since > 3.0 and state[0]):
                t_observed_done = now
            done_state = state
            continue
        t_first = records[0].times[0] if records[0].times else began
        steady_from = max(t_observed_done, t_first + early_s)
        if sum(1 for r in records for a in r.times[:-1] if a > steady_from) >= 255:
            break
    final_state = prefill_capture_state(client.status())
    window_end = t_start + final_state[2]
    t_first = records[0].times[0] if records and records[0].times else began
    steady_from = max(t_observed_done or float("inf"), t_first + early_s)
    pairs = [(a, b) for r in records for a, b in zip(r.times, r.times[1:])]
    during = [b - a for a, b in pairs if t_start <= b <= window_end]
    early = [b - a for a, b in pairs if b <= t_first + early_s]
    steady = [b - a for a, b in pairs if a > steady_from]
    result = {
        "during": itl_summary(during), "early": itl_summary(early), "steady": itl_summary(steady),
        "p99_ratio": ratio(percentile(during, 99), percentile(steady, 99)) if len(during) >= 5 else None,
        "early_p99_ratio": ratio(percentile(early, 99), percentile(steady, 99)) if len(early) >= 5 else None,
        "early_s": early_s,
        "capture_window_s": final_state[2],
        "capture_observed_done_after_start_s": (t_observed_done - t_start) if t_observed_done else None,
        "prefill_buckets_captured": final_state[0], "prefill_buckets": final_state[1],
        "first_request_ttft_s": records[0].ttft if records else None,
        "first_token_after_capture_start_s": t_first - t_start,
        "tokens_per_stream": tokens,
    }
    result["basis"] = "during" if result["p99_ratio"] is not None else "early"
    if len(during) < 5:
        result["note"] = (f"only {len(during)} decode gaps fell inside the capture window ({final_state[2]:.2f} s): "
                          f"the first token came {t_first - t_start:.2f} s after capture began; the target is judged "
                          f"on the first {early_s:.0f} s of decode after ready instead")
    return result


def graph_memory(status: dict) -> dict:
    buckets = status.get("buckets", [])
    return {
        "graph_bytes": status.get("graph_bytes"), "graph_pool_bytes": status.get("graph_pool_bytes"),
        "graph_memory_budget_bytes": status.get("graph_memory_budget_bytes"),
        "buckets": [{k: b.get(k) for k in ("kind", "size", "captured", "bytes", "capture_s", "replays", "eager_runs",
                                           "disabled")} for b in buckets],
    }


def server_overrides(args, graphs: bool = True) -> dict[str, Any]:
    """The daemon's settings for every hybridd part: its defaults, less KV cache on CUDA
    (the peers share the device)."""
    cuda = args.device == "cuda"
    overrides: dict[str, Any] = {"use_cuda_graphs": graphs, "compile_sampler": cuda, "log_level": "warning"}
    if cuda:
        overrides["kv_cache_memory_fraction"] = 0.3
    return overrides


def start_server(args, model: Path, graphs: bool = True, **overrides) -> HybriddServer:
    """The daemon on `model` with the bench's settings and `overrides`."""
    return HybriddServer(model, args.device, 600 if args.device == "cuda" else 120,
                         **{**server_overrides(args, graphs), **overrides})


@contextlib.contextmanager
def sdk_on_server(args, model: Path, result: dict, graphs: bool = True,
                  **overrides) -> Iterator[tuple[HybriddServer, SdkClient]]:
    """A daemon (start_server) and the SDK on it; its settings, start and client in `result`."""
    server, client = start_server(args, model, graphs, **overrides), None
    try:
        result["config"] = {k: v for k, v in {**server_overrides(args, graphs), **overrides}.items()
                            if k != "log_level"}
        result["startup"] = server.startup()
        client = open_client(server.endpoint)
        result["client"] = client.kind
        yield server, client
    finally:
        if client is not None:
            client.close()
        server.close()


def measure_batch1(stream_fns, lengths, args, vocab: int, rng: random.Random, deadline: float, result: dict) -> None:
    """TTFT at `lengths` and the ITL of ITL_PROMPT-token prompts, at batch 1, into `result`."""
    ttft_fn, gaps_fn = stream_fns
    result["ttft_s"] = measure_ttft(ttft_fn, lengths, args.ttft_reps, vocab, rng, deadline)
    result["itl"] = measure_itl(gaps_fn, ITL_PROMPT, args.itl_tokens, args.itl_runs, vocab, rng, deadline)


# The lengths a variant of the daemon measured beside the `hybridd` part is timed at.
BESIDE_TTFT_LENGTHS = (10, 128)


def run_variant(args, model: Path, vocab: int, deadline: float, result: dict, base: dict, overrides: dict) -> None:
    """The graphs-on daemon again with `overrides` in its config: TTFT and batch-1 ITL
    at the client, divided by the same figures of this run's `hybridd` part."""
    with sdk_on_server(args, model, result, **overrides) as (_, client):
        measure_batch1((client.ttft, client.gaps), BESIDE_TTFT_LENGTHS, args, vocab, random.Random(4), deadline,
                       result)
    result["vs_off"] = beside_comparison(result, base)


def beside_comparison(on: dict, off: dict) -> dict:
    """On ÷ off for ITL p50/p99 at batch 1 and TTFT p50 at each length both measured."""
    out = {"itl_p50_on_s": g(on, "itl", "p50_s"), "itl_p50_off_s": g(off, "itl", "p50_s"),
           "itl_p99_on_s": g(on, "itl", "p99_s"), "itl_p99_off_s": g(off, "itl", "p99_s")}
    out["itl_p50_ratio"] = ratio(out["itl_p50_on_s"], out["itl_p50_off_s"])
    out["itl_p99_ratio"] = ratio(out["itl_p99_on_s"], out["itl_p99_off_s"])
    for n in BESIDE_TTFT_LENGTHS:
        a, b = g(on, "ttft_s", str(n), "median_s"), g(off, "ttft_s", str(n), "median_s")
        out[f"ttft_{n}_on_s"], out[f"ttft_{n}_off_s"], out[f"ttft_{n}_ratio"] = a, b, ratio(a, b)
    return out


# TTFT lengths of the `fp8` part, below `--long-prompt`, which is the last.
FP8_TTFT_LENGTHS = (128, 500)
FP8_STREAMS = 32


def run_fp8(args, model: Path, vocab: int, deadline: float, result: dict) -> None:
    """The graphs-on daemon in the model's dtype (`bf16`), then with `quantization = "fp8"`
    (`fp8`), on the same weights and prompts: start (after the weights), TTFT at
    FP8_TTFT_LENGTHS and `--long-prompt` tokens, batch-1 ITL and FP8_STREAMS streams;
    `fp8_over_bf16` divides each figure of `fp8` by `bf16`'s. Then FP8 weights with an FP8
    KV cache (`fp8_kv`, `kv_cache_dtype = "fp8"`): batch-1 ITL and FP8_STREAMS streams,
    `fp8_kv_over_fp8` each of its figures over `fp8`'s (what halving the KV read gains)."""
    lengths = (*[n for n in FP8_TTFT_LENGTHS if n < args.long_prompt], args.long_prompt)
    for name, overrides in (("bf16", {}), ("fp8", {"quantization": "fp8"}),
                            ("fp8_kv", {"quantization": "fp8", "kv_cache_dtype": "fp8"})):
        part = result[name] = {}
        rng = random.Random(11)  # the same prompts for all three
        with sdk_on_server(args, model, part, **overrides) as (_, client):
            if name == "fp8_kv":  # decode figures only: the KV read is what changed
                part["itl"] = measure_itl(client.gaps, ITL_PROMPT, args.itl_tokens, args.itl_runs, vocab, rng,
                                          deadline)
            else:
                measure_batch1((client.ttft, client.gaps), lengths, args, vocab, rng, deadline, part)
            part["concurrency"] = measure_concurrency(client, (FP8_STREAMS,), ITL_PROMPT, args.concurrency_tokens,
                                                      vocab, rng)
            status = client.status()
            part["quantization"] = status.get("quantization")
            part["kv_cache_dtype"] = status.get("kv_cache_dtype")
            part["kv_blocks"] = g(status, "kv_blocks", "total")
    figures = {"itl_p50": ("itl", "p50_s"), "itl_p99": ("itl", "p99_s"),
               f"decode_tokens_per_s_{FP8_STREAMS}": ("concurrency", str(FP8_STREAMS), "decode_tokens_per_s"),
               "after_weights_to_ready": ("startup", "after_weights_to_ready_s"),
               **{f"ttft_{n}": ("ttft_s", str(n), "median_s") for n in lengths}}
    result["ttft_lengths"] = list(lengths)
    result["fp8_over_bf16"] = {name: ratio(g(result["fp8"], *keys), g(result["bf16"], *keys))
                               for name, keys in figures.items()}
    decode = ("itl_p50", "itl_p99", f"decode_tokens_per_s_{FP8_STREAMS}")
    result["fp8_kv_over_fp8"] = {name: ratio(g(result["fp8_kv"], *figures[name]), g(result["fp8"], *figures[name]))
                                 for name in decode}


SPEC_STREAMS = 32


def run_speculation_client(args, result: dict) -> None:
    """Speculative decoding at the client on the preset's predictable checkpoint: a daemon
    without speculation (`plain`), then one with prompt lookup (`ngram`; k and the adaptive
    policy as the daemon's defaults), the same prompts to both. At batch 1, greedy, per
    corruption r of `chain_prompt`: time per output token (first token to last, over
    tokens - 1; median of `reps` requests after one unmeasured) and the mean acceptance
    length from the daemon's status counters; then SPEC_STREAMS concurrent streams of
    random prompts. `rows`: each r's figures over the plain daemon's, and whether both
    daemons gave the same tokens (and the plain one the target's own continuation)."""
    from hybridd.config import Config
    from hybridd.bench.speculation import CORRUPTIONS, chain_prompt
    from hybridd.bench.random_checkpoint import PRESETS, predictable_perm

    if args.model is not None:
        raise ValueError("speculation_client needs random weights of a preset (--preset), not --model")
    model, vocab = make_model(args, predictable=True), PRESETS[args.preset]["vocab_size"]
    perm, rng = predictable_perm(vocab).tolist(), random.Random(9)
    tokens, reps = (16, 2) if args.quick else (128, 5)
    prompts = {r: [chain_prompt(rng, perm, r, tokens) for _ in range(reps + 1)] for r in CORRUPTIONS}
    outputs: dict[tuple[str, float], list[list[int]]] = {}
    for name, overrides in (("plain", {}), ("ngram", {"speculative_drafter": "ngram"})):
        part = result[name] = {}
        with sdk_on_server(args, model, part, **overrides) as (_, client):
            for r, batch in prompts.items():
                client.stream_tokens(batch[0], tokens)  # unmeasured: the policy meets this r first
                before = client.status().get("speculation", {})
                runs = [client.stream_tokens(ids, tokens) for ids in batch[1:]]
                after = client.status().get("speculation", {})
                seconds = [(rec.times[-1] - rec.times[0]) / (rec.tokens - 1) for rec, _ in runs]
                outputs[name, r] = [out for _, out in runs]
                row = part[f"corruption_{round(r * 100)}"] = {"s_per_token": statistics.median(seconds),
                                                               "samples_s": seconds}
                if name == "ngram":
                    row.update({key: after.get(key, 0) - before.get(key, 0)
                                for key in ("drafts", "draft_tokens", "accepted_tokens", "verify_steps")})
                    row["mean_acceptance_length"] = 1 + row["accepted_tokens"] / row["drafts"] if row["drafts"] else 1.0
            part["streams"] = measure_concurrency(client, (SPEC_STREAMS,), ITL_PROMPT, args.concurrency_tokens,
                                                  vocab, random.Random(12))[str(SPEC_STREAMS)]
            part["speculation"] = {k: v for k, v in client.status().get("speculation", {}).items()
                                   if k != "ms_per_token"}
    result["policy"] = {"num_speculative_tokens": g(result, "ngram", "speculation", "num_speculative_tokens"),
                        "speculative_adaptive": Config().speculative_adaptive, "tokens": tokens, "reps": reps}
    result["rows"] = [{
        "corruption": r, "mean_acceptance_length": g(result, "ngram", f"corruption_{round(r * 100)}",
                                                       "mean_acceptance_length"),
        "over_plain": ratio(*(g(result, n, f"corruption_{round(r * 100)}", "s_per_token") for n in ("ngram", "plain"))),
        "same_tokens": outputs["ngram", r] == outputs["plain", r],
        "plain_follows_target": all(out == [perm[ids[-1]]] + [perm[t] for t in out[:-1]]
                                    for ids, out in zip(prompts[r][1:], outputs["plain", r])),
    } for r in CORRUPTIONS]
    result["streams_ratio"] = ratio(g(result, "ngram", "streams", "tokens_per_s"),
                                    g(result, "plain", "streams", "tokens_per_s"))


def run_capture_evict(args, model: Path, vocab: int, notes: list[str]) -> dict:
    """Prefill graphs captured while a decode stream runs, forced by a small graph budget
    and demand for the evicted bucket (hybridd/bench/capture.py)."""
    from hybridd.bench.capture import measure_capture_under_eviction

    return measure_capture_under_eviction(open_client, model, args.device == "cuda", vocab, args.quick,
                                          lambda **overrides: start_server(args, model, **overrides), notes)


def run_hybridd(args, model: Path, vocab: int, graphs: bool, deadline: float, result: dict) -> None:
    """Fills `result` as it goes, so that a failure keeps what was measured before it."""
    rng = random.Random(1 if graphs else 2)
    with sdk_on_server(args, model, result, graphs) as (server, client):
        if graphs:
            result["background_capture"] = measure_during_capture(
                client, server, vocab, rng, tokens=16 if args.quick else 64, max_s=10 if args.quick else 40)
        measure_batch1((client.ttft, client.gaps), TTFT_LENGTHS, args, vocab, rng, deadline, result)
        if not graphs:
            return
        result["concurrency"] = measure_concurrency(client, CONCURRENCY, ITL_PROMPT, args.concurrency_tokens,
                                                    vocab, rng)
        status = client.status()
        result["graph_memory"] = graph_memory(status)
        result["status"] = {k: v for k, v in status.items() if k != "buckets"}
        if "gateway" in args.skip_set:
            return
        from hybridd.bench.gateway import measure_gateway

        result["gateway"] = measure_gateway(server.endpoint, str(model), prompt_len=ITL_PROMPT,
                                            ttft_reps=args.ttft_reps, itl_tokens=args.itl_tokens,
                                            itl_runs=args.itl_runs, vocab=vocab,
                                            # Its own prompts, whatever the timed parts before it drew.
                                            rng=random.Random(7))


# ----------------------------------------------------------------------------- Hugging Face peers


def hf_load(model: Path, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, device_map=device)
    except (ImportError, ValueError):  # device_map needs accelerate; load on the host, then move
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(device)
    hf.eval()
    return hf, time.perf_counter() - t0


def hf_generation_config(hf, max_new_tokens: int):
    import copy

    config = copy.deepcopy(hf.generation_config)
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(config, name):
            setattr(config, name, None)
    # Like ignore_eos: always max_new_tokens tokens. generate() fills unset fields from the
    # model's own generation config, so EOS is removed there too.
    hf.generation_config.eos_token_id = None
    for name, value in {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "max_new_tokens": max_new_tokens,
                        "min_new_tokens": None}.items():
        setattr(config, name, value)
    return config


def hf_timed_generate(hf, ids: list[int], max_new_tokens: int, config) -> StreamRecord:
    """Generate with a streamer that timestamps each new token on the host. On CUDA,
    generate() copies each step's token to the host before handing it to the streamer,
    so a timestamp is the moment that token exists for the caller."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        prompt_seen = False

        def put(self, value):
            now = time.perf_counter()
            if self.prompt_seen:  # generate() first puts the prompt
                record.times.append(now)
                record.tokens += 1
            self.prompt_seen = True

        def end(self):
            pass

    device = hf.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    mask = torch.ones_like(input_ids)
    config.max_new_tokens = max_new_tokens
    if getattr(config, "bench_force_min_new_tokens", False):
        config.min_new_tokens = max_new_tokens
    if device.type == "cuda":
        torch.cuda.synchronize()
    record = StreamRecord(time.perf_counter())
    hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, streamer=Stamps())
    return record


def hf_stream_fns(hf, config):
    def ttft(ids, max_tokens):
        return hf_timed_generate(hf, ids, max_tokens, config).ttft

    def gaps(ids, max_tokens):
        record = hf_timed_generate(hf, ids, max_tokens, config)
        if record.tokens != max_tokens and not getattr(config, "bench_force_min_new_tokens", False):
            # EOS still stopped it (a transformers version that restores EOS): force the length.
            config.bench_force_min_new_tokens = True
            record = hf_timed_generate(hf, ids, max_tokens, config)
        if record.tokens != max_tokens:
            raise RuntimeError(f"HF generated {record.tokens} tokens, expected {max_tokens}")
        return record.gaps

    return ttft, gaps


def run_hf(args, model: Path, vocab: int, variant: str, deadline: float, shared: dict, result: dict) -> None:
    """variant: "eager" (DynamicCache) or "static" (StaticCache + torch.compile); fills `result`."""
    hf = shared.get("hf")
    result["transformers"] = __import__("transformers").__version__
    if hf is None:
        hf, result["load_s"] = hf_load(model, args.device)
        shared["hf"] = hf
    config = hf_generation_config(hf, 1)
    rng = random.Random(3)
    if variant == "static":
        config.cache_implementation = "static"
        if hasattr(config, "max_cache_len"):  # one cache size for every call (the first, longest): no recompile
            config.max_cache_len = max(TTFT_LENGTHS) + args.itl_tokens
        from transformers import CompileConfig

        config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        result["compile"] = 'generate()\'s own compile of the decode step, CompileConfig(fullgraph=True, mode="reduce-overhead")'
        # Warm-up: the longest call first (it sizes the static cache), then the measured shapes.
        t0 = time.perf_counter()
        hf_timed_generate(hf, random_prompt(rng, max(TTFT_LENGTHS), vocab), args.itl_tokens, config)
        for _ in range(2):
            hf_timed_generate(hf, random_prompt(rng, ITL_PROMPT, vocab), args.itl_tokens, config)
        result["warmup_s"] = time.perf_counter() - t0
    measure_batch1(hf_stream_fns(hf, config), TTFT_LENGTHS, args, vocab, rng, deadline, result)


def free_hf(shared: dict) -> None:
    import torch

    shared.pop("hf", None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()
    except Exception:
        pass


# ----------------------------------------------------------------------------- device and floors


def count_params(model: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in meta.parameters())


def floors(params: int, elem_bytes: int, ceilings: dict) -> dict:
    weight_bytes = params * elem_bytes
    bw, flops = ceilings["copy_bandwidth_Bps"], ceilings["matmul_flops"]
    decode = weight_bytes / bw
    return {"params": params, "weight_bytes": weight_bytes, "decode_floor_s": decode,
            "prefill_floor_s": {str(n): max(decode, 2 * params * n / flops) for n in TTFT_LENGTHS}}


def make_model(args, predictable: bool = False) -> Path:
    import torch

    from hybridd.bench import random_checkpoint as mrc

    base = args.checkpoint_dir or Path(tempfile.gettempdir())
    out = Path(base) / f"hybridd-{args.preset}-{'predictable' if predictable else 'normal'}-random"
    path = mrc.make_checkpoint(out, args.preset, seed=0, device=args.device, predictable=predictable)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return path


# ----------------------------------------------------------------------------- report


def g(d: Any, *keys) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def build_report(results: dict) -> tuple[list[dict], list[dict]]:
    """Rows of the comparison table and the BENCHMARKS.md targets, from the results."""
    fl = results.get("floors", {})
    hy, he, hfe, hfs = (results.get(k, {}) for k in ("hybridd", "hybridd_eager", "hf_eager", "hf_static"))
    rows = []

    def row(name, unit, key_fn, floor=None):
        values = {k: key_fn(v) for k, v in (("hybridd", hy), ("hybridd_eager", he), ("hf_eager", hfe),
                                             ("hf_static", hfs))}
        h = values["hybridd"]
        rows.append({"figure": name, "unit": unit, **values, "floor": floor, "x_floor": ratio(h, floor),
                     "hybridd_over_hybridd_eager": ratio(h, values["hybridd_eager"]),
                     "hybridd_over_hf_eager": ratio(h, values["hf_eager"]),
                     "hybridd_over_hf_static": ratio(h, values["hf_static"])})

    for n in TTFT_LENGTHS:
        row(f"TTFT {n} tok", "s", lambda r, n=n: g(r, "ttft_s", str(n), "median_s"), g(fl, "prefill_floor_s", str(n)))
    row("ITL p50 (b=1)", "s", lambda r: g(r, "itl", "p50_s"), fl.get("decode_floor_s"))
    row("ITL p99 (b=1)", "s", lambda r: g(r, "itl", "p99_s"), fl.get("decode_floor_s"))
    row("ITL p99/p50", "", lambda r: g(r, "itl", "p99_over_p50"))

    targets = []

    def target(name, goal, value, limit):
        targets.append({"target": name, "goal": goal, "value": value, "limit": limit,
                        "met": None if value is None or limit is None else bool(value <= limit)})

    decode_floor = fl.get("decode_floor_s")
    bd = results.get("breakdown", {})
    target("decode GPU step, batch 1, context 512, steps back to back (x weights floor)", "<= 1.15 x floor",
           ratio(g(bd, "decode_b1", "step_s"), decode_floor), 1.15)
    p50 = g(hy, "itl", "p50_s")
    target("decode ITL p50, batch 1", "<= 1.20 x floor", ratio(p50, decode_floor), 1.20)
    target("decode ITL p50, batch 1 (stretch)", "<= 1.15 x floor", ratio(p50, decode_floor), 1.15)
    target("decode ITL p99/p50, batch 1", "<= 1.05", g(hy, "itl", "p99_over_p50"), 1.05)

    def worst_ttft(key: str) -> float | None:
        worst = [ratio(g(hy, key, str(n), "median_s"), g(fl, "prefill_floor_s", str(n))) for n in TTFT_LENGTHS]
        return max(worst) if worst and None not in worst else None

    target("TTFT at the client 10-500 tokens (worst length)", "<= 1.5 x prefill floor", worst_ttft("ttft_s"), 1.5)
    target("TTFT at the client 10-500 tokens (worst length, stretch)", "<= 1.3 x prefill floor",
           worst_ttft("ttft_s"), 1.3)
    b32 = bd.get("decode_b32") or {}
    tput = g(hy, "concurrency", "32", "decode_tokens_per_s")
    target(f"decode GPU step, batch 32, context 512, steps back to back (x (weights + KV) floor; 32 streams: "
           f"{fmt(tput, 1, 0)} decode tokens/s)", "<= 1.20 x floor", ratio(b32.get("step_s"), b32.get("weights_kv_floor_s")),
           1.20)
    ce = results.get("capture_evict") or {}
    if ce.get("p99_ratio") is not None:
        target(f"ITL p99 during forced prefill capture / steady ({ce.get('captures_during_decode')} captures "
               f"during decode)", "<= 1.10", ce["p99_ratio"], 1.10)
    else:
        bc = hy.get("background_capture") or {}
        target(f"ITL p99 during background capture / steady ({bc.get('basis', '-')})", "<= 1.10",
               bc.get("p99_ratio") if bc.get("p99_ratio") is not None else bc.get("early_p99_ratio"), 1.10)
    mem = [v for v in (g(hy, "graph_memory", "graph_bytes"), g(hy, "graph_memory", "graph_pool_bytes")) if v]
    target("all graphs' memory (GiB, larger of measured and pool)", "<= 1 GiB", max(mem) / GiB if mem else None, 1.0)
    target(f"start to ready after weights are loaded (s; {cache_state(hy.get('startup') or {})})", "<= 20 s",
           g(hy, "startup", "after_weights_to_ready_s"), 20.0)
    bd8 = results.get("breakdown_fp8") or {}
    if bd8:
        fp8_floor = ratio(bd8.get("weight_bytes"), g(results, "device", "copy_bandwidth_Bps"))
        target("FP8 decode GPU step, batch 1, context 512 (x FP8 weights floor: FP8 projections, bf16 embedding and "
               "LM head)", "<= 1.15 x floor", ratio(g(bd8, "decode_b1", "step_s"), fp8_floor), 1.15)
        target("FP8 decode GPU step, batch 32, context 512 (x (FP8 weights + KV) floor)", "<= 1.20 x floor",
               ratio(g(bd8, "decode_b32", "step_s"), g(bd8, "decode_b32", "weights_kv_floor_s")), 1.20)
    f8 = results.get("fp8") or {}
    if f8.get("fp8_over_bf16"):
        over = f8["fp8_over_bf16"]
        target("FP8 / bf16 ITL p50, batch 1", "<= 0.62", over.get("itl_p50"), 0.62)
        ttfts = [over.get(f"ttft_{n}") for n in f8.get("ttft_lengths", [])]
        worst = max(ttfts) if ttfts and None not in ttfts else None
        target(f"FP8 / bf16 TTFT at {'-'.join(str(n) for n in f8.get('ttft_lengths', []))} tokens (worst length)",
               "<= 0.75", worst, 0.75)
        target(f"FP8 start to ready after weights are loaded (s; {cache_state(g(f8, 'fp8', 'startup') or {})})",
               "<= 20 s", g(f8, "fp8", "startup", "after_weights_to_ready_s"), 20.0)
    sc = results.get("speculation_client") or {}
    if sc.get("rows"):
        near3 = min(sc["rows"], key=lambda r: abs((r["mean_acceptance_length"] or 0) - 3))
        target(f"speculation at the client, batch 1: time per token / plain at mean acceptance length "
               f"{fmt(near3['mean_acceptance_length'])} (nearest 3)", "<= 0.40", near3["over_plain"], 0.40)
        last = sc["rows"][-1]
        target(f"speculation at the client, batch 1: time per token / plain, all drafts random (mean acceptance "
               f"length {fmt(last['mean_acceptance_length'])})", "<= 1.10", last["over_plain"], 1.10)
        target(f"speculation at the client, {SPEC_STREAMS} streams: tokens/s plain / ngram", "<= 1.00",
               ratio(*(g(sc, n, "streams", "tokens_per_s") for n in ("plain", "ngram"))), 1.0)
    if hy.get("gateway"):
        added = g(hy, "gateway", "added_ttft_p50_s")
        target("HTTP gateway: TTFT p50 added vs the SDK over its socket (ms)", "<= 0.3 ms",
               None if added is None else added * 1e3, 0.3)
        added = g(hy, "gateway", "added_itl_p50_s")
        target("HTTP gateway: ITL p50 added vs the SDK over its socket (ms)", "<= 0.1 ms",
               None if added is None else added * 1e3, 0.1)
    return rows, targets


def cache_state(startup: dict) -> str:
    """Which compile caches the start found empty ("Triton cache cold, Inductor cache
    warm"): a Triton cache left by an earlier part (the breakdown compiles the kernels)
    spares the start most of its compiling, an empty one is a first start on the host."""
    files = startup.get("compile_cache_files_at_spawn")
    if not files:
        return "caches unknown"
    return ", ".join(f"{name.capitalize()} cache {'warm' if n else 'cold'}" for name, n in files.items())


def fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    return f"{v * scale:.{digits}f}"


def render_table(results: dict) -> str:
    rows, targets = results["table"], results["targets"]
    meta, fl, dev = results["meta"], results.get("floors", {}), results.get("device", {})
    lines = [f"hybridd bench {meta['date']}  {dev.get('name', '?')}  {meta.get('shape') or meta.get('model')}  "
             f"client: {meta.get('client', '-')}  code: {meta.get('git') or '-'}, sources {meta.get('source_sha256', '-')}"]
    if dev:
        lines.append(f"copy bw {fmt(dev.get('copy_bandwidth_Bps'), 1e-12)} TB/s  {dev.get('matmul_dtype')} matmul "
                     f"{fmt(dev.get('matmul_flops'), 1e-12, 1)} TFLOP/s  weights {fmt(fl.get('weight_bytes'), 1e-9)} GB  "
                     f"decode floor {fmt(fl.get('decode_floor_s'), 1e3)} ms")
    # (title, key, width, in the row's unit (else a ratio)) of each column after the figure's name.
    columns = (("hybridd", "hybridd", 8, True), ("floor", "floor", 7, True), ("x floor", "x_floor", 7, False),
               ("hyb-eager", "hybridd_eager", 9, True), ("HF eager", "hf_eager", 8, True),
               ("HF static", "hf_static", 9, True), ("/hyb-eag", "hybridd_over_hybridd_eager", 8, False),
               ("/HF-eag", "hybridd_over_hf_eager", 7, False), ("/HF-stat", "hybridd_over_hf_static", 8, False))
    head = f"{'figure (ms)':18s} | " + " | ".join(f"{title:>{width}s}" for title, _, width, _ in columns)
    lines += ["", head, "-" * len(head)]
    for r in rows:
        s = 1e3 if r["unit"] == "s" else 1.0
        lines.append(f"{r['figure']:18s} | " + " | ".join(f"{fmt(r[key], s if scaled else 1.0):>{width}s}"
                                                           for _, key, width, scaled in columns))
    hy = results.get("hybridd", {})
    conc = hy.get("concurrency")
    if conc:
        lines += ["", "streams | tokens/s | decode tok/s | ITL p50 ms | ITL p99 ms | p99/p50 | TTFT med ms"]
        for n, c in conc.items():
            lines.append(f"{n:>7s} | {fmt(c['tokens_per_s'], 1, 0):>8s} | {fmt(c['decode_tokens_per_s'], 1, 0):>12s} | "
                         f"{fmt(c['itl_p50_s'], 1e3):>10s} | {fmt(c['itl_p99_s'], 1e3):>10s} | "
                         f"{fmt(ratio(c['itl_p99_s'], c['itl_p50_s'])):>7s} | {fmt(c['ttft_median_s'], 1e3):>11s}")
    bc = hy.get("background_capture")
    if bc:
        def p(key):
            return f"{fmt(g(bc, key, 'p50_s'), 1e3)}/{fmt(g(bc, key, 'p99_s'), 1e3)} ms (n={g(bc, key, 'n')})"

        lines.append("")
        lines.append(f"ITL p50/p99 during prefill capture {p('during')}, first {bc.get('early_s')} s after ready "
                     f"{p('early')}, steady {p('steady')}")
        lines.append(f"  capture window {fmt(bc.get('capture_window_s'))} s ({bc.get('prefill_buckets_captured')}/"
                     f"{bc.get('prefill_buckets')} prefill buckets); first request after ready: TTFT "
                     f"{fmt(bc.get('first_request_ttft_s'), 1e3)} ms, first token "
                     f"{fmt(bc.get('first_token_after_capture_start_s'))} s after capture began")
        if bc.get("note"):
            lines.append(f"  note: {bc['note']}")
    for name in ("hybridd", "hybridd_eager", *VARIANTS):
        st = g(results, name, "startup")
        if st:
            lines.append(f"{name} start: spawn->ready {fmt(st['spawn_to_ready_s'])} s (imports "
                         f"{fmt(st['interpreter_and_imports_s'])} s, weights {fmt(st['weights_load_s'])} s, "
                         f"after weights -> ready {fmt(st['after_weights_to_ready_s'])} s; "
                         f"{cache_state(st)})")
            ahead = next((p["detail"] for p in st.get("phases", []) if p["detail"].startswith("compiled ")), None)
            if ahead:
                lines.append(f"  kernels compiled ahead: {ahead}")
    gm = hy.get("graph_memory")
    if gm:
        per = ", ".join(f"{b['kind'][0]}{b['size']}:{fmt(b['bytes'], 2**-20, 0)}" for b in gm["buckets"] if b["captured"])
        lines.append(f"graph memory: measured {fmt(gm['graph_bytes'], 2**-20, 1)} MiB, pool "
                     f"{fmt(gm['graph_pool_bytes'], 2**-20, 1)} MiB; per bucket MiB {per}")
    from hybridd.bench.breakdown import render as render_breakdown

    bd, bd8 = results.get("breakdown"), results.get("breakdown_fp8")
    if bd:
        lines += ["", f"where the step goes ({g(bd, 'decode_b1', 'source') or '-'}; each category against its own "
                      f"floor: bytes / copy bandwidth or FLOPs / matmul rate)", *render_breakdown(bd)]
    if bd8:
        lines += ["", f"where the FP8 model's step goes (weights {fmt(bd8.get('weight_bytes'), 1e-9)} GB; GEMM floors "
                      f"on the FP8 bytes)", *render_breakdown(bd8)]
    f8 = results.get("fp8") or {}
    if f8.get("fp8_over_bf16"):
        lines += ["", f"{'FP8 against bf16 (ms)':26s} | {'bf16':>8s} | {'fp8':>8s} | {'fp8/bf16':>8s}"]
        figures = [(f"TTFT {n} tok", ("ttft_s", str(n), "median_s"), f"ttft_{n}") for n in f8.get("ttft_lengths", [])]
        figures += [("ITL p50 (b=1)", ("itl", "p50_s"), "itl_p50"), ("ITL p99 (b=1)", ("itl", "p99_s"), "itl_p99"),
                    ("after weights to ready", ("startup", "after_weights_to_ready_s"), "after_weights_to_ready")]
        for label, keys, over in figures:
            lines.append(f"{label:26s} | {fmt(g(f8, 'bf16', *keys), 1e3):>8s} | {fmt(g(f8, 'fp8', *keys), 1e3):>8s} | "
                         f"{fmt(f8['fp8_over_bf16'].get(over)):>8s}")
        streams = [fmt(g(f8, dtype, "concurrency", str(FP8_STREAMS), "decode_tokens_per_s"), 1, 0)
                   for dtype in ("bf16", "fp8")]
        lines.append(f"{f'{FP8_STREAMS} streams (decode tok/s)':26s} | {streams[0]:>8s} | {streams[1]:>8s} | "
                     f"{fmt(f8['fp8_over_bf16'].get(f'decode_tokens_per_s_{FP8_STREAMS}')):>8s}")
    if f8.get("fp8_kv_over_fp8"):
        over = f8["fp8_kv_over_fp8"]
        lines += ["", f"{'FP8 KV cache (ms)':26s} | {'fp8':>8s} | {'fp8+kv':>8s} | {'kv/fp8':>8s}"]
        for label, keys, name in (("ITL p50 (b=1)", ("itl", "p50_s"), "itl_p50"),
                                  ("ITL p99 (b=1)", ("itl", "p99_s"), "itl_p99")):
            ours, theirs = fmt(g(f8, "fp8", *keys), 1e3), fmt(g(f8, "fp8_kv", *keys), 1e3)
            lines.append(f"{label:26s} | {ours:>8s} | {theirs:>8s} | {fmt(over.get(name)):>8s}")
        streams = [fmt(g(f8, name, "concurrency", str(FP8_STREAMS), "decode_tokens_per_s"), 1, 0)
                   for name in ("fp8", "fp8_kv")]
        lines.append(f"{f'{FP8_STREAMS} streams (decode tok/s)':26s} | {streams[0]:>8s} | {streams[1]:>8s} | "
                     f"{fmt(over.get(f'decode_tokens_per_s_{FP8_STREAMS}')):>8s}")
        blocks = [fmt(g(f8, name, "kv_blocks"), 1, 0) for name in ("fp8", "fp8_kv")]
        lines.append(f"{'KV blocks':26s} | {blocks[0]:>8s} | {blocks[1]:>8s} |")
    sc = results.get("speculation_client") or {}
    if sc.get("rows"):
        pol = sc.get("policy", {})
        lines += ["", f"speculation at the client, batch 1, ngram k={pol.get('num_speculative_tokens')} adaptive "
                      f"{pol.get('speculative_adaptive')}:",
                  "corrupted | accept len | plain ms | ngram ms | /plain | same tokens"]
        for row in sc["rows"]:
            key = f"corruption_{round(row['corruption'] * 100)}"
            lines.append(f"{row['corruption']:>9.2f} | {fmt(row['mean_acceptance_length']):>10s} | "
                         f"{fmt(g(sc, 'plain', key, 's_per_token'), 1e3, 3):>8s} | "
                         f"{fmt(g(sc, 'ngram', key, 's_per_token'), 1e3, 3):>8s} | "
                         f"{fmt(row['over_plain'], 1, 3):>6s} | "
                         f"{row['same_tokens'] and row['plain_follows_target']}")
        lines.append(f"{SPEC_STREAMS} streams tokens/s: plain {fmt(g(sc, 'plain', 'streams', 'tokens_per_s'), 1, 0)}, "
                     f"ngram {fmt(g(sc, 'ngram', 'streams', 'tokens_per_s'), 1, 0)} "
                     f"(x{fmt(sc.get('streams_ratio'), 1, 3)})")
    for name, (_, what, _) in VARIANTS.items():
        vs = g(results, name, "vs_off")
        if vs:
            lines.append(f"{what} vs the default (client, batch 1): ITL p50 {fmt(vs['itl_p50_on_s'], 1e3, 3)} vs "
                         f"{fmt(vs['itl_p50_off_s'], 1e3, 3)} ms (x{fmt(vs['itl_p50_ratio'], 1, 3)}), ITL p99 "
                         f"{fmt(vs['itl_p99_on_s'], 1e3, 3)} vs {fmt(vs['itl_p99_off_s'], 1e3, 3)} ms; " + ", ".join(
                             f"TTFT {n} tok {fmt(vs[f'ttft_{n}_on_s'], 1e3, 3)} vs {fmt(vs[f'ttft_{n}_off_s'], 1e3, 3)} "
                             f"ms (x{fmt(vs[f'ttft_{n}_ratio'], 1, 3)})" for n in BESIDE_TTFT_LENGTHS))
    ce = results.get("capture_evict")
    if ce:
        lines.append(f"ITL p50/p99 during forced prefill capture {fmt(g(ce, 'during', 'p50_s'), 1e3)}/"
                     f"{fmt(g(ce, 'during', 'p99_s'), 1e3)} ms (n={g(ce, 'during', 'n')}), steady "
                     f"{fmt(g(ce, 'steady', 'p50_s'), 1e3)}/{fmt(g(ce, 'steady', 'p99_s'), 1e3)} ms "
                     f"(n={g(ce, 'steady', 'n')}): p99 x{fmt(ce.get('p99_ratio'), 1, 3)}; "
                     f"{ce.get('captures_during_decode')} captures, {ce.get('evictions')} evictions, buckets "
                     f"{g(ce, 'plan', 'x')}/{g(ce, 'plan', 'y')} under a {g(ce, 'config', 'graph_memory_budget_mb')} MiB budget")
        if ce.get("longest_during_gaps"):
            lines.append("  longest gaps during captures: " + "; ".join(
                f"{fmt(x['gap_s'], 1e3)} ms from {fmt(x['after_first_token_s'], 1e3)} ms after the trigger's first "
                f"token (bucket {x['bucket']}, capture {fmt(x['capture_s'], 1e3)} ms)" for x in ce["longest_during_gaps"]))
        if ce.get("note"):
            lines.append(f"  note: {ce['note']}")
    gw = hy.get("gateway")
    if gw:
        lines.append(f"HTTP gateway vs SDK over its socket: TTFT p50 {fmt(g(gw, 'http', 'ttft_p50_s'), 1e3, 3)} vs "
                     f"{fmt(g(gw, 'sdk', 'ttft_p50_s'), 1e3, 3)} ms (+{fmt(gw.get('added_ttft_p50_s'), 1e3, 3)}), "
                     f"ITL p50 {fmt(g(gw, 'http', 'itl_p50_s'), 1e3, 3)} vs {fmt(g(gw, 'sdk', 'itl_p50_s'), 1e3, 3)} "
                     f"ms (+{fmt(gw.get('added_itl_p50_s'), 1e3, 3)})")
    hs = results.get("hf_static", {})
    if hs.get("warmup_s") is not None:
        lines.append(f"HF static warm-up (compile) {fmt(hs['warmup_s'], 1, 1)} s: {hs.get('compile')}")
    lines += ["", "targets (BENCHMARKS.md):"]
    lines += [f"  [{ {True: 'MET ', False: 'MISS', None: 'n/a '}[t['met']]}] {t['target']}: {fmt(t['value'], 1, 3)} "
              f"(goal {t['goal']})" for t in targets]
    if meta.get("skipped"):
        lines += ["", "skipped: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items())]
    if meta.get("errors"):
        lines += ["errors: " + "; ".join(f"{k}: {v.splitlines()[-1] if v else v}" for k, v in meta["errors"].items())]
    lines += [f"note: {note}" for note in meta.get("notes", [])]
    lines.append("parts (s): " + ", ".join(f"{k} {v:.1f}" for k, v in meta["part_s"].items())
                 + f"; total {meta.get('total_s', 0):.1f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybridd bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, help="local HF directory (default: random weights of --preset)")
    p.add_argument("--preset", default=None, choices=("llama2-7b", "llama3-8b", "llama-1b", "small", "tiny"),
                   help="random weights of this shape: llama2-7b (default on CUDA), llama3-8b, llama-1b, small, "
                        "tiny (default on CPU); llama3-8b skips by default " + ", ".join(PRESET_SKIP["llama3-8b"]))
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--quick", action="store_true", help="fewer repetitions and tokens")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip parts that would end later than this")
    p.add_argument("--checkpoint-dir", type=Path, help="where random checkpoints are written (default: tmp)")
    p.add_argument("--parts", default=None, help="comma-separated parts to run, the others skipped (instead of "
                   "--skip; the parts run in the order of the list above)")
    p.add_argument("--skip", default=None, help="comma-separated parts to skip (and `gateway`: the gateway "
                   "figures of the hybridd part); default: none, or the preset's list")
    p.add_argument("--long-prompt", type=int, default=2000, help="tokens of mixed_load's and prefix_reuse's "
                   "long prompts")
    p.add_argument("--turn-tokens", type=int, default=200, help="tokens prefix_reuse's chat adds a turn")
    p.add_argument("--verbose", action="store_true", help="the workers' info logs")
    p.add_argument("--first-start", action=argparse.BooleanOptionalAction, default=True,
                   help="start the `hybridd` part on compile caches of its own, empty (a first start on the host: "
                        "it compiles every kernel); --no-first-start: on those the parts before it filled")
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.preset is None:
        args.preset = "llama2-7b" if args.device == "cuda" else "tiny"
    args.ttft_reps = 3 if args.quick else 7
    args.itl_tokens = 32 if args.quick else ITL_TOKENS
    args.itl_runs = 1 if args.quick else 2
    args.concurrency_tokens = 16 if args.quick else 128

    def parts(flag: str, text: str, empty_ok: bool) -> set[str]:
        named = {s.strip() for s in text.split(",") if s.strip()}
        unknown = sorted(named - SKIPPABLE)
        if unknown or not (named or empty_ok):
            p.error(f"{flag}: unknown part(s) {', '.join(unknown) or '(none named)'}; the parts are "
                    f"{', '.join(sorted(SKIPPABLE))}")
        return named

    if args.skip is None:
        args.skip = ",".join(PRESET_SKIP.get(args.preset, ()))
    args.skip_set = parts("--skip", args.skip, True)
    if args.parts is not None:
        args.skip_set = set(SKIPPABLE) - parts("--parts", args.parts, False)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        environment.export_defaults({"TRITON_INTERPRET": "1"})  # as tests/conftest.py: no kernel compiles on the CPU
    if not args.verbose:
        environment.export_defaults({"HYBRIDD_LOG_LEVEL": "warning"})  # inherited by the spawned workers
    args.out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    deadline = t_begin + args.budget_s
    import torch

    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([sys.executable, *sys.argv]),
        "python": platform.python_version(), "torch": torch.__version__, "preset": args.preset,
        "device": args.device, "quick": args.quick, "budget_s": args.budget_s, "skipped": {}, "errors": {},
        "notes": [], "part_s": {}, "git": git_rev(), "source_sha256": source_digest(),
    }
    with contextlib.suppress(ImportError):
        import transformers

        meta["transformers"] = transformers.__version__
    results: dict[str, Any] = {"meta": meta}
    estimates = ESTIMATE_S_7B if args.preset in LARGE_PRESETS and args.device == "cuda" else ESTIMATE_S_SMALL
    skip = args.skip_set
    meta["shape"] = model_shape_name(args)
    cuda_only = {"hf_static": "CUDA only (reduce-overhead compiles to CUDA graphs)",
                 **{name: f"CUDA only ({why})" for name, (_, _, why) in VARIANTS.items()}}
    shared: dict[str, Any] = {}
    state: dict[str, Any] = {"model": args.model}

    def write() -> None:
        meta["total_s"] = time.perf_counter() - t_begin
        results["table"], results["targets"] = build_report(results)
        (args.out / "bench.json").write_text(json.dumps(results, indent=2, default=str))

    def part(name: str, fn, needs: tuple[str, ...] = (), key: str | None = None) -> None:
        key = key or name
        elapsed = time.perf_counter() - t_begin
        reason = None
        if name in skip:
            reason = "--skip"
        elif args.device != "cuda" and name in cuda_only:
            reason = cuda_only[name]
        elif any(state.get(n) is None for n in needs):
            reason = f"needs {', '.join(needs)}"
        elif name != "checkpoint" and elapsed + estimates.get(name, 0) > args.budget_s:
            reason = f"time budget: {elapsed:.0f} s spent + ~{estimates.get(name, 0)} s > {args.budget_s:.0f} s"
        if reason:
            meta["skipped"][name] = reason
            print(f"[bench] skip {name}: {reason}", flush=True)
            return
        print(f"[bench] {name} ... (t={elapsed:.0f} s)", flush=True)
        t0 = time.perf_counter()
        state["running"] = name
        try:
            out = results.setdefault(key, {})
            value = fn(out)
            if value is not None:
                results[key] = value
            elif not out:
                results.pop(key)
        except Exception as exc:
            meta["errors"][name] = "".join(traceback.format_exception_only(type(exc), exc)).strip() + "\n" + \
                traceback.format_exc(limit=-3)
            print(f"[bench] {name} FAILED: {exc}", flush=True)
            traceback.print_exc()
            if not results.get(key):
                results.pop(key, None)
        state["running"] = None
        meta["part_s"][name] = time.perf_counter() - t0
        print(f"[bench] {name} done in {meta['part_s'][name]:.1f} s", flush=True)
        write()

    def do_ceilings(_):
        state["ceilings"] = device_ceilings(args.device)
        return state["ceilings"]

    def do_checkpoint(_):
        if args.model is None:
            state["model"] = make_model(args)
        meta["model"] = str(state["model"])
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(state["model"]))
        state["vocab"] = config.vocab_size
        elem = 2 if args.device == "cuda" else 4  # hybridd's dtype: bf16 on CUDA, float32 on the CPU
        params = count_params(state["model"])
        if state.get("ceilings"):
            results["floors"] = floors(params, elem, state["ceilings"])
        return None

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        part("ceilings", do_ceilings, key="device")
        part("checkpoint", do_checkpoint)
        if args.model is not None and "model" not in meta:
            meta["model"] = str(args.model)
        vocab = lambda: state["vocab"]  # noqa: E731
        part("breakdown", lambda out: run_breakdown_subprocess(args, state["model"], state["ceilings"], deadline),
             needs=("model", "ceilings"))
        part("hybridd_eager", lambda out: run_hybridd(args, state["model"], vocab(), False, deadline, out),
             needs=("model", "vocab"))
        def do_hybridd(out):
            run = lambda: run_hybridd(args, state["model"], vocab(), True, deadline, out)  # noqa: E731
            return on_empty_compile_caches(run) if args.first_start else run()

        part("hybridd", do_hybridd, needs=("model", "vocab"))
        meta["client"] = g(results, "hybridd", "client") or g(results, "hybridd_eager", "client")

        def variant(name: str) -> None:
            part(name, lambda out: run_variant(args, state["model"], vocab(), deadline, out, results.get("hybridd", {}),
                                               VARIANTS[name][0]), needs=("model", "vocab"))

        for name in VARIANTS:
            if name not in LATE_VARIANTS:
                variant(name)
        part("capture_evict", lambda out: run_capture_evict(args, state["model"], vocab(), meta["notes"]),
             needs=("model", "vocab"))

        def on_daemon(name: str, measure, **overrides) -> None:
            def run(_):
                with start_server(args, state["model"], **overrides) as server:
                    return measure(server.endpoint)

            part(name, run, needs=("model", "vocab"))

        from hybridd.bench.mixed import measure_mixed_load, measure_prefix_reuse

        on_daemon("mixed_load", lambda endpoint: measure_mixed_load(
            endpoint, vocab(), args.long_prompt, args.itl_tokens, args.ttft_reps))
        on_daemon("prefix_reuse", lambda endpoint: measure_prefix_reuse(
            endpoint, vocab(), args.long_prompt, args.turn_tokens, 8, args.ttft_reps))

        def structured(_):
            from hybridd.bench.structured import measure_structured, structured_checkpoint

            model = structured_checkpoint(state["model"], Path(str(state["model"]) + "-bpe"))
            with start_server(args, model) as server:
                return measure_structured(server.endpoint, model, args.itl_tokens, args.ttft_reps)

        part("structured", structured, needs=("model", "vocab"))

        from hybridd.bench.speculation import measure_speculation, measure_speculation_steps

        on_daemon("speculation", lambda endpoint: measure_speculation(
            endpoint, state["model"], vocab(), 16 if args.quick else 64, 1 if args.quick else 3),
            speculative_drafter="ngram")
        part("speculation_steps", lambda out: measure_speculation_steps(
            state["model"], args.device, 16 if args.quick else 64, reps=3 if args.quick else 20,
            quick=args.quick or args.device != "cuda"),
            needs=("model", "vocab"))
        part("speculation_client", lambda out: run_speculation_client(args, out))
        part("hf_eager", lambda out: run_hf(args, state["model"], vocab(), "eager", deadline, shared, out),
             needs=("model", "vocab"))
        part("hf_static", lambda out: run_hf(args, state["model"], vocab(), "static", deadline, shared, out),
             needs=("model", "vocab"))
        part("breakdown_fp8", lambda out: run_breakdown_subprocess(args, state["model"], state["ceilings"], deadline,
                                                                    "fp8"), needs=("model", "ceilings"))
        part("fp8", lambda out: run_fp8(args, state["model"], vocab(), deadline, out), needs=("model", "vocab"))
        for name in LATE_VARIANTS:
            variant(name)
    finally:  # also on SIGTERM (a run past the device's limit): keep what was measured
        if state.get("running"):
            meta["errors"][state["running"]] = "interrupted (SIGTERM or KeyboardInterrupt); partial results kept"
        free_hf(shared)
        write()
        table = render_table(results)
        (args.out / "bench_table.txt").write_text(table + "\n")
        print("\n" + table, flush=True)
    return 0


def model_shape_name(args) -> str:
    """The model as a reader should see it named: its shape and weights, or its directory's name."""
    from hybridd.bench.random_checkpoint import SHAPE_NAMES, describe

    dtype = "bf16" if args.device == "cuda" else "float32"
    if args.model is not None:
        return f"{describe(args.model)} ({dtype})"
    return f"{SHAPE_NAMES.get(args.preset, args.preset)} shape, random {dtype} weights"


def run_breakdown_subprocess(args, model: Path, ceilings: dict, deadline: float, quantization: str = "none") -> dict:
    """hybridd/bench/breakdown.py in its own process (the model quantized as
    `quantization` says): the model it loads and the graphs it captures are gone,
    whatever happens, before the daemons start."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "breakdown.json"
        cmd = [sys.executable, "-m", "hybridd.bench.breakdown", "--model", str(model), "--device",
               args.device, "--out", str(out), "--copy-bandwidth", repr(ceilings["copy_bandwidth_Bps"]),
               "--matmul-flops", repr(ceilings["matmul_flops"]), "--steps", "2" if args.device == "cpu" else "20",
               "--quantization", quantization]
        # Past the budget's end the part is cut short (recorded as failed) and the run goes on.
        timeout = max(60.0, deadline - time.perf_counter())
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"hybridd.bench.breakdown exited {proc.returncode}: {proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def git_rev() -> str | None:
    """HEAD, with `-dirty` when the tree has changes (a copy of a working tree can carry
    an older .git than its files: `source_digest` names the code itself)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


SOURCE_DIRS = ("hybridd", "workers", "ipc", "protocol", "scripts")


def source_digest() -> str:
    """SHA-256 (first 12 hex digits) of the Python sources that ran, paths and contents:
    the same code gives the same digest wherever it was copied."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]

