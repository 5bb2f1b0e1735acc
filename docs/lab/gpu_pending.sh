#!/usr/bin/env bash
# The GPU checks and measurements this code still waits for, in five device calls of at
# most ~9 minutes each on an H100 (one part a call). The device returns at most 8 files a
# call: everything is bundled in $OUT/o.tgz, rewritten after each step so that a cut call
# keeps what ran. Carry .whl, made here with
#     bash ../shared/device/wheels.sh msgspec click setproctitle prometheus_client starlette anyio sniffio \
#         uvicorn==0.35.0 h11 httptools uvloop llguidance==1.9.1 --platform manylinux_2_31_x86_64
# (llguidance 1.9's wheels are manylinux_2_31, a tag wheels.sh does not list: without it pip takes 1.6.1)
# and for `house` also .bisect/trees/da36c39, made here with
#     mkdir -p .bisect/trees/da36c39 && git archive da36c39 | tar -x -C .bisect/trees/da36c39 \
#         && rm -rf .bisect/trees/da36c39/{docs,tests,hybridd/assets}   # 1.6 MB; run.sh links the assets
#     bash docs/lab/gpu_pending.sh tests   # correctness first: what failed on the H100 at 296beb6
#                                          # (prompt logprobs on CUDA, the FP8 KV cache's kernels and
#                                          # graphs, the EAGLE-3 daemon tests), the prefill attention
#                                          # and FP8 kernels, then the GPU tests again
#     bash docs/lab/gpu_pending.sh fp8     # bf16, FP8 and FP8 + FP8 KV daemons on the Llama-2-7B
#                                          # shape, and where the FP8 decode step spends its time
#     bash docs/lab/gpu_pending.sh spec    # speculation's goal on the Llama-3-8B shape: the head's
#                                          # cost in process, prompt lookup at the client, 32 streams
#     bash docs/lab/gpu_pending.sh house   # the code before the house change (da36c39) against this
#                                          # tree: TTFT 10-500 tokens, batch-1 ITL, 32 streams, twice
#                                          # each, alternating (carry .bisect/trees/da36c39 too)
#     bash docs/lab/gpu_pending.sh steps   # where the 256-row mixed step spends its time
#                                          # (docs/lab/benchmarks.md, last entries)
source scripts/device_env.sh > /dev/null 2>&1
mkdir -p /tmp/o; save() { echo "$1 rc=$2 at $(( $(date +%s) - t0 )) s" >> /tmp/o/progress; tar czf $OUT/o.tgz -C /tmp o; }
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv > /tmp/o/gpu; git log --oneline -1 >> /tmp/o/gpu
case "${1:-tests}" in
tests)
    HYBRIDD_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_runtime_chat_logprobs_n.py \
        -k prompt_logprobs > /tmp/o/prompt_logprobs.log 2>&1; save prompt_logprobs $?
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kv_cache_fp8.py > /tmp/o/kv_fp8.log 2>&1
    save kv_fp8 $?
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_graph_runner.py -k fp8 \
        > /tmp/o/kv_fp8_graphs.log 2>&1; save kv_fp8_graphs $?
    HYBRIDD_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_eagle3.py \
        > /tmp/o/rt.log 2>&1; save rt $?
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k prefill_attention \
        tests/test_fp8_kernels.py > /tmp/o/attn_fp8.log 2>&1; save attn_fp8 $?
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_eagle3.py tests/test_gpu_speculative.py \
        tests/test_fp8_decode_kernels.py tests/test_skinny_gemm.py > /tmp/o/gpu.log 2>&1; save gpu $? ;;
fp8)
    timeout 500 python3 -m hybridd.bench --out /tmp/o/f7 --preset llama2-7b --parts ceilings,checkpoint,breakdown_fp8,fp8 \
        --budget-s 480 > /tmp/o/f7.log 2>&1; save f7 $? ;;
spec)
    timeout 560 python3 -m hybridd.bench --out /tmp/o/s8 --preset llama3-8b \
        --parts checkpoint,speculation_steps,speculation_client --budget-s 540 > /tmp/o/s8.log 2>&1; save s8 $? ;;
house)
    REPS=15 timeout 540 bash docs/lab/bisect/run.sh da36c39 head da36c39 head > /tmp/o/house.log 2>&1; rc=$?
    cp $OUT/bisect.jsonl /tmp/o/ 2>/dev/null; save house $rc ;;
steps)
    [ -d /tmp/hybridd-llama2-7b-normal-random ] || timeout 200 python3 -m hybridd.bench --out /tmp/o/ck \
        --preset llama2-7b --parts checkpoint --budget-s 190 > /tmp/o/ck.log 2>&1
    timeout 250 python3 docs/lab/mixed_step/step_ab.py /tmp/hybridd-llama2-7b-normal-random /tmp/o/step_ab.json \
        > /tmp/o/step_ab.log 2>&1; save step_ab $?
    timeout 90 python3 docs/lab/mixed_step/gemm_tiles.py /tmp/o/gemm_tiles.json > /tmp/o/gemm_tiles.log 2>&1
    save gemm_tiles $? ;;
esac
cat /tmp/o/progress
