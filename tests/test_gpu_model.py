"""On the GPU: the model runtime in bf16 against transformers on a Llama-2-7B-shaped
random checkpoint (teacher-forced top-1 agreement and logits' relative error).

The checkpoint is made once per machine by hybridd/bench/random_checkpoint.py into
$HYBRIDD_GPU_CHECKPOINT (default /tmp/hybridd-llama2-7b-random).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("HYBRIDD_GPU_RESULTS", "/tmp/hybridd-gpu-results"))


@pytest.fixture(scope="module", params=["normal"])
def checkpoint(request):
    from tests.random_checkpoint import make_checkpoint

    preset = os.environ.get("HYBRIDD_GPU_PRESET", "llama2-7b")
    path = Path(f"/tmp/hybridd-{preset}-{request.param}-random")
    return request.param, make_checkpoint(path, preset, init=request.param)


@torch.inference_mode()
def test_bf16_matches_transformers_teacher_forced(checkpoint):
    init, checkpoint = checkpoint
    from transformers import AutoModelForCausalLM

    from hybridd.model import KVCache, StepInputs, load_model
    from hybridd.kernels.selection import select_kernels

    g = torch.Generator().manual_seed(0)
    # 4 x 64 = 256 prefill rows: a prefill whose projections run on cuBLAS.
    prompt_len, decode_len, n_seqs = 64, 32, 4
    seqs = [torch.randint(3, 32000, (prompt_len + decode_len,), generator=g).tolist() for _ in range(n_seqs)]

    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda").eval()
    ref_logits = [ref(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]
    del ref
    torch.cuda.empty_cache()
    # The float32 model is the yardstick for "within bf16 rounding": transformers' own
    # bf16 run differs from it by about as much as ours does.
    ref32 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device_map="cuda").eval()
    fp32_logits = torch.cat([ref32(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs])
    del ref32
    torch.cuda.empty_cache()
    hf_bf16_vs_fp32 = ((torch.cat(ref_logits) - fp32_logits).norm() / fp32_logits.norm()).item()

    ours = load_model(checkpoint, dtype=torch.bfloat16, device="cuda")
    results = {}
    for kernels in ("torch", "triton"):
        ours.kernels = select_kernels("cuda", kernels)
        block = 16
        kv = KVCache.allocate(ours.config, 64, block, torch.bfloat16, "cuda")
        tables = [list(range(i * 16, i * 16 + 16)) for i in range(n_seqs)]
        prompts = [s[:prompt_len] for s in seqs]
        step = StepInputs.prefill(prompts, tables, block, "cuda")
        got_prefill = ours.compute_logits(ours(step, kv))
        got = [[] for _ in seqs]
        for i in range(n_seqs):
            got[i].append(got_prefill[i * prompt_len : (i + 1) * prompt_len])
        for t in range(decode_len):
            pos = prompt_len + t
            step = StepInputs.decode([s[pos] for s in seqs], [pos] * n_seqs, tables, block, "cuda")
            logits = ours.forward_logits(step, kv)
            for i in range(n_seqs):
                got[i].append(logits[i : i + 1])
        ours_all = torch.cat([torch.cat(x) for x in got])
        ref_all = torch.cat(ref_logits)
        agree = (ours_all.argmax(-1) == ref_all.argmax(-1)).float().mean().item()
        err = ((ours_all - ref_all).norm() / ref_all.norm()).item()
        decode_rows = torch.cat([torch.cat(x[1:]) for x in got])
        ref_decode = torch.cat([r[prompt_len:] for r in ref_logits])
        results[kernels] = {
            "top1_agreement": agree,
            "rel_error": err,
            "decode_top1_agreement": (decode_rows.argmax(-1) == ref_decode.argmax(-1)).float().mean().item(),
            "positions": ours_all.shape[0],
            "rel_error_vs_fp32": ((ours_all - fp32_logits).norm() / fp32_logits.norm()).item(),
            "transformers_bf16_rel_error_vs_fp32": hf_bf16_vs_fp32,
            "top1_agreement_fp32_ref": (ours_all.argmax(-1) == fp32_logits.argmax(-1)).float().mean().item(),
            "transformers_bf16_top1_vs_fp32": (torch.cat(ref_logits).argmax(-1) == fp32_logits.argmax(-1)).float().mean().item(),
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"model_bf16_vs_transformers_{init}.json").write_text(json.dumps(results, indent=2))
    print(init, json.dumps(results, indent=2))
    for r in (results["torch"], results["triton"]):
        # Within bf16 rounding: no further from float32 than transformers' own bf16 run.
        assert r["rel_error_vs_fp32"] <= 1.1 * hf_bf16_vs_fp32 + 1e-3
        # As often right (against float32) as transformers' own bf16 run, within 2%. On random
        # weights the top logits sit close together, and transformers' bf16 run itself agrees
        # with float32 on only ~85% of positions, so agreement with it cannot reach 99%; the
        # 99% check runs on a trained model (test_gpu_tiny_model.py).
        assert r["top1_agreement_fp32_ref"] >= r["transformers_bf16_top1_vs_fp32"] - 0.02
