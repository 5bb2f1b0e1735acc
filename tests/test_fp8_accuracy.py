"""The embedded model quantized to FP8 at load keeps its accuracy on held-out Shakespeare:
over the validation windows training.json records (the last part of every document, never
trained on; scripts/train_tiny.py), its perplexity is within 2 % of the unquantized
model's and its teacher-forced next token is the unquantized model's at >= 97 % of the
positions (float32 activations, on the CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hybridd.config import EMBEDDED_MODEL
from hybridd.model import KVCache, StepInputs, load_model, load_tokenizer
from tests.test_tiny_model_shipped import validation_token_ids

pytestmark = pytest.mark.slow

MAX_PERPLEXITY_RATIO = 1.02
MIN_TOP1_AGREEMENT = 0.97


def _with_weights_of(reference, model):
    """transformers' model `reference` with the projections of hybridd's `model`,
    dequantized, in place of its own (q, k, v and gate, up split from the fused rows)."""
    from hybridd.kernels.fp8 import dequantize

    config = model.config
    with torch.no_grad():
        for ours, theirs in zip(model.layers, reference.model.layers, strict=True):
            q, k, v = dequantize(ours.qkv_proj.operand).split([config.q_size, config.kv_size, config.kv_size])
            gate, up = dequantize(ours.gate_up_proj.operand).chunk(2)
            attention, mlp = theirs.self_attn, theirs.mlp
            for param, value in ((attention.q_proj, q), (attention.k_proj, k), (attention.v_proj, v),
                                 (attention.o_proj, dequantize(ours.o_proj.operand)), (mlp.gate_proj, gate),
                                 (mlp.up_proj, up), (mlp.down_proj, dequantize(ours.down_proj.operand))):
                param.weight.copy_(value)
    return reference


@torch.inference_mode()
def test_fp8_perplexity_and_top1_agreement_on_held_out_text():
    """The windows run through transformers' model (fast on the CPU), once as trained and
    once with the weights hybridd's FP8 load made; that hybridd's FP8 forward computes
    the same logits as the latter is checked first, on one window."""
    from transformers import AutoModelForCausalLM

    record = json.loads((EMBEDDED_MODEL / "training.json").read_text())
    ids = validation_token_ids(load_tokenizer(EMBEDDED_MODEL), record, EMBEDDED_MODEL)
    w = record["validation_windows"]
    seq_len, starts = w["seq_len"], [w["first_start"] + i * w["stride"] for i in range(w["count"])]
    ours = load_model(EMBEDDED_MODEL, dtype=torch.float32, quantization="fp8")
    assert ours.quantization is not None and ours.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
    models = {"none": AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval(),
              "fp8": _with_weights_of(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32), ours)}

    window = ids[starts[3]: starts[3] + seq_len]
    kv = KVCache.allocate(ours.config, seq_len // 16, 16, torch.float32, "cpu")
    got = ours.compute_logits(ours(StepInputs.prefill([window], [list(range(seq_len // 16))], 16), kv))
    expected = models["fp8"].eval()(torch.tensor([window])).logits[0]
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-4

    loss = {"none": 0.0, "fp8": 0.0}
    agree = n = 0
    for b in range(0, len(starts), 16):
        rows = torch.tensor([ids[s: s + seq_len + 1] for s in starts[b: b + 16]])
        targets = rows[:, 1:].reshape(-1)
        top1 = {}
        for q, model in models.items():
            logits = model(input_ids=rows[:, :-1], use_cache=False).logits.float().reshape(targets.numel(), -1)
            loss[q] += F.cross_entropy(logits, targets, reduction="sum").item()
            top1[q] = logits.argmax(-1)
        agree += int((top1["fp8"] == top1["none"]).sum())
        n += targets.numel()
    assert n == record["validation_tokens"]
    perplexity = {q: math.exp(total / n) for q, total in loss.items()}
    # These are the held-out windows training measured: the unquantized loss is the recorded one.
    assert math.log(perplexity["none"]) == pytest.approx(record["validation_loss"], abs=2e-3)
    assert perplexity["fp8"] != perplexity["none"]  # the weights were rounded
    assert perplexity["fp8"] <= MAX_PERPLEXITY_RATIO * perplexity["none"], perplexity
    assert agree / n >= MIN_TOP1_AGREEMENT, f"top-1 agreement {agree / n:.4f}"
