#!/usr/bin/env bash
# The GPU half of the test suite and the step measurements, in one command on the GPU
# machine (results under $OUT, or ./out):
#     bash scripts/gpu_checks.sh
# 1. the tests marked `gpu` except the 7B model-accuracy ones (tests/test_gpu_model.py:
#    run it alone, it writes two 13 GB checkpoints) and the gateway's (they need the
#    `openai` client and no GPU: CI runs them);
#    tests/test_gpu_kernels.py whole (its unmarked tests run on the CPU too: here in bf16);
# 2. the two-process end-to-end tests over CUDA IPC (HYBRIDD_TEST_DEVICE=cuda);
# 3. the bench's device and breakdown parts (`python -m scripts.bench`): where the decode
#    and prefill steps go against their floors.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source scripts/device_env.sh
status=0
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore tests/test_gpu_model.py \
    --ignore tests/test_gateway_openai.py \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -m "not gpu" \
    2>&1 | tee "$OUT/gpu_kernels.log" || status=1
HYBRIDD_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_decoupled.py \
    2>&1 | tee "$OUT/gpu_e2e.log" || status=1
timeout 300 python3 -m scripts.bench --out "$OUT/bench" --parts ceilings,checkpoint,breakdown \
    --budget-s 280 2>&1 | tee "$OUT/bench.log" || status=1
# 4. chunked prefill and the prefix cache on the 7B and 8B shapes (scripts/bench_mixed.py):
#    a stream's ITL while another client sends 2,000-token prompts, and cached-prefix TTFTs.
for preset in llama2-7b llama3-8b; do
    timeout 280 python3 -m scripts.bench --out "$OUT/mixed-$preset" --preset "$preset" \
        --parts checkpoint,mixed_load,prefix_reuse --budget-s 260 2>&1 | tee "$OUT/mixed-$preset.log" || status=1
done
exit $status
