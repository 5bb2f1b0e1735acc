"""The MLP as one persistent kernel (hybridd/kernels/triton_mlp.py) against the torch
reference and against the skinny kernels it replaces: on the CPU through Triton's
interpreter in float32 on small shapes (its two phases as two launches), and on the GPU
in bf16 for the MLPs of Llama-2-7B and Llama-3-8B, once as the step's graphs replay it
(tests marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridd.kernels import ops as ref_ops
from tests.triton_target import CUDA, DEVICE, DTYPE, rel, require_triton

require_triton()

from hybridd.kernels import split_scratch, triton_gemm, triton_mlp  # noqa: E402
from hybridd.kernels.triton_gemm import FoldedNorm, GemmConfig  # noqa: E402
from hybridd.kernels.triton_mlp import MlpConfig  # noqa: E402

TOL = 1e-2 if CUDA else 1e-5
SMALL = MlpConfig(gate_up_block_n=32, gate_up_block_k=32, gate_up_stages=2, down_block_n=16, down_block_k=16,
                  down_stages=2)


def operands(m: int, hidden: int, inter: int, parts: int, seed: int):
    """x (the stream), its rows' sums of squares in `parts` parts, gate/up and down weights."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, hidden, dtype=DTYPE, device=DEVICE, generator=g)
    w_gu = torch.randn(2 * inter, hidden, dtype=DTYPE, device=DEVICE, generator=g) * hidden**-0.5
    w_d = torch.randn(hidden, inter, dtype=DTYPE, device=DEVICE, generator=g) * inter**-0.5
    squares = x.float().pow(2)
    cuts = torch.linspace(0, hidden, parts + 1).long().tolist()
    sums = torch.stack([squares[:, a:c].sum(1) for a, c in zip(cuts[:-1], cuts[1:])], dim=1).contiguous()
    return x, FoldedNorm(1e-5, sums), w_gu, w_d


def reference(x, norm, w_gu, w_d):
    """residual + down(silu(gate) * up of rms_norm(x)) in torch, with unit norm weights."""
    normed = ref_ops.rms_norm(x, torch.ones(x.shape[1], dtype=x.dtype, device=x.device), norm.eps)
    return x + F.linear(ref_ops.silu_and_mul(F.linear(normed, w_gu)), w_d)


def separate_kernels(x, norm, w_gu, w_d, config: MlpConfig):
    """The same MLP as the skinny kernels compute it: gated gate/up, then down with the residual."""
    gu = GemmConfig(config.gate_up_block_n, config.gate_up_block_k)
    h = triton_gemm.launch(x, w_gu, None, gu, gated=True, norm=norm)
    return triton_gemm.launch(h, w_d, None, GemmConfig(config.down_block_n, config.down_block_k), residual=x)


@pytest.mark.parametrize(("m", "hidden", "inter", "parts"),
                         [(1, 64, 160, 4), (5, 64, 160, 1), (16, 32, 96, 3), (9, 32, 64, 2)])
def test_fused_mlp_is_the_gate_up_then_down_kernels(m, hidden, inter, parts):
    """One to 16 rows, down tiles split in K or not by the programs there are: the torch
    MLP with the residual added, the same sums as the skinny kernels' (up to float32
    order), and each row's sum of squares of the result in parts, one per
    down tile, which the next projection's folded norm adds up."""
    x, norm, w_gu, w_d = operands(m, hidden, inter, parts, seed=m * 100 + hidden + inter)
    out = triton_mlp.fused_mlp(x, norm, w_gu, w_d, x, SMALL)
    assert out is not None
    y, sums = out
    assert y.shape == (m, hidden) and y.dtype == DTYPE and sums.shape == (m, hidden // SMALL.down_block_n)
    assert rel(y, reference(x, norm, w_gu, w_d)) < TOL
    want, want_sums = separate_kernels(x, norm, w_gu, w_d, SMALL)
    assert rel(y, want) < (1e-2 if CUDA else 1e-6)
    assert rel(sums.sum(1), y.float().pow(2).sum(1)) < 1e-5
    assert rel(sums.sum(1), want_sums.sum(1)) < (2e-2 if CUDA else 1e-6)


def test_down_splits_and_their_counters_rearm_between_calls():
    """Four down tiles of ten K blocks, split in K among the programs there are, summed by
    the last split to arrive, which re-arms the tile's counter; the next call gives the same bits."""
    x, norm, w_gu, w_d = operands(3, 64, 160, 4, seed=11)
    assert triton_mlp._split(SMALL, 64, 160, triton_mlp._programs(x.device)) > 1
    first, _ = triton_mlp.fused_mlp(x, norm, w_gu, w_d, x, SMALL)
    second, _ = triton_mlp.fused_mlp(x, norm, w_gu, w_d, x, SMALL)
    assert torch.equal(first, second)
    counters = split_scratch.scratch(x.device, "mlp_counters", triton_mlp._COUNTERS, torch.int32)
    assert int(counters.abs().sum()) == 0
    barrier = split_scratch.scratch(x.device, "mlp_barrier", 2, torch.int32)
    assert int(barrier[0]) == 0


def test_shapes_the_kernel_cannot_take_go_back_to_the_caller():
    """More than 16 rows, or tiles that do not divide the weights: None, and the caller
    runs the separate kernels."""
    x, norm, w_gu, w_d = operands(17, 64, 160, 4, seed=2)
    assert triton_mlp.fused_mlp(x, norm, w_gu, w_d, x, SMALL) is None
    x, norm, w_gu, w_d = operands(2, 64, 100, 4, seed=3)  # 100 columns: not whole 16-column down steps
    assert triton_mlp.fused_mlp(x, norm, w_gu, w_d, x, SMALL) is None


def test_inconsistent_operands_are_refused_by_name():
    x, norm, w_gu, w_d = operands(2, 64, 160, 4, seed=4)
    with pytest.raises(ValueError, match=r"hidden size 64 needs gate/up \[320, 64\] and down \[64, 160\] weights, "
                                         r"got \(320, 64\) and \(64, 96\)"):
        triton_mlp.fused_mlp(x, norm, w_gu, w_d[:, :96], x, SMALL)
    with pytest.raises(ValueError, match=r"MLP of 2 rows needs a \[2, 64\] residual"):
        triton_mlp.fused_mlp(x, norm, w_gu, w_d, x[:1], SMALL)
    with pytest.raises(ValueError, match="phases must be 1, 2 or 3, got 0"):
        triton_mlp.fused_mlp(x, norm, w_gu, w_d, x, SMALL, phases=0)


LLAMA_MLPS = {"llama2-7b": (4096, 11008), "llama3-8b": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA_MLPS)
def test_fused_mlp_on_gpu_matches_the_separate_kernels(shape):
    """Row counts 1-16 for both models' MLPs, with the kernel's own config and one
    program per multiprocessor meeting at the grid barrier: the skinny kernels' result
    within a bf16 rounding step, and the torch reference."""
    hidden, inter = LLAMA_MLPS[shape]
    for m in (1, 2, 7, 16):
        x, norm, w_gu, w_d = operands(m, hidden, inter, 64, seed=m)
        y, sums = triton_mlp.fused_mlp(x, norm, w_gu, w_d, x)
        want, _ = separate_kernels(x, norm, w_gu, w_d, triton_mlp.CONFIG)
        assert rel(y, want) < 5e-3, m
        assert rel(y, reference(x, norm, w_gu, w_d)) < 1e-2, m
        assert rel(sums.sum(1), y.float().pow(2).sum(1)) < 1e-5, m


@pytest.mark.gpu
@pytest.mark.parametrize("with_pdl", [False, True])
def test_fused_mlp_replays_in_a_graph(with_pdl, monkeypatch):
    """Captured in a CUDA graph (cooperative launch, with and without dependent launch) and
    replayed 50 times over fresh inputs, each replay gives the eager call's result: the
    barrier and the split counters re-arm themselves."""
    from hybridd.kernels import pdl

    monkeypatch.setattr(pdl, "ENABLED", with_pdl)
    hidden, inter = LLAMA_MLPS["llama2-7b"]
    x, norm, w_gu, w_d = operands(4, hidden, inter, 64, seed=9)
    static_x, static_sums = x.clone(), norm.sum_squares.clone()
    # The first call compiles the kernel and makes the scratch the graph shares.
    triton_mlp.fused_mlp(static_x, FoldedNorm(norm.eps, static_sums), w_gu, w_d, static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, _ = triton_mlp.fused_mlp(static_x, FoldedNorm(norm.eps, static_sums), w_gu, w_d, static_x)
    for i in range(50):
        x, norm, _, _ = operands(4, hidden, inter, 64, seed=100 + i)
        static_x.copy_(x)
        static_sums.copy_(norm.sum_squares)
        graph.replay()
        want, _ = triton_mlp.fused_mlp(x, norm, w_gu, w_d, x)
        assert torch.equal(y, want), i
