"""Prefill projections on PyTorch's two CUDA BLAS back ends, side by side.

`F.linear` under `torch.backends.cuda.preferred_blas_library` "cublas" (the default)
and "cublaslt", for every projection shape of Llama-2-7B and Llama-3-8B at prefill row
counts (the rows the skinny kernel does not take).

Each time is one call's share of a CUDA graph of calls rotating over copies of the
weight (about 250 MB of them, so that no call reads its weight from L2), the median
over ten replays; the share of the copy bandwidth counts the weight, the input and the
output.

    python scripts/bench_blas.py --out bench_blas.json [--rows 64,128,256,512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_graphs import copy_bandwidth  # noqa: E402
from bench_sampler import sizes  # noqa: E402

BACKENDS = ("cublas", "cublaslt")
SHAPES = {  # (N, K) of each projection
    "llama2-7b qkv": (12288, 4096), "llama2-7b o": (4096, 4096), "llama2-7b gate_up": (22016, 4096),
    "llama2-7b down": (4096, 11008), "llama3-8b qkv": (6144, 4096), "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
}


def time_calls(call, copies: int) -> float:
    """Seconds per `call(i)` for i over `copies`, from a CUDA graph of two rounds of
    them (the median over ten replays); the calls are warmed up before the capture, where
    cuBLAS picks and loads its kernels."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            call(i)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(2):
                for i in range(copies):
                    call(i)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (2 * copies))
    return statistics.median(times)


def bandwidth_share(m: int, n: int, k: int, seconds: float, bandwidth: float) -> float:
    """The share of the copy bandwidth a bf16 [m, k] by [n, k] product in `seconds`
    reached, counting the weight, the input and the output."""
    return (n * k + m * k + m * n) * 2 / seconds / bandwidth


def start_sweep(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, float, dict]:
    """A sweep's start: its arguments (a parser error without a CUDA GPU), TF32 off, the
    copy bandwidth measured and printed, and its results so far."""
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s  {torch.cuda.get_device_name()}")
    return args, bandwidth, {"copy_bandwidth_Bps": bandwidth, "device": torch.cuda.get_device_name(), "rows": {}}


def time_linear(m: int, n: int, k: int, backend: str) -> float:
    """Seconds per `F.linear` call of [m, k] by [n, k] in bf16 on `backend`, from L2-cold weights."""
    torch.backends.cuda.preferred_blas_library(backend)
    copies = max(2, int(2.5e8 // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    return time_calls(lambda i: F.linear(x, weights[i]), copies)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_blas.json"))
    parser.add_argument("--rows", type=sizes, default=[64, 128, 256, 512])
    args, bandwidth, results = start_sweep(parser)
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for m in args.rows:
            for name, (n, k) in SHAPES.items():
                row = results["rows"].setdefault(str(m), {}).setdefault(name, {})
                line = f"M={m:4d} {name:18s}"
                for backend in BACKENDS:
                    seconds = time_linear(m, n, k, backend)
                    share = bandwidth_share(m, n, k, seconds, bandwidth)
                    row[backend] = {"seconds": seconds, "bandwidth_share": share}
                    line += f"  {backend} {seconds * 1e6:7.1f} us ({share * 100:3.0f}%)"
                print(line, flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
