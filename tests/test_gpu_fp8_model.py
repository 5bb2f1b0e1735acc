"""On the GPU: a model quantized to FP8 at load through the Triton kernels, against the
same FP8 weights through the torch kernels (the emulated numerics), with each prefill
candidate, on random weights of the Llama-1B shape ($HYBRIDD_GPU_RUNNER_PRESET) and of
two layers of the Llama-3-8B shape (its widths, 8 KV heads, its 128256-token vocabulary);
and the Llama-1B one through the graph runner, every decode and prefill graph equal to
the eager path bitwise, as for bf16 (tests/test_gpu_graph_runner.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.test_gpu_graph_runner import PREFILL, Seqs, make_runner, run_both

pytestmark = pytest.mark.gpu


def _load_fp8(path: Path):
    from hybridd.model import load_model

    model = load_model(path, dtype=torch.bfloat16, device="cuda", max_positions=2048, quantization="fp8")
    assert model.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].qkv_proj.weight.device.type == "cuda"
    return model


@pytest.fixture(scope="module")
def fp8_model():
    from tests.random_checkpoint import make_checkpoint

    preset = os.environ.get("HYBRIDD_GPU_RUNNER_PRESET", "llama-1b")
    return _load_fp8(make_checkpoint(Path(f"/tmp/hybridd-{preset}-normal-random"), preset))


def _llama3_8b_layers(path: Path, layers: int = 2) -> Path:
    """Random bf16 weights (N(0, 0.02), unit norms) of the first `layers` layers of the
    Llama-3-8B shape, with its embedding and LM head, written once per machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=g)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


@pytest.fixture(scope="module", params=["runner-preset", "llama3-8b-2-layers"])
def any_fp8_model(request, fp8_model):
    if request.param == "runner-preset":
        yield fp8_model
        return
    model = _load_fp8(_llama3_8b_layers(Path("/tmp/hybridd-llama3-8b-2-layers-random")))
    yield model
    del model
    torch.cuda.empty_cache()


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
def test_fp8_triton_model_matches_the_emulated_reference(any_fp8_model, prefill):
    """Teacher-forced: 4 x 64 prefill rows (the prefill candidate) and 16 decode steps
    of 4 rows (the skinny kernel with every fusion). Decode within bf16 rounding of the
    emulated numerics; `dequant` prefill too; `scaled_mm` prefill, which quantizes its
    activations, within FP8's rounding and with the same top-1 nearly everywhere."""
    from hybridd.kernels.choices import KernelChoices
    from hybridd.kernels.selection import select_kernels

    fp8_model = any_fp8_model
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
        assert graphs._capture(True, size), graphs.stats[("prefill", size)].disabled
    seqs = Seqs(14, seed=2)
    for i in range(14):  # one at a time: every prompt (5-300 tokens) fits the largest prefill bucket
        shape, got, ref = run_both(graphs, eager, seqs.prefill_step([i]))
        assert shape.graph and torch.equal(got, ref), f"prefill bucket {shape.bucket}"
    g = torch.Generator().manual_seed(3)
    for n in [1, 2, 3, 5, 8, 9, 14, 1, 4]:
        idx = torch.randperm(14, generator=g)[:n].tolist()
        shape, got, ref = run_both(graphs, eager, seqs.decode_step(idx))
        assert shape.graph and torch.equal(got, ref), f"decode bucket {shape.bucket} with {n} rows"
