"""On the GPU: the runtime in bf16 against transformers in bf16 on a trained model (the
embedded Shakespeare model), teacher-forced over held-out text: top-1 agreement >= 99%."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = Path(os.environ.get("HYBRIDD_TINY_MODEL_DIR", ROOT / "hybridd" / "assets" / "tiny-shakespeare"))
RESULTS = Path(os.environ.get("HYBRIDD_GPU_RESULTS", "/tmp/hybridd-gpu-results"))


@torch.inference_mode()
def test_trained_model_bf16_top1_agreement():
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"no trained model at {MODEL_DIR}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridd.model import KVCache, StepInputs, load_model
    from hybridd.kernels.selection import select_kernels

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = (MODEL_DIR / "validation.txt").read_text()
    ids = tok.encode(text)[:8 * 256]
    windows = [ids[i * 256 : (i + 1) * 256] for i in range(8)]
    ref = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).cuda().eval()
    ref_logits = torch.cat([ref(torch.tensor([w], device="cuda")).logits[0].float() for w in windows])
    ours = load_model(MODEL_DIR, dtype=torch.bfloat16, device="cuda")
    results = {}
    for kernels in ("torch", "triton"):
        ours.kernels = select_kernels("cuda", kernels)
        kv = KVCache.allocate(ours.config, 8 * 16 + 1, 16, torch.bfloat16, "cuda")
        tables = [list(range(i * 16, (i + 1) * 16)) for i in range(8)]
        # First half by prefill, second half teacher-forced through decode steps.
        half = 128
        got = [[] for _ in windows]
        pre = ours.compute_logits(ours(StepInputs.prefill([w[:half] for w in windows], tables, 16, "cuda"), kv))
        for i in range(8):
            got[i].append(pre[i * half : (i + 1) * half])
        for pos in range(half, 256):
            step = StepInputs.decode([w[pos] for w in windows], [pos] * 8, tables, 16, "cuda")
            logits = ours.forward_logits(step, kv)
            for i in range(8):
                got[i].append(logits[i : i + 1])
        ours_all = torch.cat([torch.cat(g) for g in got])
        results[kernels] = {
            "top1_agreement": (ours_all.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            "rel_error": ((ours_all - ref_logits).norm() / ref_logits.norm()).item(),
            "positions": ours_all.shape[0],
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tiny_model_bf16_vs_transformers.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    for r in results.values():
        assert r["top1_agreement"] >= 0.99
        assert r["rel_error"] < 2e-2
