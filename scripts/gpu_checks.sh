#!/usr/bin/env bash
# The GPU half of the test suite and the step measurements, in one command on the GPU
# machine (results under $OUT, or ./out):
#     bash scripts/gpu_checks.sh
#     bash scripts/gpu_checks.sh fp8    # the FP8 checks alone, under 9 minutes (see the end)
# 1. the tests marked `gpu` except the 7B model-accuracy ones (tests/test_gpu_model.py:
#    run it alone, it writes two 13 GB checkpoints) and the gateway's (they need the
#    `openai` client and no GPU: CI runs them);
#    tests/test_gpu_kernels.py whole (its unmarked tests run on the CPU too: here in bf16);
# 2. the two-process end-to-end tests over CUDA IPC (HYBRIDD_TEST_DEVICE=cuda);
# 3. the bench's device and breakdown parts (`hybridd bench`, here `python3 -m hybridd.bench`):
#    where the decode and prefill steps go against their floors.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source scripts/device_env.sh
status=0
if [ "${1:-}" = fp8 ]; then
    # FP8 weights on the GPU kernels, on the shape $HYBRIDD_FP8_PRESET (llama2-7b or llama3-8b):
    # 1. the FP8 GPU tests: the kernels on the Llama-2-7B and Llama-3-8B projection shapes and
    #    both prefill candidates against the emulated numerics, a Llama-1B-shaped FP8 model
    #    against the emulated reference and through captured graphs, the FP8 KV cache's write
    #    and attention kernels against the torch reference over the same FP8 cache (fp8_tests.log);
    # 2. the FP8 GEMMs alone (hybridd/bench/fp8.py): decode GB/s on the FP8 bytes against the
    #    copy bandwidth (each decode form's first config; the full sweep the FP8 config
    #    rule is checked against: see the script), both prefill candidates' TFLOP/s and which wins
    #    (fp8_gemm.json, fp8_gemm.log);
    # 3. the bench's FP8 parts: the FP8 model's decode steps at batch 1 and 32 against their
    #    floors, and bf16 against FP8 daemons on the same weights (TTFT 128-2000 tokens, ITL
    #    at batch 1, 32 streams, start after the weights), and FP8 weights with an FP8 KV cache
    #    against FP8 weights alone (ITL at batch 1, 32 streams) (fp8-PRESET/bench.json, bench_table.txt).
    preset=${HYBRIDD_FP8_PRESET:-llama2-7b}
    timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/test_fp8_kernels.py \
        tests/test_gpu_fp8_model.py tests/test_kv_cache_fp8.py 2>&1 | tee "$OUT/fp8_tests.log" || status=1
    timeout 110 python3 -m hybridd.bench.fp8 --out "$OUT/fp8_gemm.json" --quick --budget-s 45 2>&1 \
        | tee "$OUT/fp8_gemm.log" || status=1
    timeout 300 python3 -m hybridd.bench --out "$OUT/fp8-$preset" --preset "$preset" \
        --parts ceilings,checkpoint,breakdown_fp8,fp8 --budget-s 290 2>&1 | tee "$OUT/fp8_bench.log" || status=1
    exit $status
fi
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore tests/test_gpu_model.py \
    --ignore tests/test_gateway_openai.py \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -m "not gpu" \
    2>&1 | tee "$OUT/gpu_kernels.log" || status=1
HYBRIDD_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_decoupled.py \
    2>&1 | tee "$OUT/gpu_e2e.log" || status=1
timeout 300 python3 -m hybridd.bench --out "$OUT/bench" --parts ceilings,checkpoint,breakdown \
    --budget-s 280 2>&1 | tee "$OUT/bench.log" || status=1
# 4. chunked prefill and the prefix cache on the 7B and 8B shapes (hybridd/bench/mixed.py):
#    a stream's ITL while another client sends 2,000-token prompts, and cached-prefix TTFTs.
for preset in llama2-7b llama3-8b; do
    timeout 280 python3 -m hybridd.bench --out "$OUT/mixed-$preset" --preset "$preset" \
        --parts checkpoint,mixed_load,prefix_reuse --budget-s 260 2>&1 | tee "$OUT/mixed-$preset.log" || status=1
done
exit $status
