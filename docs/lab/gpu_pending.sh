#!/usr/bin/env bash
# The GPU checks and measurements this code still waits for, in one device call (about 9
# minutes on an H100). The device returns at most 8 files a call: everything is bundled in
# $OUT/o.tgz, rewritten after each step so that a cut call keeps what ran. Carry .whl.
#     bash docs/lab/gpu_pending.sh        # on the GPU machine
# 1. the EAGLE-3 head in the graph generator: its captured steps against eager, its drafts
#    over the model's states, the daemon with the head on CUDA (its first CUDA run stopped at
#    the head's load, fixed since);
# 2. prompt logprobs through the daemon on CUDA (timed out twice without output);
# 3. speculation's machinery on the Llama-3-8B shape, with the head's own step cost where the
#    bench measures it;
# 4. chunked prefill and the prefix cache on the Llama-3-8B shape (Llama-2-7B: docs/lab/benchmarks.md).
source scripts/device_env.sh > /dev/null 2>&1
mkdir -p /tmp/o; save() { echo "$1 rc=$2 at $(( $(date +%s) - t0 )) s" >> /tmp/o/progress; tar czf $OUT/o.tgz -C /tmp o; }
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_eagle3.py tests/test_gpu_speculative.py \
    > /tmp/o/gpu_eagle.log 2>&1; save gpu_eagle $?
HYBRIDD_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_runtime_eagle3.py \
    > /tmp/o/rt_eagle.log 2>&1; save rt_eagle $?
HYBRIDD_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_runtime_chat_logprobs_n.py \
    -k prompt_logprobs > /tmp/o/prompt_logprobs.log 2>&1; save prompt_logprobs $?
timeout 120 python3 -m scripts.bench --out /tmp/o/spec --preset llama3-8b --parts checkpoint,speculation_steps \
    --budget-s 115 > /tmp/o/spec.log 2>&1; save spec $?
timeout 120 python3 -m scripts.bench --out /tmp/o/mixed8b --preset llama3-8b --parts checkpoint,mixed_load,prefix_reuse \
    --budget-s 115 > /tmp/o/mixed8b.log 2>&1; save mixed8b $?
cat /tmp/o/progress
