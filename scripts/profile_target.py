"""A target for a kernel profiler (Nsight Compute): calls one kernel of the batch-1
decode step eagerly, a few rounds, nothing else on the GPU.

    ncu -k regex:_decode_kernel --launch-skip 40 --launch-count 1 --set full python scripts/profile_target.py attention
    ncu -k regex:_skinny_gemm --launch-skip 10 --launch-count 1 --set full python scripts/profile_target.py o_proj

`attention`: the decode attention at batch 1, context 512, Llama-2-7B shape (32 heads of
128, bf16, block size 16) over 32 layers' caches, as scripts/bench_attention.py builds
them. `o_proj`: the o projection of that shape at one row, through the table's kernel,
over 8 copies of its weight (so none is read from L2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import DecodeCase  # noqa: E402
from hybridd.kernels import triton_attention, triton_gemm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=("attention", "o_proj"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.kernel == "attention":
        case = DecodeCase("llama2-7b", 1, 512)
        for _ in range(args.rounds):
            for kc, vc in case.caches:
                triton_attention.decode_attention(case.q, kc, vc, case.tables, case.seq_lens, case.d**-0.5)
    else:
        x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
        weights = [torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
        for _ in range(args.rounds):
            for w in weights:
                triton_gemm.linear(x, w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
