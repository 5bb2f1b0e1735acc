"""Microbenchmark of the paged attention kernels on the GPU.

    python scripts/bench_attention.py [--old path/to/old_triton_attention.py] [--sweep] [--out DIR]

Decode attention at batch 1/8/32 × context 512/4096 for the Llama-2-7B (32 heads, 32 kv
heads, d 128) and Llama-3-8B (32 / 8, d 128) attention shapes, bf16, block size 16, block
tables as wide as a 4096-token max_model_len and filled with shuffled blocks: time per
call and the KV bytes read over that time as a share of the measured device copy
bandwidth (the floor). Each call is timed as the model runs it: a CUDA graph of one call
per layer over distinct caches (as many layers as keep the data well past the L2 cache),
replayed; time per call is a replay's time over the layers. `--old` times another module
with the same `decode_attention` signature beside it (e.g. an earlier version of
hybridd/kernels/triton_attention.py); `--sweep` also times other launch plans and prints
the best per case. Every timed kernel's output is checked against the torch reference.

Prefill attention over one packed sequence of 16/128/512/2048 tokens: the Triton varlen
kernel against torch SDPA with the packed-step mask (the torch path), time and TFLOP/s
of the causal attention. `--prefill-sweep` instead times launch plans of the prefill
kernel at 48-1024 tokens, each call inside a CUDA graph as the step runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import old_attention_option  # noqa: E402
from bench_graphs import copy_bandwidth  # noqa: E402
from hybridd.kernels import attention as ref_attention  # noqa: E402
from hybridd.kernels import triton_attention  # noqa: E402
from hybridd.model.step_inputs import StepInputs  # noqa: E402

SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
PAGE = 16
MAX_MODEL_LEN = 4096
DTYPE = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def graph_time_ms(fn, calls: int, rep: int = 150) -> float:
    """Median time of one replay of a graph of `fn`, over the calls it makes."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median") / calls


class DecodeCase:
    def __init__(self, shape: str, batch: int, ctx: int):
        heads, kv_heads, d = SHAPES[shape]
        self.name, self.batch, self.ctx = shape, batch, ctx
        self.d = d
        width = MAX_MODEL_LEN // PAGE
        per_seq = ctx // PAGE
        self.kv_bytes = 2 * batch * ctx * kv_heads * d * 2
        # Enough layers that one replay's KV is far past the 60 MB L2.
        self.layers = max(2, min(32, math.ceil(512e6 / self.kv_bytes)))
        g = torch.Generator(device="cuda").manual_seed(batch * ctx)
        blocks = batch * per_seq
        self.caches = [
            (
                torch.randn(blocks + 1, PAGE, kv_heads, d, dtype=DTYPE, device="cuda", generator=g),
                torch.randn(blocks + 1, PAGE, kv_heads, d, dtype=DTYPE, device="cuda", generator=g),
            )
            for _ in range(self.layers)
        ]
        tables = torch.zeros(batch, width, dtype=torch.int32)
        tables[:, :per_seq] = torch.randperm(blocks).view(batch, per_seq)
        self.tables = tables.cuda()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, heads, d, dtype=DTYPE, device="cuda", generator=g)
        kc, vc = self.caches[0]
        self.ref = ref_attention.decode_attention(self.q, kc, vc, self.tables, self.seq_lens, d**-0.5)

    def time(self, decode, rep: int = 150, **kwargs) -> tuple[float, float]:
        """(ms per call, relative error against the reference)."""
        scale = self.d**-0.5

        def step():
            for kc, vc in self.caches:
                decode(self.q, kc, vc, self.tables, self.seq_lens, scale, **kwargs)

        kc, vc = self.caches[0]
        err = rel(decode(self.q, kc, vc, self.tables, self.seq_lens, scale, **kwargs), self.ref)
        return graph_time_ms(step, self.layers, rep), err


def sweep_plans(case: DecodeCase) -> list[triton_attention.DecodePlan]:
    """Split counts that give the GPU between half a wave and 32 programs per
    multiprocessor, each with 32- and 64-token tiles. At batch 1, where the step is a
    chain of latencies rather than a stream of bytes, also fewer programs than a wave
    (no merge at one split), longer tiles, and other warp and pipeline depths."""
    kv_heads = SHAPES[case.name][1]
    plans = []
    fewest = 8 if case.batch == 1 else 66
    for splits in (1, 2, 4, 8, 16, 32, 64):
        programs = case.batch * kv_heads * splits
        if not fewest <= programs <= 4224 or splits * 32 > case.ctx:
            continue
        for tile in (32, 64, 128) if case.batch == 1 else (32, 64):
            if splits * tile > case.ctx:
                continue
            shapes = ((4, 3), (4, 2), (4, 4), (8, 3), (2, 3)) if case.batch == 1 else ((4, 3),)
            plans.extend(triton_attention.DecodePlan(splits, tile, w, st) for w, st in shapes)
    return plans


def prefill_plans(tokens: int) -> list[triton_attention.PrefillPlan]:
    plan = triton_attention.prefill_plan(tokens)
    if tokens <= 32:
        others = [(plan.block_m, 32, 4, 2), (plan.block_m, 64, 2, 1)]
    else:
        others = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
    return [plan] + [triton_attention.PrefillPlan(*o) for o in others]


def prefill_case(shape: str, tokens: int):
    heads, kv_heads, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    step = StepInputs.prefill([[1] * tokens], [[0]], 1 << 20, "cuda")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=DTYPE, device="cuda", generator=g)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.reshape(tokens, heads, d), k.reshape(tokens, kv_heads, d), v.reshape(tokens, kv_heads, d)
    return step, q, k, v, d


# The launch plans and step lengths `--prefill-sweep` times (block_m, block_n, warps, stages).
SWEEP_PREFILL_PLANS = [(bm, bn, 4, 2) for bm in (16, 32, 64, 128) for bn in (32, 64, 128)] + [
    (16, 64, 2, 2), (16, 32, 2, 2), (32, 64, 2, 2), (16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 8, 2), (64, 64, 4, 3),
    (128, 64, 8, 3), (16, 128, 4, 3), (32, 128, 4, 3), (16, 64, 4, 1), (32, 64, 4, 1)]
SWEEP_PREFILL_TOKENS = (48, 64, 128, 256, 512, 1024)


def graph_calls_us(q, k, v, step, d, plan, calls: int = 32) -> float:
    """Microseconds per call of a CUDA graph of `calls` prefill attention calls with `plan`."""
    def run():
        for _ in range(calls):
            triton_attention.prefill_attention(q, k, v, step, d**-0.5, plan=plan)

    return graph_time_ms(run, calls, rep=100) * 1e3


def prefill_plan_sweep(out: Path | None) -> None:
    """Every plan of SWEEP_PREFILL_PLANS on one sequence of each SWEEP_PREFILL_TOKENS length:
    time per call in a CUDA graph of 32 calls (q, k and v stay in L2, as they do in the
    step, where the qkv projection has just written them), against the plan the code picks."""
    rows = []
    for shape in SHAPES:
        for tokens in SWEEP_PREFILL_TOKENS:
            step, q, k, v, d = prefill_case(shape, tokens)
            ref = ref_attention.prefill_attention(q, k, v, step, d**-0.5)
            current = triton_attention.prefill_plan(tokens)
            times = {}
            for spec in SWEEP_PREFILL_PLANS:
                plan = triton_attention.PrefillPlan(*spec)
                err = rel(triton_attention.prefill_attention(q, k, v, step, d**-0.5, plan=plan), ref)
                times[":".join(map(str, spec))] = (graph_calls_us(q, k, v, step, d, plan), err)
            now_us = graph_calls_us(q, k, v, step, d, current)
            top = sorted(times.items(), key=lambda kv: kv[1][0])[:5]
            print(f"{shape} {tokens}: the code's plan {current.block_m}:{current.block_n}:{current.num_warps}:"
                  f"{current.num_stages} {now_us:.2f} us; best " + ", ".join(
                      f"{name} {us:.2f} (err {err:.1e})" for name, (us, err) in top), flush=True)
            rows.append({"shape": shape, "tokens": tokens, "plan": current.__dict__, "plan_us": now_us,
                         "times_us_err": times})
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "prefill_plan_sweep.json").write_text(json.dumps(rows, indent=1))


def batch_sizes(text: str) -> tuple[int, ...]:
    """Comma-separated positive batch sizes, e.g. "1,8,32"."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,8,32, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=old_attention_option,
                        help="a module file with an older decode_attention to time beside")
    parser.add_argument("--sweep", action="store_true", help="also time other decode launch plans")
    parser.add_argument("--out", type=Path, help="folder for attention_bench.json")
    parser.add_argument("--batches", type=batch_sizes, default=(1, 8, 32), help="decode batch sizes, e.g. 1,8,32")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only time prefill launch plans at 48-1024 tokens, in CUDA graphs")
    args = parser.parse_args()
    if args.prefill_sweep:
        prefill_plan_sweep(args.out)
        return

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"copy_bandwidth_tbs": bw / 1e12, "decode": [], "prefill": []}
    lines = ["| prefill | tokens | Triton varlen | TFLOP/s | SDPA + mask | TFLOP/s | rel err | best plan | best |", "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for shape in SHAPES if not args.skip_prefill else ():
        for tokens in (16, 128, 512, 2048):
            step, q, k, v, d = prefill_case(shape, tokens)
            heads = q.shape[1]
            flops = 4 * heads * d * tokens * (tokens + 1) / 2  # QK^T and PV over the causal half
            timed = []
            for plan in prefill_plans(tokens) if args.sweep else [None]:
                run = lambda: triton_attention.prefill_attention(q, k, v, step, d**-0.5, plan=plan)  # noqa: E731
                run()
                timed.append((triton.testing.do_bench(run, warmup=20, rep=60, return_mode="median"), plan))
            new = timed[0][0]
            best_ms, best_plan = min(timed, key=lambda x: x[0])
            mask_sdpa = lambda: ref_attention.prefill_attention(q, k, v, step, d**-0.5)  # noqa: E731
            mask_sdpa()
            sdpa = triton.testing.do_bench(mask_sdpa, warmup=20, rep=60, return_mode="median")
            err = rel(triton_attention.prefill_attention(q, k, v, step, d**-0.5), ref_attention.prefill_attention(q, k, v, step, d**-0.5))
            if not err < 2e-2:
                print(f"!! prefill {shape} {tokens}: relative error {err:.2e} against the reference", flush=True)
            results["prefill"].append({
                "shape": shape, "tokens": tokens, "triton_ms": new, "sdpa_mask_ms": sdpa, "err": err,
                "best_ms": best_ms, "best_plan": best_plan and best_plan.__dict__,
            })
            best_s = "-" if best_plan is None else "m{block_m} n{block_n} w{num_warps} st{num_stages}".format(**best_plan.__dict__)
            lines.append(
                f"| {shape} | {tokens} | {new * 1e3:.1f} us | {flops / new / 1e9:.0f} | {sdpa * 1e3:.1f} us | "
                f"{flops / sdpa / 1e9:.0f} | {err:.1e} | {best_s} | {best_ms * 1e3:.1f} us |"
            )
            print(lines[-1], flush=True)
    lines += ["", "| decode | batch | ctx | KV MB | new ms | new % bw | old ms | old % bw | best plan | best ms | best % |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for shape in SHAPES:
        for batch in args.batches:
            for ctx in (512, 4096):
                case = DecodeCase(shape, batch, ctx)
                floor_ms = case.kv_bytes / bw * 1e3
                row = {"shape": shape, "batch": batch, "ctx": ctx, "kv_bytes": case.kv_bytes, "floor_ms": floor_ms}
                row["new_ms"], row["new_err"] = case.time(triton_attention.decode_attention)
                if args.old is not None:
                    row["old_ms"], row["old_err"] = case.time(args.old)
                if args.sweep:
                    timed = []
                    for plan in sweep_plans(case):
                        try:
                            ms, err = case.time(triton_attention.decode_attention, rep=50, plan=plan)
                        except Exception as e:  # a plan past the shared memory or register limits
                            print(f"!! decode {shape} b{batch} ctx{ctx} {plan}: {type(e).__name__}", flush=True)
                            continue
                        if err < 1e-2:
                            timed.append((ms, plan, err))
                        else:
                            print(f"!! decode {shape} b{batch} ctx{ctx} {plan}: relative error {err:.2e}", flush=True)
                    if timed:
                        ms, plan, _ = min(timed, key=lambda x: x[0])
                        row["best_ms"], row["best_plan"] = ms, plan.__dict__
                    row["sweep"] = [(m, p.__dict__) for m, p, _ in timed]
                for key in ("new_err", "old_err"):
                    if not row.get(key, 0) < 1e-2:
                        print(f"!! decode {shape} b{batch} ctx{ctx} {key} {row[key]:.2e}", flush=True)
                results["decode"].append(row)
                pct = lambda ms: f"{100 * floor_ms / ms:.0f}" if ms else "-"  # noqa: E731
                best = row.get("best_plan")
                best_s = "s{splits} t{tile} w{num_warps} st{num_stages}".format(**best) if best else "-"
                lines.append(
                    f"| {shape} | {batch} | {ctx} | {case.kv_bytes / 1e6:.1f} | {row['new_ms'] * 1e3:.1f} us | "
                    f"{pct(row['new_ms'])} | {row.get('old_ms', 0) * 1e3:.1f} us | {pct(row.get('old_ms'))} | {best_s} | "
                    f"{row.get('best_ms', 0) * 1e3:.1f} us | {pct(row.get('best_ms'))} |"
                )
                print(lines[-1], flush=True)
                del case
                torch.cuda.empty_cache()
                write(args.out, results)

    print("\n" + "\n".join(lines))
    write(args.out, results)


def write(out: Path | None, results: dict) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
