"""The FP8 GEMMs alone on the GPU, against the copy bandwidth and the matmul rates.

    python -m hybridd.bench.fp8 --out fp8_gemm.json --parts decode  # the decode sweep (docs/lab/benchmarks.md)
    python -m hybridd.bench.fp8 --out fp8_gemm.json --parts prefill --quick
    python -m hybridd.bench.fp8 --out x.json --device cpu --shapes tiny --quick   # smoke: Triton's interpreter

- `decode`: the skinny GEMM at 1-32 rows on each projection of the Llama-2-7B and
  Llama-3-8B shapes, each launch timed inside a CUDA graph (20 launches back to back on
  weight copies that overflow the L2 cache, replayed): the bf16 weight's rule config, and
  the FP8 candidates (`candidates`: the FP8 rule's config, the tensor-core kernel
  converting to bf16 or to float16, the CUDA-core kernel up to 8 rows, then their
  neighbours while `--budget-s` lasts). GB/s on the bytes each must read (FP8: weight and
  scales) against the copy bandwidth (the target: >= 0.85); per product the fastest form
  (`best`) and the FP8 rule's time (`rule_s`), against which `triton_gemm.fp8_rule_config`
  is checked (tests/data/fp8_decode_sweep.json holds the summary of the H100 sweep).
- `prefill`: each projection at 128-2,048 rows through both FP8 prefill kernels
  (`scaled_mm`: per-token quantization + torch._scaled_mm, the one a prefill runs;
  `dequant`: the Triton GEMM converting the weight in registers, its fallback for shapes
  torch._scaled_mm does not take) and cuBLAS bf16: TFLOP/s, and per row count the kernel
  whose four projections together take least (`winner`): the measurement that chose
  `scaled_mm`. Timed from the host, launches overlapping.

Weights rotate over enough copies to exceed the L2 cache, so each launch reads its
weight from memory as in a model's step. On the CPU (`--device cpu`, the kernels in
Triton's interpreter, float32 activations) the figures mean nothing: it checks the
script runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from hybridd import environment
from hybridd.bench.timing import device_ceilings, median_time

SHAPES = {
    "llama2-7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "tiny": {"qkv": (128, 64), "o": (64, 64), "gate_up": (352, 64), "down": (64, 176)},  # the CPU smoke's
}
DECODE_ROWS = (1, 4, 8, 16, 32)
PREFILL_ROWS = (128, 512, 2048)
# Where the GEMMs run and in which activation dtype (`--device`; bf16 on the GPU, float32
# in Triton's interpreter, whose bf16 products are wrong).
DEVICE = "cuda"


def activation_dtype():
    import torch

    return torch.bfloat16 if DEVICE == "cuda" else torch.float32


def rotated_time(fn_of, copies, iters: int) -> float:
    """Median seconds per call of fn_of(copy), cycling over `copies` back to back: GPU
    time by CUDA events (host time on the CPU)."""
    from itertools import cycle

    for c in copies[:2]:
        fn_of(c)
    rotation = cycle(copies)
    return median_time(lambda: fn_of(next(rotation)), iters, DEVICE == "cuda", per_round=len(copies))


def fp8_copies(n: int, k: int, count: int):
    import torch

    from hybridd.kernels.fp8 import Fp8Weight, quantize_rows

    base = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
    w, s = quantize_rows(base)
    del base
    return [Fp8Weight(w.clone(), s.clone()) for _ in range(count)]


def bf16_copies(n: int, k: int, count: int):
    """The weight in the activation dtype (bf16 on the GPU)."""
    import torch

    base = torch.randn(n, k, device=DEVICE, dtype=activation_dtype()) * 0.02
    return [base.clone() for _ in range(count)]


# Decode launches a captured graph replays back to back: the kernels' own time, no host launch.
GRAPH_LAUNCHES = 20
# Bytes the launches of one graph cycle over at least, so that no launch finds its weight in
# the L2 cache (the H100's is 50 MB).
GRAPH_ROTATION_BYTES = 160 << 20


def graph_copies(nbytes: int) -> int:
    """Copies of a weight of `nbytes` a graph's launches cycle over (2 on the CPU)."""
    return max(2, min(GRAPH_LAUNCHES, -(-GRAPH_ROTATION_BYTES // nbytes))) if DEVICE == "cuda" else 2


def graph_time(launch, copies) -> float:
    """Seconds per launch of launch(copy) (the GPU: GRAPH_LAUNCHES of them cycling over
    `copies`, captured in one CUDA graph, the median of five replays; the CPU: host time)."""
    import torch

    if DEVICE != "cuda":
        return rotated_time(launch, copies, 1)
    if launch(copies[0]) is None:
        raise ValueError("the kernel does not take this product")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_LAUNCHES):
            launch(copies[i % len(copies)])
    graph.replay()
    seconds = median_time(graph.replay, 5, True) / GRAPH_LAUNCHES
    del graph
    return seconds


def candidates(m: int, n: int, k: int, multiprocessors: int) -> list:
    """The first configs to time for an FP8 weight [n, k] at m rows, the likelier first:
    the FP8 rule's config (`triton_gemm.fp8_rule_config`); up to FMA_ROWS rows, a
    CUDA-core config whose programs fill the GPU four times over; the bf16 rule's tiles
    (256-column steps where it takes 128: the same weight bytes a stage) in the three
    tensor-core forms (W converted to bf16 or to float16, the first or the second
    operand)."""
    from dataclasses import replace

    from hybridd.kernels import triton_gemm
    from hybridd.kernels.triton_gemm import GemmConfig

    first = [triton_gemm.rule_config(m, n, k, multiprocessors, weight_bytes=1)]
    if m <= triton_gemm.FMA_ROWS:
        block_n = 16 if m <= 2 else 8
        split = 1
        while -(-n // block_n) * split < 4 * multiprocessors and k // (2 * split) >= 1024:
            split *= 2
        fma = GemmConfig(block_n, 256, split, 4, 1, kernel="fma")  # 1 stage: each tile loaded when used
        first += [fma] if fma not in first else []
    tiles = triton_gemm.rule_config(m, n, k, multiprocessors, weight_bytes=2)
    if tiles.block_k == 128:
        tiles = replace(tiles, block_k=256)
    forms = [replace(tiles, kernel=kernel) for kernel in ("dot_f16_t", "dot_f16", "dot")]
    return first + [c for c in forms if c not in first]


def neighbours(bases: list, m: int) -> list:
    """The configs one field away from `bases` (halved or doubled: block_n, block_k,
    split_k; eight warps; a stage more and less), each base's first change first."""
    from dataclasses import replace

    def changed(b):
        # The CUDA-core form has two: with its weight tile loaded a step ahead (2) or not (1).
        stages = [3 - b.num_stages] * 2 if b.kernel == "fma" else [b.num_stages + 1, b.num_stages - 1]
        return [replace(b, block_n=b.block_n // 2), replace(b, block_n=b.block_n * 2),
                replace(b, block_k=b.block_k // 2), replace(b, block_k=b.block_k * 2),
                replace(b, split_k=b.split_k * 2), replace(b, split_k=b.split_k // 2), replace(b, num_warps=8),
                *(replace(b, num_stages=stage) for stage in stages)]

    out = []
    for same_change in zip(*(changed(b) for b in bases)):
        for c in same_change:
            per_thread = c.block_n * c.block_k // (32 * c.num_warps)  # FP8 bytes; fma: accumulators a row
            if (c not in bases + out and c.block_n >= 8 and c.block_k >= 64 and c.split_k >= 1
                    and c.num_stages >= 1 and (c.kernel != "fma" or (per_thread >= 8 and per_thread * m <= 128))):
                out.append(c)
    return out


def _precompile(jobs, pool, deadline: float) -> None:
    """Compile the kernels `jobs` (callables that launch one) would, in `pool`'s processes
    (`kernel_precompile`: the launches recorded, not run), a batch of twice its workers
    at a time while time is left; what is left compiles at its first timed launch."""
    from hybridd.runtime.kernel_precompile import precompile

    if pool is None:
        return
    batch = 2 * pool.workers
    for i in range(0, len(jobs), batch):
        if time.monotonic() > deadline:
            return
        try:
            precompile(lambda: [job() for job in jobs[i:i + batch]], pool)
        except Exception as exc:  # an optimisation only: the launches compile what it did not
            print(f"precompile: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return


def bench_decode(shapes: dict, copy_bw: float, rows: tuple[int, ...], budget_s: float, sweep: bool,
                 pool=None) -> dict:
    """Each projection at each row count: the bf16 weight's skinny GEMM (its rule's config)
    and the FP8 candidates (`candidates`), each timed in a CUDA graph (`graph_time`); the
    neighbours only while `budget_s` lasts, taken in turn across the products so that
    each gets some. GB/s on the bytes each must read (FP8: weight and scales)."""
    import torch

    from hybridd.kernels import triton_gemm
    from hybridd.kernels.triton_gemm import GemmConfig

    deadline = time.monotonic() + budget_s
    mps = triton_gemm._multiprocessors(torch.device(DEVICE))
    weights, products = {}, []
    for shape_name, projections in shapes.items():
        for name, (n, k) in projections.items():
            if (n, k) in weights:  # Llama-3-8B's o is Llama-2-7B's
                continue
            weights[(n, k)] = (fp8_copies(n, k, graph_copies(n * k)), bf16_copies(n, k, graph_copies(2 * n * k)))
            for m in rows:
                x = torch.randn(m, k, device=DEVICE, dtype=activation_dtype())
                products.append((f"{shape_name}.{name}.m{m}", n, k, m, x, candidates(m, n, k, mps)))
    out = {key: {"n": n, "k": k, "rows": m, "rule": first[0], "candidates": []} for key, n, k, m, x, first in products}

    def time_config(key, n, k, x, config):
        fp8_bytes = n * k + 4 * n
        row = {"config": dataclasses.asdict(config)}
        try:
            row["s"] = graph_time(lambda w: triton_gemm.launch(x, w, None, config), weights[(n, k)][0])
            row |= {"GBps": fp8_bytes / row["s"] / 1e9, "x_copy_bw": fp8_bytes / row["s"] / copy_bw}
        except Exception as exc:  # out of shared memory, say: recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        out[key]["candidates"].append(row)

    # The first candidates of every product in turns (each one's rule config, then each
    # one's second candidate, ...: past the budget, only the rule's are timed); then the
    # neighbours of each product's two fastest, in turns, while the budget lasts.
    first_jobs = [(p[0], p[1], p[2], p[4], p[5][i]) for i in range(max(len(p[5]) for p in products))
                  for p in products if i < len(p[5])]
    bf16_jobs = [lambda x=x, w=weights[(n, k)][1][0]: triton_gemm.skinny(x, w) for _, n, k, _, x, _ in products]
    _precompile(bf16_jobs + [lambda j=j: triton_gemm.launch(j[3], weights[(j[1], j[2])][0][0], None, j[4])
                             for j in first_jobs], pool, deadline)
    for key, n, k, m, x, _ in products:
        try:
            out[key]["bf16_s"] = graph_time(lambda w: triton_gemm.skinny(x, w), weights[(n, k)][1])
        except Exception as exc:  # recorded; the FP8 candidates are what this part is for
            out[key]["bf16_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    for job in first_jobs:
        if job[4] == out[job[0]]["rule"] or time.monotonic() < deadline:
            time_config(*job)
    print(f"decode: first candidates timed at {time.monotonic() - deadline + budget_s:.0f} s", flush=True)
    if not sweep:
        return summarise(out, copy_bw)
    more = []
    for key, n, k, m, x, first in products:
        timed = sorted((c for c in out[key]["candidates"] if "s" in c), key=lambda c: c["s"])
        bases = [GemmConfig(**c["config"]) for c in timed[:2]]
        more.append([(key, n, k, x, c) for c in neighbours(bases, m)])
    jobs = [p[i] for i in range(max(map(len, more), default=0)) for p in more if i < len(p)]
    chunk = 2 * pool.workers if pool is not None else 16
    for i in range(0, len(jobs), chunk):
        if time.monotonic() > deadline:
            print(f"decode sweep: budget spent, {len(jobs) - i} of {len(jobs)} neighbours left untimed", flush=True)
            break
        _precompile([lambda j=j: triton_gemm.launch(j[3], weights[(j[1], j[2])][0][0], None, j[4])
                     for j in jobs[i:i + chunk]], pool, deadline)
        for job in jobs[i:i + chunk]:
            if time.monotonic() < deadline:
                time_config(*job)
    return summarise(out, copy_bw)


def summarise(out: dict, copy_bw: float) -> dict:
    """Each product's candidates fastest first, its `best` config and figures, printed."""
    for key, row in out.items():
        n, k = row["n"], row["k"]
        rule = row["candidates"][0] if row["candidates"] else {}  # timed first
        row["rule"] = repr(row["rule"])
        timed = sorted((c for c in row["candidates"] if "s" in c), key=lambda c: c["s"])
        if not timed:
            print(f"decode {key}: no candidate ran", flush=True)
            continue
        best = timed[0]
        bf16_s = row.get("bf16_s", float("nan"))
        row |= {"best": best["config"], "fp8_s": best["s"], "fp8_GBps": best["GBps"],
                "fp8_x_copy_bw": best["x_copy_bw"], "rule_s": rule.get("s"), "bf16_GBps": 2 * n * k / bf16_s / 1e9,
                "bf16_x_copy_bw": 2 * n * k / bf16_s / copy_bw, "fp8_over_bf16_time": best["s"] / bf16_s,
                "candidates": timed + [c for c in row["candidates"] if "s" not in c]}
        cfg = best["config"]
        forms = {}
        for c in timed:
            forms.setdefault(c["config"]["kernel"], c["GBps"])
        row["form_GBps"] = forms
        print(f"decode {key:24s}: fp8 {best['GBps']:5.0f} GB/s ({best['x_copy_bw']:.2f} x copy) bf16 "
              f"{row['bf16_GBps']:5.0f}  fp8/bf16 time {row['fp8_over_bf16_time']:.2f}  {cfg['kernel']} "
              f"{cfg['block_n']}x{cfg['block_k']}/{cfg['split_k']} w{cfg['num_warps']} s{cfg['num_stages']}  forms "
              + " ".join(f"{kernel} {gbps:.0f}" for kernel, gbps in forms.items()), flush=True)
    return out


def bench_prefill(shapes: dict, iters: int, rows: tuple[int, ...]) -> dict:
    import torch
    import torch.nn.functional as F

    from hybridd.kernels import fp8, triton_fp8, triton_gemm, triton_quantize

    out, totals = {}, {}
    for shape_name, projections in shapes.items():
        for name, (n, k) in projections.items():
            f8 = fp8_copies(n, k, 4)
            b16 = bf16_copies(n, k, 4)
            for m in rows:
                x = torch.randn(m, k, device=DEVICE, dtype=activation_dtype())
                flop = 2.0 * m * n * k
                times = {
                    "scaled_mm": rotated_time(lambda w: triton_fp8.prefill_scaled_mm(x, w), f8, iters),
                    "dequant": rotated_time(lambda w: triton_fp8.prefill_dequant(x, w), f8, iters),
                    "bf16_cublas": rotated_time(lambda w: F.linear(x, w), b16, iters),
                }
                q, s = triton_quantize.quantize_tokens(x, fp8.dynamic(f8[0]))
                w0 = f8[0]
                times["scaled_mm_without_quantize"] = rotated_time(
                    lambda w: torch._scaled_mm(q, w.weight.t(), scale_a=s[:, None], scale_b=w.scale[None, :],
                                               out_dtype=x.dtype), f8, iters)
                times["quantize_tokens"] = rotated_time(lambda w: triton_quantize.quantize_tokens(x, w), [w0] * 4,
                                                        iters)
                mps = triton_gemm._multiprocessors(x.device)
                row = {"n": n, "k": k, "rows": m, "dequant_config": repr(triton_fp8.prefill_config(m, n, mps)),
                       **{f"{key}_s": t for key, t in times.items()},
                       **{f"{key}_TFLOPs": flop / t / 1e12 for key, t in times.items() if key != "quantize_tokens"}}
                out[f"{shape_name}.{name}.m{m}"] = row
                total = totals.setdefault(f"{shape_name}.m{m}", {})
                for key, t in times.items():
                    total[key] = total.get(key, 0.0) + t
                print(f"prefill {shape_name:9s} {name:7s} m={m:4d}: " + "  ".join(
                    f"{key} {flop / t / 1e12:6.0f} TF/s" for key, t in times.items() if key != "quantize_tokens")
                    + f"  (quantize {times['quantize_tokens'] * 1e6:.0f} us)", flush=True)
            del f8, b16
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    winners = {}
    for key, total in totals.items():
        kernels = {c: total[c] for c in ("scaled_mm", "dequant")}
        best = min(kernels, key=kernels.get)
        winners[key] = {"winner": best, **{f"{c}_layer_s": t for c, t in total.items()},
                        "winner_over_bf16": kernels[best] / total["bf16_cublas"]}
    return {"projections": out, "layer": winners}


def fp8_matmul_rate(n: int = 8192) -> float:
    """FP8 × FP8 FLOP/s of an n × n × n torch._scaled_mm with rowwise scales."""
    import torch

    a = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=DEVICE), torch.ones(1, n, device=DEVICE)

    def run():
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=activation_dtype())

    return 2 * n**3 / rotated_time(lambda _: run(), [None] * 3, 10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the JSON written")
    parser.add_argument("--shapes", default="llama2-7b,llama3-8b", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--quick", action="store_true", help="fewer iterations and row counts, no config sweep")
    parser.add_argument("--parts", default="decode,prefill", help="comma list of decode, prefill")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the kernels in Triton's interpreter, to check the script runs")
    parser.add_argument("--budget-s", type=float, default=95.0,
                        help="seconds the decode part may take: the neighbours of the first candidates while it lasts")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is required")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        environment.export_defaults({"TRITON_INTERPRET": "1"})  # before any kernel module is imported
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("the FP8 GEMMs are timed on a GPU (--device cpu: a smoke run in Triton's interpreter)")
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    shapes = {s: SHAPES[s] for s in names}
    parts = {p.strip() for p in args.parts.split(",")}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        pool = None
        if DEVICE == "cuda" and "decode" in parts:
            # Compiler processes for the decode candidates' kernels, importing while the ceilings are measured.
            from hybridd.runtime.kernel_precompile import CompilePool

            pool = stack.enter_context(CompilePool(max(1, min(16, (os.cpu_count() or 2) - 1))))
        result = measure(args, shapes, parts, pool)
    result["seconds"] = time.perf_counter() - t0
    args.out.write_text(json.dumps(result, indent=2))
    if "decode" in result:
        fractions = [r["fp8_x_copy_bw"] for r in result["decode"].values() if "fp8_x_copy_bw" in r]
        print(f"decode GEMM: FP8 bytes at {min(fractions):.2f}-{max(fractions):.2f} x copy bandwidth "
              f"(target >= 0.85); {result['seconds']:.0f} s", flush=True)
    for key, w in (result.get("prefill") or {}).get("layer", {}).items():
        print(f"prefill layer {key}: winner {w['winner']}, {w['winner_over_bf16']:.2f} x bf16 cuBLAS time")
    return 0


def measure(args, shapes: dict, parts: set, pool) -> dict:
    """The ceilings, then the parts asked for; the JSON written after each."""
    import torch

    ceilings = device_ceilings(DEVICE)
    result = {"device": ceilings["name"], "torch": torch.__version__, "quick": args.quick,
              "copy_bandwidth_Bps": ceilings["copy_bandwidth_Bps"], "bf16_matmul_flops": ceilings["matmul_flops"],
              "matmul_dtype": ceilings["matmul_dtype"],
              "fp8_matmul_flops": fp8_matmul_rate(8192 if DEVICE == "cuda" else 256)}
    print(f"{result['device']}: copy {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, {result['matmul_dtype']} "
          f"{result['bf16_matmul_flops'] / 1e12:.0f} TF/s, fp8 {result['fp8_matmul_flops'] / 1e12:.0f} TF/s",
          flush=True)
    iters = 10 if not args.quick else 5 if DEVICE == "cuda" else 1
    with torch.inference_mode():
        if "decode" in parts:
            result["decode"] = bench_decode(shapes, result["copy_bandwidth_Bps"],
                                            DECODE_ROWS if DEVICE == "cuda" or not args.quick else (1, 17),
                                            args.budget_s, sweep=not args.quick, pool=pool)
            args.out.write_text(json.dumps(result, indent=2))
        if "prefill" in parts:
            rows = PREFILL_ROWS if not args.quick else PREFILL_ROWS[:2] if DEVICE == "cuda" else (40,)
            result["prefill"] = bench_prefill(shapes, iters, rows)
    return result


if __name__ == "__main__":
    sys.exit(main())
