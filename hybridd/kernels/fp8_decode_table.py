"""The FP8 decode configs the GPU chose: for each projection shape (N, K) and row count
scripts/bench_fp8.py timed, the skinny-GEMM config (`triton_gemm.GemmConfig`) that took
least time in its decode sweep. `triton_gemm.config_for` looks an FP8 product up here
(the nearest measured shape at the next measured row count) and falls back to its rule
where the table is empty.

Generated: python -m scripts.bench_fp8 --table fp8_gemm.json (the bench's JSON); do not edit.
"""

DEVICE = ""  # the GPU the winners were measured on
# (n, k, rows): (kernel, block_n, block_k, split_k, num_warps, num_stages)
WINNERS: dict[tuple[int, int, int], tuple[str, int, int, int, int, int]] = {}
