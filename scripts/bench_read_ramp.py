"""What a kernel costs beside its read: the time to read S bytes in one kernel, by S.

    python scripts/bench_read_ramp.py --out $OUT

A Triton kernel that only reads a buffer of S bytes (each program sums its contiguous
share; one float a program is written) is timed per call in a CUDA graph of calls back to
back over copies that together overflow L2, as `bench_gemm.py` times its projections:
with programmatic dependent launch (each call waits for the one before, as a step's
kernels do) and without. Each size takes the fastest of a few launch shapes. The line
time = fixed + S / rate fitted over the sizes gives what every kernel costs beyond its
bytes and the rate a long read reaches: an estimate of how far a step of many kernels,
each reading its weight once, stays from the weight-read floor however fast each kernel is.
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_graphs import copy_bandwidth, time_calls_in_graph  # noqa: E402
from hybridd.kernels import pdl  # noqa: E402
from hybridd.kernels.pdl import wait_for_predecessor  # noqa: E402

MIB = 1 << 20
# Llama-2-7B's o (32 MiB), down (86 MiB), qkv (96 MiB) and gate/up (172 MiB) weights among them.
SIZES_MIB = (4, 8, 16, 32, 64, 86, 96, 172, 344, 1024)
ROTATE_BYTES = 400 * MIB  # several times the H200's 50 MB L2
# (programs per multiprocessor, elements a program reads per step, warps)
SHAPES = ((2, 8192, 8), (4, 4096, 4), (8, 4096, 4), (8, 2048, 4), (16, 2048, 4))


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, per_program, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_call(x: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int, with_pdl: bool):
    """A launch of the read kernel over x, `programs` programs of `block` elements a step."""
    n = x.numel()
    per_program = triton.cdiv(triton.cdiv(n, programs), block) * block
    launch = pdl.launch_args(x.device) if with_pdl else {"PDL": False}

    def call():
        _read_kernel[(programs,)](x, out, n, per_program, BLOCK=block, num_warps=warps, num_stages=3, **launch)

    return call


def time_per_read(buffers: list[torch.Tensor], out: torch.Tensor, programs: int, block: int, warps: int,
                  with_pdl: bool) -> float:
    """Median seconds per call, from CUDA-graph replays of calls over the rotated buffers."""
    return time_calls_in_graph([read_call(x, out, programs, block, warps, with_pdl) for x in buffers])


def fit_line(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(fixed seconds, bytes per second) of the least-squares line seconds = fixed + size / rate."""
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(seconds) / n
    slope = (sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, seconds))
             / sum((s - mean_s) ** 2 for s in sizes))
    return mean_t - slope * mean_s, 1.0 / slope


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--sizes-mib", default=",".join(map(str, SIZES_MIB)),
                        help="comma list of read sizes in MiB (default %(default)s)")
    args = parser.parse_args()
    try:
        sizes = [int(v) for v in args.sizes_mib.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--sizes-mib: a comma list of sizes of at least 1 MiB, got {args.sizes_mib!r}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_Bps": bw,
               "multiprocessors": sms, "pdl": pdl.supported(torch.device("cuda")), "reads": []}
    print(f"device {results['device']}  copy bandwidth {bw / 1e12:.3f} TB/s  {sms} multiprocessors", flush=True)
    out = torch.empty(16 * sms, dtype=torch.float32, device="cuda")
    for size in sizes:
        nbytes = size * MIB
        copies = max(2, -(-ROTATE_BYTES // nbytes))
        buffers = [torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        row = {"mib": size}
        for per_sm, block, warps in SHAPES:  # every launch shape reads every byte once
            out.zero_()
            read_call(buffers[0], out, per_sm * sms, block, warps, False)()
            want = buffers[0].float().sum().item()
            got = out.sum().item()
            if abs(got - want) > 1e-3 * buffers[0].float().abs().sum().item():
                raise SystemExit(f"the read kernel summed {got} for {want} ({size} MiB, shape {per_sm}x{block}x{warps})")
        for with_pdl in (True, False):
            best = min((time_per_read(buffers, out, per_sm * sms, block, warps, with_pdl), f"{per_sm}x{block}x{warps}")
                       for per_sm, block, warps in SHAPES)
            key = "pdl" if with_pdl else "no_pdl"
            row[key] = {"s": best[0], "shape": best[1], "of_copy_bw": nbytes / best[0] / bw}
        results["reads"].append(row)
        print(f"{size:5d} MiB  with PDL {row['pdl']['s'] * 1e6:8.2f} us ({row['pdl']['of_copy_bw']:6.1%} of copy bw, "
              f"{row['pdl']['shape']})   without {row['no_pdl']['s'] * 1e6:8.2f} us ({row['no_pdl']['of_copy_bw']:6.1%}, "
              f"{row['no_pdl']['shape']})", flush=True)
        del buffers
        torch.cuda.empty_cache()
    for key in ("pdl", "no_pdl"):
        fixed, rate = fit_line([r["mib"] * MIB for r in results["reads"]], [r[key]["s"] for r in results["reads"]])
        results[f"fit_{key}"] = {"fixed_s": fixed, "rate_Bps": rate, "rate_of_copy_bw": rate / bw}
        print(f"fit {key:6s}: each kernel {fixed * 1e6:.2f} us beside its read; long reads at {rate / 1e12:.3f} TB/s "
              f"({rate / bw:.1%} of the copy bandwidth)", flush=True)
    (args.out / "bench_read_ramp.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
