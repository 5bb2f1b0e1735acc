"""The FP8 decode configs the GPU chose: for each projection shape (N, K) and row count
scripts/bench_fp8.py timed, the skinny-GEMM config (`triton_gemm.GemmConfig`) that took
least time in its decode sweep. `triton_gemm.config_for` looks an FP8 product up here
(the nearest measured shape at the next measured row count) and falls back to its rule
where the table is empty.

Generated: python -m scripts.bench_fp8 --table fp8_gemm.json (the bench's JSON); do not edit.
"""

DEVICE = "NVIDIA H100 80GB HBM3"  # the GPU the winners were measured on
# (n, k, rows): (kernel, block_n, block_k, split_k, num_warps, num_stages)
WINNERS: dict[tuple[int, int, int], tuple[str, int, int, int, int, int]] = {
    (4096, 4096, 1): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 4096, 4): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 4096, 8): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 4096, 16): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 4096, 32): ("dot_f16", 64, 256, 2, 4, 4),
    (4096, 11008, 1): ("fma", 16, 256, 4, 4, 1),
    (4096, 11008, 4): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 11008, 8): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 11008, 16): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 11008, 32): ("dot_f16", 64, 256, 2, 4, 4),
    (4096, 14336, 1): ("fma", 16, 256, 4, 4, 1),
    (4096, 14336, 4): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 14336, 8): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 14336, 16): ("dot_f16", 32, 256, 1, 4, 7),
    (4096, 14336, 32): ("dot_f16", 64, 256, 2, 4, 4),
    (6144, 4096, 1): ("fma", 16, 256, 2, 4, 1),
    (6144, 4096, 4): ("dot_f16", 32, 256, 1, 4, 6),
    (6144, 4096, 8): ("dot_f16", 32, 256, 1, 4, 6),
    (6144, 4096, 16): ("dot_f16", 32, 256, 1, 4, 6),
    (6144, 4096, 32): ("dot_f16", 64, 256, 1, 4, 5),
    (12288, 4096, 1): ("dot_f16_t", 128, 256, 1, 4, 4),
    (12288, 4096, 4): ("dot_f16_t", 128, 256, 1, 4, 4),
    (12288, 4096, 8): ("dot_f16_t", 64, 256, 1, 4, 4),
    (12288, 4096, 16): ("dot_f16_t", 128, 256, 1, 4, 4),
    (12288, 4096, 32): ("dot_f16", 64, 128, 1, 4, 4),
    (22016, 4096, 1): ("dot_f16_t", 64, 128, 1, 4, 4),
    (22016, 4096, 4): ("dot_f16_t", 64, 128, 1, 4, 4),
    (22016, 4096, 8): ("dot_f16_t", 64, 128, 1, 4, 4),
    (22016, 4096, 16): ("dot_f16_t", 64, 128, 1, 4, 4),
    (22016, 4096, 32): ("dot_f16_t", 64, 256, 1, 4, 3),
    (28672, 4096, 1): ("fma", 16, 256, 1, 4, 1),
    (28672, 4096, 4): ("dot_f16", 32, 256, 1, 4, 4),
    (28672, 4096, 8): ("dot_f16", 32, 256, 1, 4, 4),
    (28672, 4096, 16): ("dot_f16", 32, 256, 1, 4, 4),
    (28672, 4096, 32): ("dot_f16", 64, 128, 1, 4, 4),
}
