"""The skinny projection kernel (hybridd/kernels/triton_gemm.py) against torch's F.linear:
on the CPU through Triton's interpreter in float32 on small odd shapes, and on the GPU in
bf16 for every projection of Llama-2-7B and Llama-3-8B (tests marked `gpu`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hybridd.kernels import ops as ref_ops
from tests.triton_target import CUDA, DEVICE, DTYPE, rel, require_triton

require_triton()

from hybridd.kernels import gemm_fusions  # noqa: E402
from hybridd.kernels import split_scratch  # noqa: E402
from hybridd.kernels import triton_gemm  # noqa: E402
from hybridd.kernels.triton_gemm import GemmConfig  # noqa: E402

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


@pytest.mark.parametrize(("m", "n", "k", "block_n", "split", "bias"),
                         [(1, 48, 96, 16, 1, False), (5, 50, 200, 16, 3, True), (17, 64, 130, 32, 2, False),
                          (32, 40, 64, 16, 1, True)])
def test_residual_epilogue_adds_to_the_stream_and_leaves_its_sums_of_squares(m, n, k, block_n, split, bias):
    """residual + x @ W.T (+ bias), and the parts of each row's sum of squares of that sum,
    one per N tile: what the next projection's folded norm adds up."""
    x, w, b = operands(m, n, k, bias, seed=m * 7 + n + k)
    residual = torch.randn(m, n, dtype=DTYPE, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(m))
    config = GemmConfig(block_n=block_n, block_k=32, split_k=split)
    out = triton_gemm.launch(x, w, b, config, residual=residual)
    assert out is not None
    summed, parts = out
    want = residual + F.linear(x, w, b)
    assert summed.shape == (m, n) and parts.shape == (m, -(-n // block_n)) and parts.dtype == torch.float32
    assert rel(summed, want) < TOL
    assert rel(parts.sum(1), summed.float().pow(2).sum(1)) < 1e-5


@pytest.mark.parametrize(("m", "k", "parts", "split"), [(1, 96, 6, 1), (5, 200, 13, 3), (17, 130, 1, 2)])
def test_folded_norm_scales_each_row_by_its_inverse_rms(m, k, parts, split):
    """A product whose W holds the norm's weight, over rows whose sums of squares come in
    parts: rms_norm(x) (unit weight) @ W.T, the norm applied once per row."""
    n = 48
    x, w, _ = operands(m, n, k, False, seed=m + k)
    squares = x.float().pow(2)
    cuts = torch.linspace(0, k, parts + 1).long()
    sums = torch.stack([squares[:, a:c].sum(1) for a, c in zip(cuts[:-1], cuts[1:])], dim=1).contiguous()
    out = triton_gemm.launch(x, w, None, GemmConfig(16, 32, split), norm=triton_gemm.FoldedNorm(1e-5, sums))
    want = F.linear(ref_ops.rms_norm(x, torch.ones(k, dtype=DTYPE, device=DEVICE), 1e-5), w)
    assert rel(out, want) < TOL


def test_fused_operands_are_checked():
    x, w, _ = operands(4, 32, 64, False, seed=1)
    rx, rw, _, r = rotary_case(4, 2, 1, 16, 64, False, seed=1)
    with pytest.raises(ValueError, match="one of rotary or residual"):
        triton_gemm.launch(rx, rw, None, GemmConfig(16, 32), rotary=r, residual=torch.zeros(4, rw.shape[0]))
    with pytest.raises(ValueError, match=r"residual of a \[4, 32\] product must be a contiguous \[4, 32\] tensor"):
        triton_gemm.launch(x, w, None, GemmConfig(16, 32), residual=torch.zeros(4, 16, dtype=DTYPE, device=DEVICE))
    with pytest.raises(ValueError, match="folded norm of 4 rows needs their sums of squares"):
        triton_gemm.launch(x, w, None, GemmConfig(16, 32), norm=triton_gemm.FoldedNorm(1e-5, torch.zeros(2, 3)))


@pytest.mark.parametrize(("m", "block_m", "split"), [(40, 64, 1), (64, 64, 2), (100, 128, 1)])
def test_a_tile_of_block_m_rows_takes_every_row(m, block_m, split):
    x, w, b = operands(m, 48, 160, True, seed=m)
    out = triton_gemm.launch(x, w, b, GemmConfig(16, 32, split, block_m=block_m))
    assert rel(out, F.linear(x, w, b)) < TOL
    # More rows than the tile holds: the caller's cuBLAS path, not a wrong product.
    assert triton_gemm.launch(torch.cat([x] * 3)[:block_m + 1], w, b, GemmConfig(16, 32, split, block_m=block_m)) is None


@pytest.mark.parametrize("block_m", [8, 48, -16])
def test_a_tile_height_that_is_not_a_power_of_two_from_16_is_refused(block_m):
    with pytest.raises(ValueError, match=f"block_m must be 0 .* or a power of two >= 16, got {block_m}"):
        GemmConfig(64, 128, block_m=block_m)


@pytest.mark.parametrize(("value", "enabled"), [
    ("none", set()), ("rotary", {"rotary"}), ("norm, rotary", {"norm", "rotary"}), ("norm", {"norm"}),
])
def test_fusions_are_named_by_a_comma_list(value, enabled):
    assert gemm_fusions.parse(value) == enabled


@pytest.mark.parametrize("value", ["yes", "", "norm,gelu", "none,rotary", "norm,silu", "norm,rotary,mlp"])
def test_fusions_refuse_other_names(value):
    with pytest.raises(ValueError, match=f"gemm_fusions must be a comma list of norm, rotary or 'none', "
                                         f"got {value!r}"):
        gemm_fusions.parse(value)


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
    """More than 32 rows, or a weight not stored row-major, is F.linear itself."""
    x, w, b = operands(33, 24, 40, True, seed=5)
    assert triton_gemm.launch(x, w, b, GemmConfig(16, 32)) is None
    assert triton_gemm.config_for(33, 24, 40, 132) is None and triton_gemm.config_for(0, 24, 40, 132) is None
    assert torch.equal(triton_gemm.linear(x, w, b), F.linear(x, w, b))
    assert triton_gemm.launch(x[:3], w.t().contiguous().t(), b, GemmConfig(16, 32)) is None  # column-major


# The configs sweeps of the benchmark shapes chose on an H200 (132 multiprocessors),
# per (N, K): [(largest row count, (block_n, block_k, split_k, num_warps, num_stages))].
SWEPT = {
    (4096, 4096): [(16, (64, 128, 1, 4, 7)), (32, (64, 256, 1, 4, 4))],
    (12288, 4096): [(32, (64, 128, 1, 4, 4))],
    (4096, 11008): [(16, (64, 128, 1, 4, 7)), (32, (64, 256, 1, 4, 4))],
    (32000, 4096): [(16, (64, 128, 1, 4, 4)), (32, (128, 128, 1, 4, 4))],
    (6144, 4096): [(32, (64, 128, 1, 4, 6))],
    (28672, 4096): [(32, (64, 128, 1, 4, 4))],
    (4096, 14336): [(16, (64, 128, 1, 4, 7)), (32, (64, 256, 2, 4, 4))],
    (128256, 4096): [(32, (128, 128, 1, 4, 4))],
    # Llama-2-7B's gate/up chose 256-column steps, within the spread of 128 up to 16 rows
    # (docs/lab/kernels.md): the rule gives it 128, as Llama-3-8B's.
    (22016, 4096): [(32, (64, 128, 1, 4, 4))],
}


@pytest.mark.parametrize(("n", "k"), list(SWEPT))
def test_the_config_rule_gives_what_the_sweeps_chose_for_the_benchmark_shapes(n, k):
    for m in range(1, 33):
        want = next(config for rows, config in SWEPT[(n, k)] if m <= rows)
        got = triton_gemm.config_for(m, n, k, 132)
        assert (got.block_n, got.block_k, got.split_k, got.num_warps, got.num_stages) == want, (m, got)


@pytest.mark.parametrize("multiprocessors", [108, 114, 132, 142])  # A100, H100 PCIe, H100 SXM / H200, L40S
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                      (4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584),
                                      (3072, 2048), (16384, 2048), (2048, 8192), (48, 96)])
def test_every_shape_on_every_gpu_gets_a_config_up_to_32_rows(n, k, multiprocessors):
    """Llama-3.1-8B, Qwen2-7B and Llama-3.2-1B shapes on other GPUs: a config that
    launches (tiles of 64 or 128 weight rows, K split at most in two) at every row count."""
    for m in range(1, 33):
        config = triton_gemm.config_for(m, n, k, multiprocessors)
        assert config is not None and config.block_n in (64, 128) and config.split_k in (1, 2), (m, config)
        assert config.block_k * config.split_k <= max(k, 2 * config.block_k), (m, config)


# An H100's shared memory a block may take.
H100_SHARED_BYTES = 227 * 1024


pipeline_bytes = triton_gemm.pipeline_bytes  # pinned by the defect's figure below


@pytest.mark.parametrize("multiprocessors", [46, 108, 114, 132, 142])
@pytest.mark.parametrize("weight_bytes", [1, 2, 4])
def test_every_config_fits_an_h100s_shared_memory(weight_bytes, multiprocessors):
    """The float32 weight's seven stages of 128 columns took 280 KiB of shared memory,
    past an H100's 227, so no step compiled: every config the rules give (bf16, float32,
    FP8), on the Llama, Qwen2 and small shapes at 1-32 rows, fits."""
    shapes = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (6144, 4096), (28672, 4096),
              (4096, 14336), (128256, 4096), (4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944),
              (152064, 3584), (3072, 2048), (16384, 2048), (2048, 8192), (48, 96), (4096, 64)]
    for n, k in shapes:
        for m in range(1, 33):
            config = triton_gemm.config_for(m, n, k, multiprocessors, weight_bytes)
            assert pipeline_bytes(config, m, weight_bytes) <= H100_SHARED_BYTES, (n, k, m, config)
    assert pipeline_bytes(GemmConfig(64, 128, 1, 4, 7), 16, 4) == 280 * 1024  # the defect's config


@pytest.mark.parametrize("weight_bytes", [1, 2, 4])
def test_a_gpu_with_less_shared_memory_gets_shallower_pipelines(weight_bytes):
    """A GPU whose blocks get 99 KiB of shared memory (an L40S) took the 227-KiB GPUs'
    seven-stage pipelines, which do not compile there: the stages are cut to what fits,
    and nothing else changes; with 227 KiB nothing is cut."""
    l40s = 99 * 1024
    for n, k in [(12288, 4096), (4096, 4096), (4096, 11008), (6144, 4096), (28672, 4096), (4096, 14336)]:
        for m in range(1, 33):
            full = triton_gemm.config_for(m, n, k, 142, weight_bytes)
            assert triton_gemm.config_for(m, n, k, 142, weight_bytes, H100_SHARED_BYTES) == full
            cut = triton_gemm.config_for(m, n, k, 142, weight_bytes, l40s)
            assert pipeline_bytes(cut, m, weight_bytes) <= l40s, (n, k, m, cut)
            assert dataclasses.replace(cut, num_stages=full.num_stages) == full
            if pipeline_bytes(full, m, weight_bytes) > l40s:
                assert pipeline_bytes(dataclasses.replace(cut, num_stages=cut.num_stages + 1), m, weight_bytes) > l40s
    assert triton_gemm.config_for(4, 4096, 4096, 142, 2).num_stages == 7  # a cut happens on this shape
    assert triton_gemm.config_for(4, 4096, 4096, 142, 2, l40s).num_stages < 7


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (128256, 4096), (4096, 64), (48, 96)])
def test_a_float32_weight_streams_the_bytes_of_the_bf16_config_a_stage(n, k):
    """A float32 model on CUDA (the exact path of the daemon tests) took the bf16 rule's
    seven stages of 128 columns: 280 KiB of shared memory, past an H100's 227, so no
    step compiled. Its stages hold the bf16 config's bytes instead."""
    for m in range(1, 33):
        bf16, fp32 = triton_gemm.config_for(m, n, k, 132, 2), triton_gemm.config_for(m, n, k, 132, 4)
        assert fp32.block_k * 4 == bf16.block_k * 2, (m, bf16, fp32)
        assert dataclasses.replace(fp32, block_k=bf16.block_k) == bf16, (m, bf16, fp32)


def test_torch_kernels_keep_plain_linear():
    """The CPU reference path is F.linear, unchanged."""
    x, w, b = operands(3, 24, 40, True, seed=7)
    assert torch.equal(ref_ops.TorchKernels.linear(x, w, b), F.linear(x, w, b))


def _shapes():
    for model, shapes in (("llama2-7b", LLAMA2_7B), ("llama3-8b", LLAMA3_8B)):
        for name, (n, k) in shapes.items():
            yield pytest.param(n, k, id=f"{model}-{name}")


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), _shapes())
def test_every_projection_shape_on_gpu(n, k):
    """Through the dispatch and through the kernel itself with the rule's config, for M in
    {1, 2, 7, 8, 16, 32}."""
    x_full, w, _ = operands(32, n, k, False, seed=n + k)
    for m in (1, 2, 7, 8, 16, 32):
        x = x_full[:m]
        ref = F.linear(x, w)
        assert rel(triton_gemm.linear(x, w), ref) < TOL
        config = triton_gemm.config_of(m, w)
        out = triton_gemm.launch(x, w, None, config)
        assert out is not None and rel(out, ref) < TOL, (m, config)
        if n <= 16384:  # an uneven split (the last one partly past K); its partials fit the workspace
            split = triton_gemm.launch(x, w, None, GemmConfig(64, 128, split_k=3))
            assert split is not None and rel(split, ref) < TOL, m


@pytest.mark.gpu
def test_split_product_gives_the_same_bits_every_launch():
    """The last split program to arrive sums the partials in split order, so the arrival
    order, which varies from launch to launch, does not change a bit of the result (with
    the residual epilogue too)."""
    x, w, b = operands(5, 4096, 11008, False, seed=13)
    residual = torch.randn(5, 4096, dtype=DTYPE, device=DEVICE)
    config = GemmConfig(64, 256, split_k=8)
    first = triton_gemm.launch(x, w, None, config)
    first_sum, first_squares = triton_gemm.launch(x, w, None, config, residual=residual)
    for _ in range(100):
        assert torch.equal(triton_gemm.launch(x, w, None, config), first)
        summed, squares = triton_gemm.launch(x, w, None, config, residual=residual)
        assert torch.equal(summed, first_sum) and torch.equal(squares, first_squares)


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
    from hybridd.kernels import triton_ops

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


# The rotary epilogue of the fused qkv projection (RoPE and the KV-cache write).
SENTINEL = -1234.0
ROPE_POSITIONS = 512


def rotary_case(m: int, heads: int, kv_heads: int, d: int, k: int, bias: bool, seed: int, padded=()):
    """A qkv weight of `heads` q and 2 x `kv_heads` kv heads, per-row positions, shuffled
    slots (those at `padded` set to -1) and caches filled with a sentinel."""
    from hybridd.model.config import RopeConfig
    from hybridd.model.rope import cos_sin_table

    x, w, b = operands(m, (heads + 2 * kv_heads) * d, k, bias, seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), d, ROPE_POSITIONS, torch.device(DEVICE))
    page, blocks = 4, 12
    positions = torch.randperm(ROPE_POSITIONS, device=DEVICE, generator=g)[:m]
    slots = torch.randperm(blocks * page, device=DEVICE, generator=g)[:m]
    slots[list(padded)] = -1
    k_cache = torch.full((blocks + 1, page, kv_heads, d), SENTINEL, dtype=DTYPE, device=DEVICE)
    rotary = triton_gemm.RotaryArgs(heads, kv_heads, d, positions, slots, k_cache, k_cache.clone(), cos, sin)
    return x, w, b, rotary


def with_fresh_caches(r):
    """The same operands with caches of their own (sentinel-filled), for a second run."""
    from dataclasses import replace

    return replace(r, k_cache=torch.full_like(r.k_cache, SENTINEL), v_cache=torch.full_like(r.v_cache, SENTINEL))


def check_caches(r, k: torch.Tensor, v: torch.Tensor):
    """Each real row's slot holds exactly that row's (rotated) k and its v; every other
    slot, the padded rows' included, still holds the sentinel."""
    flat_k = r.k_cache.view(-1, r.num_kv_heads, r.head_dim)
    flat_v = r.v_cache.view(-1, r.num_kv_heads, r.head_dim)
    real = r.slot_mapping >= 0
    slots = r.slot_mapping[real]
    assert torch.equal(flat_k[slots], k[real]) and torch.equal(flat_v[slots], v[real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert bool((flat_k[untouched] == SENTINEL).all()) and bool((flat_v[untouched] == SENTINEL).all())


ROTARY_CASES = [
    # m, heads, kv_heads, d, k, block_n, split, bias, padded rows
    pytest.param(1, 4, 1, 16, 72, 16, 1, False, (), id="m1-gqa4to1-d16"),
    pytest.param(5, 4, 2, 32, 100, 16, 1, True, (1, 3), id="m5-gqa4to2-d32-two-tiles-per-head-bias-padding"),
    pytest.param(17, 4, 4, 32, 96, 32, 1, True, (0, 16), id="m17-mha-d32-bm32-bias-padding"),
    pytest.param(5, 4, 2, 16, 130, 16, 3, True, (2,), id="m5-gqa-d16-split3-bias-padding"),
    pytest.param(17, 4, 1, 32, 200, 16, 2, False, (5,), id="m17-gqa4to1-d32-split2-bm32-padding"),
    pytest.param(32, 4, 2, 32, 64, 32, 4, True, (31,), id="m32-gqa-d32-split4-bias"),
]


def assert_matches_torch_rotary(x, w, b, r, q, k_rot, v):
    """The fused result against F.linear then the torch `rotary_write_kv` on fresh caches
    (returned): q, k, v and what went to the caches."""
    ref = with_fresh_caches(r)
    rq, rk, rv = ref.split_qkv(F.linear(x, w, b))
    rq, rk = ref_ops.rotary_write_kv(ref.positions, rq, rk, rv, ref.k_cache, ref.v_cache, ref.slot_mapping, ref.cos,
                                     ref.sin)
    assert rel(q, rq) < TOL and rel(k_rot, rk) < TOL and rel(v, rv) < TOL
    check_caches(r, k_rot, v)
    return ref


@pytest.mark.parametrize(("m", "heads", "kv_heads", "d", "k", "block_n", "split", "bias", "padded"), ROTARY_CASES)
def test_rotary_epilogue_matches_linear_then_torch_rotary_write_kv(m, heads, kv_heads, d, k, block_n, split, bias,
                                                                   padded):
    """The product with RoPE and the KV write in its epilogue against the torch reference
    (F.linear, then `ops.rotary_write_kv`): q, k, v, and both caches, on GQA and MHA,
    head_dim 16 and 32, one and two tiles per head, BLOCK_M 16 and 32, with and without a
    bias, split K, per-row positions and padding slots (which leave the caches alone)."""
    x, w, b, r = rotary_case(m, heads, kv_heads, d, k, bias, seed=m * 100 + d + k, padded=padded)
    y = triton_gemm.launch(x, w, b, GemmConfig(block_n=block_n, block_k=32, split_k=split), rotary=r)
    assert y is not None and y.shape == (m, w.shape[0]) and y.dtype == DTYPE
    q, k_rot, v = r.split_qkv(y)

    ref = assert_matches_torch_rotary(x, w, b, r, q, k_rot, v)
    # The torch path parks padded rows in the scratch block (the last); the rest agrees.
    blocks = r.k_cache.shape[0] - 1
    real = r.slot_mapping >= 0
    for cache, ref_cache in ((r.k_cache, ref.k_cache), (r.v_cache, ref.v_cache)):
        flat, flat_ref = cache.view(-1, kv_heads, d), ref_cache.view(-1, kv_heads, d)
        assert rel(flat[r.slot_mapping[real]], flat_ref[r.slot_mapping[real]]) < TOL
        assert bool((cache[:blocks] == SENTINEL).eq(ref_cache[:blocks] == SENTINEL).all())


@pytest.mark.parametrize(("m", "heads", "kv_heads", "d", "k", "block_n", "split", "bias", "padded"),
                         [c for c in ROTARY_CASES if c.values[6] == 1])
def test_rotary_epilogue_is_the_projection_then_rotary_write_kv(m, heads, kv_heads, d, k, block_n, split, bias,
                                                                padded):
    """The fused epilogue rounds where the separate kernels round: the plain product of the
    same config, then `triton_ops.rotary_write_kv`. On the GPU see
    `assert_same_or_a_rounding_step`; on the CPU up to the interpreter's summation order
    (its tl.dot is numpy's BLAS, whose order can depend on where a row sits in the tile)."""
    from hybridd.kernels import triton_ops

    x, w, b, r = rotary_case(m, heads, kv_heads, d, k, bias, seed=m + d + k, padded=padded)
    config = GemmConfig(block_n=block_n, block_k=32, split_k=split)
    q, k_rot, v = r.split_qkv(triton_gemm.launch(x, w, b, config, rotary=r))
    sep = with_fresh_caches(r)
    sq, sk, sv = sep.split_qkv(triton_gemm.launch(x, w, b, config))
    sq, sk = triton_ops.rotary_write_kv(sep.positions, sq, sk, sv, sep.k_cache, sep.v_cache, sep.slot_mapping,
                                        sep.cos, sep.sin)
    if CUDA:
        for name, got, want in (("q", q, sq), ("k", k_rot, sk), ("v", v, sv), ("k cache", r.k_cache, sep.k_cache),
                                ("v cache", r.v_cache, sep.v_cache)):
            assert_same_or_a_rounding_step(got, want, name)
    else:
        for a, e in ((q, sq), (k_rot, sk), (v, sv), (r.k_cache, sep.k_cache), (r.v_cache, sep.v_cache)):
            assert rel(a, e) < 1e-6


def test_rotary_epilogue_needs_tiles_of_whole_pairs_of_one_head():
    """A BLOCK_N whose half does not divide head_dim / 2 (16 or 32 pairs against 8, or 3)
    falls back: None, and nothing is written to the caches."""
    x, w, b, r = rotary_case(3, 4, 2, 16, 64, True, seed=9, padded=())
    for block_n in (32, 64, 6):
        assert triton_gemm.launch(x, w, b, GemmConfig(block_n=block_n, block_k=32), rotary=r) is None, block_n
    assert bool((r.k_cache == SENTINEL).all()) and bool((r.v_cache == SENTINEL).all())
    assert triton_gemm.launch(x, w, b, GemmConfig(block_n=16, block_k=32), rotary=r) is not None
    with pytest.raises(ValueError):  # a weight that is not the stated heads
        triton_gemm.launch(x, w[:-16], None, GemmConfig(block_n=16, block_k=32), rotary=r)


def rotary_skinny(x, w, b, r):
    """The table's skinny product with the rotary epilogue, as (q, k, v) views, or None."""
    out = triton_gemm.skinny(x, w, b, rotary=r)
    return None if out is None else r.split_qkv(out)


def test_rotary_dispatch_takes_the_rule_config(monkeypatch):
    """Through `skinny` the rotary product takes `config_for`'s config (split here) and
    its q, k and v are views of one buffer; where that config's tile cannot hold whole
    rotate-half pairs of a head (64 rows, heads of 16 dims) it returns None and writes
    nothing."""
    heads, kv_heads, d, k = 4, 2, 16, 96
    x, w, b, r = rotary_case(7, heads, kv_heads, d, k, True, seed=21, padded=(4,))
    assert triton_gemm.config_of(7, w).block_n == 64
    assert rotary_skinny(x, w, b, r) is None
    assert bool((r.k_cache == SENTINEL).all())
    monkeypatch.setattr(triton_gemm, "config_for", lambda m, n, k, multiprocessors, weight_bytes=2, shared_bytes=None: GemmConfig(16, 32, split_k=2)
                        if m <= triton_gemm.MAX_ROWS else None)
    q, k_rot, v = rotary_skinny(x, w, b, r)
    assert q.shape == (7, heads, d) and k_rot.shape == (7, kv_heads, d) and v.shape == (7, kv_heads, d)
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert_matches_torch_rotary(x, w, b, r, q, k_rot, v)
    # Too many rows for the kernel: None.
    big = torch.zeros((33, k), dtype=DTYPE, device=DEVICE)
    assert rotary_skinny(big, w, b, r) is None


def assert_same_or_a_rounding_step(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Equal on the CPU; on the GPU equal or apart by bf16 rounding: the fused kernel's
    product rounds a few elements the other way (its tile holds other rows, and the
    compiler may pick another tensor-core instruction), and RoPE's sum of two rounded
    products carries such a step into results far smaller than its inputs. The differing
    elements are named in the failure."""
    if torch.equal(got, want):
        return
    diff = (got.float() - want.float()).abs()
    detail = f"{what}: {int((diff > 0).sum())} of {diff.numel()} elements differ, max {diff.max().item():.3g}"
    assert CUDA and rel(got, want) < 2**-7, detail


# (heads, kv_heads, head_dim, K, bias) of the qkv projections of the supported models.
QKV_MODELS = {
    "llama2-7b": (32, 32, 128, 4096, False),
    "llama3-8b": (32, 8, 128, 4096, False),
    "qwen2-7b": (28, 4, 128, 3584, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(QKV_MODELS))
def test_rotary_epilogue_on_gpu_is_the_separate_kernels(model):
    """The qkv projection with RoPE and the KV write in its epilogue, for M in {1, 2, 7, 8,
    16, 32} with padding slots: through the kernel (the rule's config)
    the plain product then `triton_ops.rotary_write_kv` (see `assert_same_or_a_rounding_step`),
    caches included;
    through the dispatch the bits of `linear` then that kernel; with split K close to the
    torch reference."""
    from hybridd.kernels import triton_ops

    heads, kv_heads, d, k, bias = QKV_MODELS[model]
    n = (heads + 2 * kv_heads) * d
    x_full, w, b, r_full = rotary_case(32, heads, kv_heads, d, k, bias, seed=n + k, padded=(3, 30))
    for m in (1, 2, 7, 8, 16, 32):
        x = x_full[:m]
        r = with_fresh_caches(r_full)
        config = triton_gemm.config_of(m, w)
        q, k_rot, v = r.split_qkv(triton_gemm.launch(x, w, b, config, rotary=r))
        sep = with_fresh_caches(r)
        sq, sk, sv = sep.split_qkv(triton_gemm.launch(x, w, b, config))
        sq, sk = triton_ops.rotary_write_kv(sep.positions[:m], sq, sk, sv, sep.k_cache, sep.v_cache,
                                            sep.slot_mapping[:m], sep.cos, sep.sin)
        for name, got, want in (("q", q, sq), ("k", k_rot, sk), ("v", v, sv), ("k cache", r.k_cache, sep.k_cache),
                                ("v cache", r.v_cache, sep.v_cache)):
            assert_same_or_a_rounding_step(got, want, (m, name))

        ref = with_fresh_caches(r)
        rq, rk, rv = ref.split_qkv(F.linear(x, w, b))
        rq, rk = ref_ops.rotary_write_kv(ref.positions[:m], rq, rk, rv, ref.k_cache, ref.v_cache,
                                         ref.slot_mapping[:m], ref.cos, ref.sin)
        assert rel(q, rq) < 2 * TOL and rel(k_rot, rk) < 2 * TOL and rel(v, rv) < TOL, m

        split = with_fresh_caches(r)
        out = triton_gemm.launch(x, w, b, GemmConfig(64, 128, split_k=3), rotary=split)
        assert out is not None, m
        pq, pk, pv = split.split_qkv(out)
        assert rel(pq, rq) < 2 * TOL and rel(pk, rk) < 2 * TOL and rel(pv, rv) < TOL, m
        real = split.slot_mapping[:m] >= 0
        flat_k = split.k_cache.view(-1, kv_heads, d)
        assert torch.equal(flat_k[split.slot_mapping[:m][real]], pk[real]), m

        disp = with_fresh_caches(r)
        fq, fk, fv = rotary_skinny(x, w, b, disp)
        assert torch.equal(fq, q) and torch.equal(fk, k_rot) and torch.equal(fv, v), m
        assert torch.equal(disp.k_cache, r.k_cache) and torch.equal(disp.v_cache, r.v_cache), m


@pytest.mark.gpu
def test_rotary_epilogue_captures_after_one_eager_call():
    """One eager call at one row compiles every variant the table can pick, and the call
    captured at 32 rows then replays with new inputs, positions and slots as eager does."""
    heads, kv_heads, d, k, _ = QKV_MODELS["llama3-8b"]
    x, w, b, r = rotary_case(32, heads, kv_heads, d, k, True, seed=29, padded=(7,))  # a bias: fresh kernels

    def call(rows: int, rr):
        return rotary_skinny(x[:rows], w, b, rr)

    assert call(1, with_fresh_caches(r)) is not None
    torch.cuda.synchronize()
    kernels = triton_gemm._skinny_gemm_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k_rot, v = call(32, r)
    assert len(kernels) == compiled
    for seed in range(3):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        x.copy_(torch.randn(x.shape, dtype=DTYPE, device=DEVICE, generator=g))
        r.positions.copy_(torch.randperm(ROPE_POSITIONS, device=DEVICE, generator=g)[:32])
        slots = torch.randperm(r.k_cache.shape[0] * r.k_cache.shape[1], device=DEVICE, generator=g)[:32]
        slots[seed] = -1
        r.slot_mapping.copy_(slots)
        r.k_cache.fill_(SENTINEL)
        r.v_cache.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        eager = with_fresh_caches(r)
        eq, ek, ev = call(32, eager)
        assert torch.equal(q, eq) and torch.equal(k_rot, ek) and torch.equal(v, ev)
        assert torch.equal(r.k_cache, eager.k_cache) and torch.equal(r.v_cache, eager.v_cache)
