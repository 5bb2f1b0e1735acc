"""On the GPU: a model quantized to FP8 at load (random weights of the Llama-1B shape,
$HYBRIDD_GPU_RUNNER_PRESET) through the Triton kernels, against the same FP8 weights
through the torch kernels (the emulated numerics), with each prefill candidate; and
through the graph runner, every decode and prefill graph equal to the eager path
bitwise, as for bf16 (tests/test_gpu_graph_runner.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.test_gpu_graph_runner import PREFILL, Seqs, make_runner, run_both

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp8_model():
    from tests.random_checkpoint import make_checkpoint

    from hybridd.model import load_model

    preset = os.environ.get("HYBRIDD_GPU_RUNNER_PRESET", "llama-1b")
    path = make_checkpoint(Path(f"/tmp/hybridd-{preset}-normal-random"), preset)
    model = load_model(path, dtype=torch.bfloat16, device="cuda", max_positions=2048, quantization="fp8")
    assert model.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].qkv_proj.weight.device.type == "cuda"
    return model


def _teacher_forced(model, seqs, prompt_len: int, decode_len: int):
    """Logits of a prefill of each sequence's first `prompt_len` tokens and of
    `decode_len` decode steps feeding the sequences' own next tokens."""
    from hybridd.model import KVCache, StepInputs

    block = 16
    kv = KVCache.allocate(model.config, 16 * len(seqs), block, torch.bfloat16, "cuda")
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(seqs))]
    prefill = model.compute_logits(model(StepInputs.prefill([s[:prompt_len] for s in seqs], tables, block, "cuda"),
                                         kv))
    decode = []
    for t in range(decode_len):
        pos = prompt_len + t
        step = StepInputs.decode([s[pos] for s in seqs], [pos] * len(seqs), tables, block, "cuda")
        decode.append(model.forward_logits(step, kv))
    return prefill, torch.cat(decode)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.inference_mode()
@pytest.mark.parametrize("prefill", ["scaled_mm", "dequant"])
def test_fp8_triton_model_matches_the_emulated_reference(fp8_model, prefill):
    """Teacher-forced: 4 x 64 prefill rows (the prefill candidate) and 16 decode steps
    of 4 rows (the skinny kernel with every fusion). Decode within bf16 rounding of the
    emulated numerics; `dequant` prefill too; `scaled_mm` prefill, which quantizes its
    activations, within FP8's rounding and with the same top-1 nearly everywhere."""
    from hybridd.kernels.choices import KernelChoices
    from hybridd.kernels.selection import select_kernels

    g = torch.Generator().manual_seed(0)
    vocab = fp8_model.config.vocab_size
    seqs = [torch.randint(3, vocab, (80,), generator=g).tolist() for _ in range(4)]
    triton_kernels = fp8_model.kernels
    try:
        fp8_model.kernels = select_kernels("cuda", "torch")
        ref_prefill, ref_decode = _teacher_forced(fp8_model, seqs, 64, 16)
        fp8_model.kernels = select_kernels("cuda", KernelChoices("triton", fp8_prefill=prefill))
        fp8_model.kernels.norms_folded = triton_kernels.norms_folded
        got_prefill, got_decode = _teacher_forced(fp8_model, seqs, 64, 16)
    finally:
        fp8_model.kernels = triton_kernels
    decode_err = _rel(got_decode, ref_decode)
    prefill_err = _rel(got_prefill, ref_prefill)
    prefill_top1 = (got_prefill.argmax(-1) == ref_prefill.argmax(-1)).float().mean().item()
    decode_top1 = (got_decode.argmax(-1) == ref_decode.argmax(-1)).float().mean().item()
    print(f"fp8 {prefill}: prefill rel {prefill_err:.4f} top-1 {prefill_top1:.3f}; decode rel {decode_err:.4f} "
          f"top-1 {decode_top1:.3f}")
    assert decode_err < 3e-2 and decode_top1 >= 0.95
    if prefill == "dequant":
        assert prefill_err < 3e-2 and prefill_top1 >= 0.95
    else:
        assert prefill_err < 0.1 and prefill_top1 >= 0.9


@torch.inference_mode()
def test_fp8_every_bucket_graph_equals_eager_bitwise(fp8_model):
    """The FP8 model through captured graphs: every decode bucket (the skinny FP8 GEMM
    with its fusions) and every prefill bucket (the prefill candidate) replays what the
    eager step computes on the same padded inputs, bit for bit."""
    graphs = make_runner(fp8_model, True)
    eager = make_runner(fp8_model, False)
    graphs.capture_decode_graphs()
    for size in PREFILL:
        assert graphs._capture("prefill", size), graphs.stats[("prefill", size)].disabled
    seqs = Seqs(14, seed=2)
    for i in range(14):  # one at a time: every prompt (5-300 tokens) fits the largest prefill bucket
        shape, got, ref = run_both(graphs, eager, seqs.prefill_step([i]))
        assert shape.graph and torch.equal(got, ref), f"prefill bucket {shape.bucket}"
    g = torch.Generator().manual_seed(3)
    for n in [1, 2, 3, 5, 8, 9, 14, 1, 4]:
        idx = torch.randperm(14, generator=g)[:n].tolist()
        shape, got, ref = run_both(graphs, eager, seqs.decode_step(idx))
        assert shape.graph and torch.equal(got, ref), f"decode bucket {shape.bucket} with {n} rows"
