"""The FP8 GEMMs alone on the GPU, against the copy bandwidth and the matmul rates.

    python -m scripts.bench_fp8 --out fp8_gemm.json            # both shapes, ~1-2 minutes on an H100
    python -m scripts.bench_fp8 --out x.json --shapes llama3-8b --quick
    python -m scripts.bench_fp8 --out x.json --device cpu --shapes tiny --quick   # smoke: Triton's interpreter

- `decode`: the skinny GEMM at 1-32 rows on each projection of the Llama-2-7B and
  Llama-3-8B shapes: GB/s on the FP8 bytes it must read (weight, scales), as a fraction
  of the copy bandwidth (the target: >= 0.85), beside the bf16 weight's skinny GEMM on
  the bf16 bytes; and, for one shape at 1 row (`--sweep`), the configs around
  `config_for`'s FP8 rule, so that a better one shows.
- `prefill`: each projection at 128-2,048 rows through both prefill candidates
  (`scaled_mm`: per-token quantization + torch._scaled_mm; `dequant`: the Triton GEMM
  converting the weight in registers) and cuBLAS bf16: TFLOP/s, and per row count the
  candidate whose four projections together take least (`winner`): the measurement
  that settles `KernelChoices.fp8_prefill`.

Weights rotate over enough copies to exceed the L2 cache, so each launch reads its
weight from memory as in a model's step. On the CPU (`--device cpu`, the kernels in
Triton's interpreter, float32 activations) the figures mean nothing: it checks the
script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from scripts.timing import device_ceilings, median_time

SHAPES = {
    "llama2-7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "tiny": {"qkv": (128, 64), "o": (64, 64), "gate_up": (352, 64), "down": (64, 176)},  # the CPU smoke's
}
DECODE_ROWS = (1, 8, 32)
PREFILL_ROWS = (128, 512, 2048)
# Bytes of weights each timed rotation reads at least (the H100's L2 is 50 MB).
ROTATION_BYTES = 512 << 20
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


def count_for(nbytes: int) -> int:
    """Copies of a weight of `nbytes` that one timed rotation cycles over (4 on the CPU)."""
    return max(4, min(64, -(-ROTATION_BYTES // nbytes))) if DEVICE == "cuda" else 4


def sweep_configs(base):
    """`config_for`'s FP8 config and its neighbours: block_k halved and doubled, a stage
    more and less, 32-row and twice as tall tiles of N, eight warps, K split in twice as
    many parts (half the weight bytes a program: more programs where N's tiles leave
    multiprocessors idle, o and down)."""
    from dataclasses import replace

    out = [base]
    for change in ({"block_k": base.block_k // 2}, {"block_k": base.block_k * 2}, {"num_stages": base.num_stages + 1},
                   {"num_stages": base.num_stages - 1}, {"block_n": 32}, {"block_n": base.block_n * 2},
                   {"num_warps": 8}, {"split_k": 2 * base.split_k}):
        c = replace(base, **change)
        if c not in out and c.block_k >= 64 and c.num_stages >= 2:
            out.append(c)
    return out


def bench_decode(shapes: dict, copy_bw: float, iters: int, sweep: str | None,
                 rows: tuple[int, ...] = DECODE_ROWS) -> dict:
    import torch

    from hybridd.kernels import triton_gemm

    out = {}
    for shape_name, projections in shapes.items():
        for name, (n, k) in projections.items():
            f8 = fp8_copies(n, k, count_for(n * k))
            b16 = bf16_copies(n, k, count_for(2 * n * k))
            for m in rows:
                x = torch.randn(m, k, device=DEVICE, dtype=activation_dtype())
                fp8_bytes = n * k + 4 * n
                t8 = rotated_time(lambda w: triton_gemm.skinny(x, w), f8, iters)
                t16 = rotated_time(lambda w: triton_gemm.skinny(x, w), b16, iters)
                row = {"n": n, "k": k, "rows": m, "config": repr(triton_gemm.config_of(m, f8[0])),
                       "fp8_s": t8, "fp8_GBps": fp8_bytes / t8 / 1e9, "fp8_x_copy_bw": fp8_bytes / t8 / copy_bw,
                       "bf16_s": t16, "bf16_GBps": 2 * n * k / t16 / 1e9, "bf16_x_copy_bw": 2 * n * k / t16 / copy_bw,
                       "fp8_over_bf16_time": t8 / t16}
                if shape_name == sweep and m == 1:
                    base = triton_gemm.config_of(m, f8[0])
                    tried = []
                    for config in sweep_configs(base):
                        try:
                            t = rotated_time(lambda w, c=config: triton_gemm.launch(x, w, None, c), f8, iters)
                            tried.append({"config": repr(config), "s": t, "x_copy_bw": fp8_bytes / t / copy_bw})
                        except Exception as exc:  # out of shared memory, say: recorded, not fatal
                            tried.append({"config": repr(config), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                    row["sweep"] = sorted(tried, key=lambda r: r.get("s", float("inf")))
                out[f"{shape_name}.{name}.m{m}"] = row
                print(f"decode {shape_name:9s} {name:7s} m={m:2d}: fp8 {row['fp8_GBps']:7.0f} GB/s "
                      f"({row['fp8_x_copy_bw']:.2f} x copy)  bf16 {row['bf16_GBps']:7.0f} GB/s  "
                      f"time fp8/bf16 {row['fp8_over_bf16_time']:.2f}", flush=True)
            del f8, b16
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return out


def bench_prefill(shapes: dict, iters: int, rows: tuple[int, ...]) -> dict:
    import torch
    import torch.nn.functional as F

    from hybridd.kernels import triton_fp8, triton_gemm, triton_quantize

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
                q, s = triton_quantize.quantize_tokens(x, triton_fp8.dynamic(f8[0]))
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
        fp8 = {c: total[c] for c in ("scaled_mm", "dequant")}
        best = min(fp8, key=fp8.get)
        winners[key] = {"winner": best, **{f"{c}_layer_s": t for c, t in total.items()},
                        "winner_over_bf16": fp8[best] / total["bf16_cublas"]}
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
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="llama2-7b,llama3-8b", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--quick", action="store_true", help="fewer iterations and row counts, no config sweep")
    parser.add_argument("--parts", default="decode,prefill", help="comma list of decode, prefill")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the kernels in Triton's interpreter, to check the script runs")
    parser.add_argument("--sweep", default="llama3-8b", help="the shape whose decode configs are swept at 1 row "
                        "(each config compiles: about a second each); none: no sweep")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
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
            result["decode"] = bench_decode(shapes, result["copy_bandwidth_Bps"], iters,
                                            sweep=None if args.quick else args.sweep,
                                            rows=DECODE_ROWS if DEVICE == "cuda" or not args.quick else (1, 17))
            args.out.write_text(json.dumps(result, indent=2))
        if "prefill" in parts:
            rows = PREFILL_ROWS if not args.quick else PREFILL_ROWS[:2] if DEVICE == "cuda" else (40,)
            result["prefill"] = bench_prefill(shapes, iters, rows)
    result["seconds"] = time.perf_counter() - t0
    args.out.write_text(json.dumps(result, indent=2))
    if "decode" in result:
        fractions = [r["fp8_x_copy_bw"] for r in result["decode"].values()]
        print(f"decode GEMM: FP8 bytes at {min(fractions):.2f}-{max(fractions):.2f} x copy bandwidth "
              f"(target >= 0.85)")
    for key, w in (result.get("prefill") or {}).get("layer", {}).items():
        print(f"prefill layer {key}: winner {w['winner']}, {w['winner_over_bf16']:.2f} x bf16 cuBLAS time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
