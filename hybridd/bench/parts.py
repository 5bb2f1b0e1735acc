"""The parts' runners that are not a module of their own: the checkpoint (random weights,
the floors), the `hybridd` and `hybridd_eager` parts, a variant beside the default, forced
capture (capture_evict), speculation at the client, FP8 against bf16, and the kernel
breakdown in its own process.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridd.bench.measurements import (graph_memory, measure_batch1, measure_concurrency, measure_during_capture,
                                        measure_itl)
from hybridd.bench.plan import BESIDE_TTFT_LENGTHS, FP8_STREAMS, ITL_PROMPT, SPEC_STREAMS, TTFT_LENGTHS
from hybridd.bench.provenance import ROOT
from hybridd.bench.report import dig
from hybridd.bench.server import open_client, sdk_on_server, start_server
from hybridd.bench.timing import ratio

CONCURRENCY = (1, 4, 16, 32)


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


def run_variant(args, model: Path, vocab: int, deadline: float, result: dict, base: dict, overrides: dict) -> None:
    """The graphs-on daemon again with `overrides` in its config: TTFT and batch-1 ITL
    at the client, divided by the same figures of this run's `hybridd` part."""
    with sdk_on_server(args, model, result, **overrides) as (_, client):
        measure_batch1((client.ttft, client.gaps), BESIDE_TTFT_LENGTHS, args, vocab, random.Random(4), deadline,
                       result)
    result["vs_off"] = beside_comparison(result, base)


def beside_comparison(on: dict, off: dict) -> dict:
    """On ÷ off for ITL p50/p99 at batch 1 and TTFT p50 at each length both measured."""
    out = {"itl_p50_on_s": dig(on, "itl", "p50_s"), "itl_p50_off_s": dig(off, "itl", "p50_s"),
           "itl_p99_on_s": dig(on, "itl", "p99_s"), "itl_p99_off_s": dig(off, "itl", "p99_s")}
    out["itl_p50_ratio"] = ratio(out["itl_p50_on_s"], out["itl_p50_off_s"])
    out["itl_p99_ratio"] = ratio(out["itl_p99_on_s"], out["itl_p99_off_s"])
    for n in BESIDE_TTFT_LENGTHS:
        a, b = dig(on, "ttft_s", str(n), "median_s"), dig(off, "ttft_s", str(n), "median_s")
        out[f"ttft_{n}_on_s"], out[f"ttft_{n}_off_s"], out[f"ttft_{n}_ratio"] = a, b, ratio(a, b)
    return out


# TTFT lengths of the `fp8` part, below `--long-prompt`, which is the last.
FP8_TTFT_LENGTHS = (128, 500)


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
            part["kv_blocks"] = dig(status, "kv_blocks", "total")
    figures = {"itl_p50": ("itl", "p50_s"), "itl_p99": ("itl", "p99_s"),
               f"decode_tokens_per_s_{FP8_STREAMS}": ("concurrency", str(FP8_STREAMS), "decode_tokens_per_s"),
               "after_weights_to_ready": ("startup", "after_weights_to_ready_s"),
               **{f"ttft_{n}": ("ttft_s", str(n), "median_s") for n in lengths}}
    result["ttft_lengths"] = list(lengths)
    result["fp8_over_bf16"] = {name: ratio(dig(result["fp8"], *keys), dig(result["bf16"], *keys))
                               for name, keys in figures.items()}
    decode = ("itl_p50", "itl_p99", f"decode_tokens_per_s_{FP8_STREAMS}")
    result["fp8_kv_over_fp8"] = {name: ratio(dig(result["fp8_kv"], *figures[name]), dig(result["fp8"], *figures[name]))
                                 for name in decode}


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
    result["policy"] = {"num_speculative_tokens": dig(result, "ngram", "speculation", "num_speculative_tokens"),
                        "speculative_adaptive": Config().speculative_adaptive, "tokens": tokens, "reps": reps}
    result["rows"] = [{
        "corruption": r, "mean_acceptance_length": dig(result, "ngram", f"corruption_{round(r * 100)}",
                                                       "mean_acceptance_length"),
        "over_plain": ratio(*(dig(result, n, f"corruption_{round(r * 100)}", "s_per_token")
                              for n in ("ngram", "plain"))),
        "same_tokens": outputs["ngram", r] == outputs["plain", r],
        "plain_follows_target": all(out == [perm[ids[-1]]] + [perm[t] for t in out[:-1]]
                                    for ids, out in zip(prompts[r][1:], outputs["plain", r])),
    } for r in CORRUPTIONS]
    result["streams_ratio"] = ratio(dig(result, "ngram", "streams", "tokens_per_s"),
                                    dig(result, "plain", "streams", "tokens_per_s"))


def run_capture_evict(args, model: Path, vocab: int, notes: list[str]) -> dict:
    """Prefill graphs captured while a decode stream runs, forced by a small graph budget
    and demand for the evicted bucket (hybridd/bench/capture.py)."""
    from hybridd.bench.capture import measure_capture_under_eviction

    return measure_capture_under_eviction(open_client, model, args.device == "cuda", vocab, args.quick,
                                          lambda **overrides: start_server(args, model, **overrides), notes)


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
