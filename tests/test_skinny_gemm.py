"""The skinny projection kernel (hybridd/model/triton_gemm.py) against torch's F.linear:
on the CPU through Triton's interpreter in float32 on small odd shapes, and on the GPU in
bf16 for every projection of Llama-2-7B and Llama-3-8B (tests marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridd.model import ops as ref_ops
from tests.triton_target import CUDA, DEVICE, DTYPE, rel, require_triton

require_triton()

from hybridd.model import split_scratch  # noqa: E402
from hybridd.model import triton_gemm  # noqa: E402
from hybridd.model.triton_gemm import GemmConfig  # noqa: E402

# bf16 outputs round once from float32 sums whose order differs from cuBLAS's.
TOL = 1e-2 if CUDA else 1e-5

LLAMA2_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
             "lm_head": (32000, 4096)}
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}


def operands(m: int, n: int, k: int, bias: bool, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, dtype=DTYPE, device=DEVICE, generator=g)
    w = torch.randn(n, k, dtype=DTYPE, device=DEVICE, generator=g) * 0.05
    b = torch.randn(n, dtype=DTYPE, device=DEVICE, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize(
    ("m", "n", "k", "split", "bias"),
    [
        (1, 48, 96, 1, False),   # one row, no split
        (5, 50, 200, 3, True),   # N and K not multiples of the tiles, uneven split, bias
        (17, 33, 130, 2, False),  # BLOCK_M 32, a split running past K
        (32, 64, 256, 4, True),  # the most rows, even split
        (3, 16, 64, 8, False),   # as many splits as K blocks
        (7, 40, 100, 1, False),  # K not a multiple of BLOCK_K without a split
    ],
)
def test_skinny_matches_linear_on_odd_shapes(m, n, k, split, bias):
    x, w, b = operands(m, n, k, bias, seed=m * 1000 + n + k)
    config = GemmConfig(block_n=16, block_k=32, split_k=split)
    out = triton_gemm.launch(x, w, b, config)
    assert out is not None and out.shape == (m, n) and out.dtype == DTYPE
    assert torch.isfinite(out).all()
    assert rel(out, F.linear(x, w, b)) < TOL


@pytest.mark.parametrize(("m", "inter", "k", "block_n"), [(1, 48, 96, 16), (5, 50, 200, 32), (17, 40, 130, 16),
                                                      (32, 64, 256, 64)])
def test_gated_product_is_the_projection_then_silu_and_mul(m, inter, k, block_n):
    """SiLU·mul in the product's epilogue gives the bits of the projection followed by
    the separate SiLU·mul kernel, on odd shapes (I not a multiple of the tile, K not of
    BLOCK_K), and matches the torch reference."""
    from hybridd.model import triton_ops

    x, w, _ = operands(m, 2 * inter, k, False, seed=m + inter + k)
    config = GemmConfig(block_n=block_n, block_k=32)
    fused = triton_gemm.launch(x, w, None, config, gated=True)
    assert fused is not None and fused.shape == (m, inter)
    separate = triton_ops.silu_and_mul(triton_gemm.launch(x, w, None, config))
    if CUDA:
        assert torch.equal(fused, separate)
    else:
        # The interpreter's tl.dot is numpy's BLAS, whose summation order can depend on
        # where a row sits in the tile (and on the host's CPU): equal up to float32 order.
        assert rel(fused, separate) < 1e-6
    assert rel(fused, ref_ops.silu_and_mul(F.linear(x, w))) < TOL


@pytest.mark.parametrize(("value", "fused"), [("1", True), ("0", False), (None, False)])
def test_silu_epilogue_switch(value, fused):
    """HYBRIDD_FUSE_SILU_AND_MUL turns the epilogue on with 1, off with 0 or unset."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HYBRIDD_FUSE_SILU_AND_MUL"}
    if value is not None:
        env["HYBRIDD_FUSE_SILU_AND_MUL"] = value
    code = "from hybridd.model import triton_gemm; print(triton_gemm.FUSE_SILU_AND_MUL)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(fused)


def test_silu_epilogue_switch_refuses_other_values():
    import os
    import subprocess
    import sys

    env = dict(os.environ, HYBRIDD_FUSE_SILU_AND_MUL="yes")
    out = subprocess.run([sys.executable, "-c", "import hybridd.model.triton_gemm"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    assert "HYBRIDD_FUSE_SILU_AND_MUL must be 1 (on) or 0 (off), got 'yes'" in out.stderr


def test_gated_product_leaves_splits_and_biases_to_the_separate_kernels():
    x, w, b = operands(3, 64, 128, True, seed=5)
    assert triton_gemm.launch(x, w, None, GemmConfig(16, 32, split_k=2), gated=True) is None
    assert triton_gemm.launch(x, w, b, GemmConfig(16, 32), gated=True) is None


def test_split_counters_rearm_between_calls():
    """A split product leaves its arrival counters at zero, so the next launch (or graph
    replay) of any split product starts clean and gets the same answer."""
    x, w, _ = operands(4, 40, 160, False, seed=3)
    config = GemmConfig(block_n=16, block_k=32, split_k=4)
    first = triton_gemm.launch(x, w, None, config)
    second = triton_gemm.launch(x, w, None, config)
    assert torch.equal(first, second)
    counters = split_scratch.scratch(x.device, "gemm_counters", triton_gemm._COUNTERS, torch.int32)
    assert int(counters.abs().sum()) == 0
    assert rel(first, F.linear(x, w)) < TOL


def test_rows_beyond_the_kernel_go_to_torch():
    """More than 32 rows, a weight not stored row-major, or a shape the table has no config
    for, is F.linear itself."""
    x, w, b = operands(33, 24, 40, True, seed=5)
    assert triton_gemm.launch(x, w, b, GemmConfig(16, 32)) is None
    assert torch.equal(triton_gemm.linear(x, w, b), F.linear(x, w, b))
    assert triton_gemm.launch(x[:3], w.t().contiguous().t(), b, GemmConfig(16, 32)) is None  # column-major
    small = x[:3]
    assert triton_gemm.config_for(3, 24, 40) is None
    assert torch.equal(triton_gemm.linear(small, w, b), F.linear(small, w, b))


def test_torch_kernels_keep_plain_linear():
    """The CPU reference path is F.linear, unchanged."""
    x, w, b = operands(3, 24, 40, True, seed=7)
    assert torch.equal(ref_ops.TorchKernels.linear(x, w, b), F.linear(x, w, b))


def _shapes():
    for model, shapes in (("llama2-7b", LLAMA2_7B), ("llama3-8b", LLAMA3_8B)):
        for name, (n, k) in shapes.items():
            yield pytest.param(n, k, id=f"{model}-{name}")


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [LLAMA2_7B["gate_up"], LLAMA3_8B["gate_up"]], ids=["llama2-7b", "llama3-8b"])
def test_gated_product_on_gpu_is_the_separate_kernels_bit_for_bit(n, k, monkeypatch):
    """The gate/up projection with SiLU·mul in its epilogue, through the dispatch, for M in
    {1, 2, 7, 8, 16, 32}: the bits of the projection then the SiLU·mul kernel."""
    from hybridd.model import triton_ops

    monkeypatch.setattr(triton_gemm, "FUSE_SILU_AND_MUL", True)
    x_full, w, _ = operands(32, n, k, False, seed=n)
    for m in (1, 2, 7, 8, 16, 32):
        x = x_full[:m]
        separate = triton_ops.silu_and_mul(triton_gemm.linear(x, w))
        assert torch.equal(triton_gemm.linear_silu_and_mul(x, w), separate), m
        assert rel(separate, ref_ops.silu_and_mul(F.linear(x, w))) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), _shapes())
def test_every_projection_shape_on_gpu(n, k):
    """Through the dispatch (the table's kernel or cuBLAS) and through the kernel itself
    (the table's config, or a generic split one where cuBLAS was chosen), for M in
    {1, 2, 7, 8, 16, 32}."""
    x_full, w, _ = operands(32, n, k, False, seed=n + k)
    for m in (1, 2, 7, 8, 16, 32):
        x = x_full[:m]
        ref = F.linear(x, w)
        assert rel(triton_gemm.linear(x, w), ref) < TOL
        config = triton_gemm.config_for(m, n, k) or GemmConfig(64, 128, split_k=4 if n <= 8192 else 1)
        out = triton_gemm.launch(x, w, None, config)
        assert out is not None and rel(out, ref) < TOL, (m, config)
        if n <= 16384:  # an uneven split (the last one partly past K); its partials fit the workspace
            split = triton_gemm.launch(x, w, None, GemmConfig(64, 128, split_k=3))
            assert split is not None and rel(split, ref) < TOL, m


@pytest.mark.gpu
def test_split_product_replays_in_a_cuda_graph():
    """Captured once, replayed with new inputs: the split counters re-arm inside the graph."""
    x, w, b = operands(8, 4096, 4096, True, seed=11)
    config = GemmConfig(64, 128, split_k=4)
    triton_gemm.launch(x, w, b, config)  # compiles and makes the scratch outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_gemm.launch(x, w, b, config)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, F.linear(x, w, b)) < TOL


@pytest.mark.gpu
def test_norm_projection_chain_in_a_graph_matches_torch():
    """A layer's norm -> gate_up -> SiLU·mul -> down chain of the 7B shape at one row,
    captured in a graph and replayed with fresh inputs, matches the torch path."""
    from hybridd.model import triton_ops

    n_in, inter = 4096, 11008
    g = torch.Generator(device=DEVICE).manual_seed(13)
    w_up = torch.randn(2 * inter, n_in, dtype=DTYPE, device=DEVICE, generator=g) * 0.02
    w_down = torch.randn(n_in, inter, dtype=DTYPE, device=DEVICE, generator=g) * 0.02
    norm_w = torch.rand(n_in, dtype=DTYPE, device=DEVICE, generator=g) + 0.5
    x = torch.randn(1, n_in, dtype=DTYPE, device=DEVICE, generator=g)
    res = torch.randn(1, n_in, dtype=DTYPE, device=DEVICE, generator=g)

    def chain():
        h, _ = triton_ops.add_rms_norm(x, res, norm_w, 1e-5)
        return triton_gemm.linear(triton_ops.silu_and_mul(triton_gemm.linear(h, w_up)), w_down)

    def reference():
        h, _ = ref_ops.add_rms_norm(x, res, norm_w, 1e-5)
        return F.linear(ref_ops.silu_and_mul(F.linear(h, w_up)), w_down)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, reference()) < 2 * TOL


@pytest.mark.gpu
def test_capture_after_one_eager_call_needs_no_compile():
    """The graph runner warms up at one row and then captures every decode bucket: the first
    eager call compiles every variant the table can pick for that shape, so a capture at
    32 rows (BLOCK_M 32, another config for the LM head) launches a loaded kernel."""
    n, k = 32000, 4096
    x, w, b = operands(32, n, k, True, seed=17)  # with a bias: kernels no other test compiles
    triton_gemm.linear(x[:1], w, b)
    torch.cuda.synchronize()
    kernels = triton_gemm._skinny_gemm_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_gemm.linear(x, w, b)
    assert len(kernels) == compiled
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, F.linear(x, w, b)) < TOL
