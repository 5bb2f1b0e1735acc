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
    path = make_checkpoint(Path(f"/tmp/hybridd-{preset}-normal-random"), preset)
    return _load_fp8(path), path


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
    path = _llama3_8b_layers(Path("/tmp/hybridd-llama3-8b-2-layers-random"))
    model = _load_fp8(path)
    yield model, path
    del model
    torch.cuda.empty_cache()


def _teacher_forced(model, seqs, prompt_len: int, decode_len: int, prefill_activations: str = "none"):
    """Logits of a prefill of each sequence's first `prompt_len` tokens and of
    `decode_len` decode steps feeding the sequences' own next tokens; the prefill's
    projections quantize their activations as `prefill_activations` says."""
    from hybridd.model import KVCache, StepInputs

    block = 16
    projections = [p for layer in model.layers for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                         layer.down_proj)]
    kv = KVCache.allocate(model.config, 16 * len(seqs), block, model.dtype, "cuda")
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(seqs))]
    for p in projections:
        p.activations = prefill_activations
    try:
        step = StepInputs.prefill([s[:prompt_len] for s in seqs], tables, block, "cuda")
        prefill = model.compute_logits(model(step, kv))
    finally:
        for p in projections:
            p.activations = "none"
    decode = []
    for t in range(decode_len):
        pos = prompt_len + t
        step = StepInputs.decode([s[pos] for s in seqs], [pos] * len(seqs), tables, block, "cuda")
        decode.append(model.forward_logits(step, kv))
    return prefill, torch.cat(decode)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _top1(a, b) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@torch.inference_mode()
def test_fp8_triton_model_matches_the_emulated_reference(any_fp8_model):
    """Teacher-forced: 4 x 64 prefill rows (FP8 × FP8) and 16 decode steps of 4 rows (the
    skinny kernel with every fusion). The yardstick is the emulated numerics in float32
    activations (the torch kernels on the same FP8 weights, its prefill's activations
    quantized per token as the FP8 × FP8 prefill quantizes them, `fp8.product`): the
    Triton path is no further from it than the torch kernels' own bf16 run, and as often
    right, within 2 % (on random weights the top logits sit close together, so bf16
    runs disagree on some positions; see tests/test_gpu_model.py)."""
    from hybridd.kernels.choices import KernelChoices
    from hybridd.kernels.selection import select_kernels
    from hybridd.model import load_model

    fp8_model, path = any_fp8_model
    g = torch.Generator().manual_seed(0)
    vocab = fp8_model.config.vocab_size
    seqs = [torch.randint(3, vocab, (80,), generator=g).tolist() for _ in range(4)]
    activations = "dynamic"
    yardstick = load_model(path, dtype=torch.float32, device="cuda", max_positions=2048, quantization="fp8",
                           kernels="torch")
    ref = _teacher_forced(yardstick, seqs, 64, 16, activations)
    del yardstick
    torch.cuda.empty_cache()
    triton_kernels = fp8_model.kernels
    try:
        fp8_model.kernels = select_kernels("cuda", "torch")
        bf16 = _teacher_forced(fp8_model, seqs, 64, 16, activations)
        fp8_model.kernels = select_kernels("cuda", KernelChoices("triton"))
        fp8_model.kernels.norms_folded = triton_kernels.norms_folded
        got = _teacher_forced(fp8_model, seqs, 64, 16)
    finally:
        fp8_model.kernels = triton_kernels
    for i, part in enumerate(("prefill", "decode")):
        figures = {"triton_rel": _rel(got[i], ref[i]), "torch_bf16_rel": _rel(bf16[i], ref[i]),
                   "triton_top1": _top1(got[i], ref[i]), "torch_bf16_top1": _top1(bf16[i], ref[i])}
        print(f"fp8 {part}: {figures}")
        assert figures["triton_rel"] <= 1.1 * figures["torch_bf16_rel"] + 1e-3, (part, figures)
        assert figures["triton_top1"] >= figures["torch_bf16_top1"] - 0.02, (part, figures)


@torch.inference_mode()
def test_fp8_every_bucket_graph_equals_eager_bitwise(fp8_model):
    """The FP8 model through captured graphs: every decode bucket (the skinny FP8 GEMM
    with its fusions) and every prefill bucket (the prefill candidate) replays what the
    eager step computes on the same padded inputs, bit for bit."""
    fp8_model, _ = fp8_model
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
