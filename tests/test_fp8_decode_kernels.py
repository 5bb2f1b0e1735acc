"""The FP8 decode kernels the skinny GEMM can run (`GemmConfig.kernel`: the tensor-core
forms dot, dot_f16, dot_f16_t and the CUDA-core fma) against the emulated
numerics (`hybridd.kernels.fp8.linear`), with every epilogue the FP8 path uses; the
measured table `config_for` takes FP8 configs from; the E4M3 conversions the kernels
rely on, on every code. On the CPU through Triton's interpreter in float32 on small
odd shapes; compiled for Hopper where the slow tests run."""

from __future__ import annotations

import pytest
import torch

from hybridd.kernels import fp8
from hybridd.kernels import ops as ref_ops
from tests.triton_target import CUDA, DEVICE, DTYPE, rel, require_triton

require_triton()

from hybridd.kernels import fp8_decode_table, launch_variants, triton_gemm, triton_ops  # noqa: E402
from hybridd.kernels.rotary import RotaryArgs  # noqa: E402
from hybridd.kernels.triton_gemm import FoldedNorm, GemmConfig  # noqa: E402

TOL = 1e-2 if CUDA else 1e-5
# The kernels that round the activations to float16 (their reference rounds them too).
F16 = ("dot_f16", "dot_f16_t")
NEW_KERNELS = ("dot_f16", "dot_f16_t", "fma")


def fp8_operands(m: int, n: int, k: int, bias: bool, seed: int, activations: str = "none"):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, dtype=DTYPE, device=DEVICE, generator=g)
    w = torch.randn(n, k, dtype=torch.float32, device=DEVICE, generator=g) * 0.05
    b = torch.randn(n, dtype=DTYPE, device=DEVICE, generator=g) if bias else None
    return x, fp8.Fp8Weight(*fp8.quantize_rows(w), activations), b


def as_kernel_reads(x: torch.Tensor, kernel: str) -> torch.Tensor:
    """x as `kernel` multiplies it: scaled by 2^-4, rounded to float16 and scaled back by
    the float16 forms."""
    return ((x.float() * 2.0**-4).to(torch.float16).float() * 16).to(x.dtype) if kernel in F16 else x


# ---------------------------------------------------------------- E4M3 conversions, every code


def e4m3_codes() -> torch.Tensor:
    """All 256 E4M3 bit patterns but the two NaNs (S.1111.111), as uint8."""
    codes = torch.arange(256, dtype=torch.int32)
    return codes[(codes & 0x7F) != 0x7F].to(torch.uint8)


def test_e4m3_converts_exactly_to_float16_and_bfloat16():
    """Every finite E4M3 value (the subnormals included) is a float16 and a bfloat16:
    what the float16 kernels feed the tensor cores and the fma kernel converts through."""
    exact = e4m3_codes().view(fp8.FP8_DTYPE).double()
    values = e4m3_codes().view(fp8.FP8_DTYPE)
    assert torch.equal(values.to(torch.float16).double(), exact)
    assert torch.equal(values.to(torch.bfloat16).double(), exact)
    assert exact.abs().max() == 448 and exact[exact > 0].min() == 2.0**-9


@pytest.mark.parametrize(("target", "shift", "exponent"), [(torch.float16, 7, 8), (torch.bfloat16, 4, 120)])
def test_e4m3_bits_shifted_into_a_16_bit_float_are_the_value_times_a_power_of_two(target, shift, exponent):
    """The shift trick: E4M3's exponent and mantissa bits shifted into a float16's (<< 7)
    or a bfloat16's (<< 4) exponent-mantissa field, the sign to bit 15, are the E4M3
    value times 2^-(15 - 7) or 2^-(127 - 7), exactly, subnormals included (they land on
    the target's subnormals). The kernels do not use it: sm89+ converts E4M3 pairs to
    float16 in one instruction (cvt.rn.f16x2.e4m3x2), fewer than the shifts and masks,
    and the bfloat16 form's 2^-120 would put the products in float32's subnormal range."""
    codes = e4m3_codes().to(torch.int32)
    bits = ((codes & 0x7F) << shift) | ((codes & 0x80) << 8)
    shifted = bits.to(torch.int16).view(target).double() * 2.0**exponent
    assert torch.equal(shifted, e4m3_codes().view(fp8.FP8_DTYPE).double())


# ---------------------------------------------------------------- the kernels against the emulated product


@pytest.mark.parametrize("kernel", NEW_KERNELS)
@pytest.mark.parametrize(
    ("m", "n", "k", "split", "bias", "activations"),
    [
        (1, 48, 96, 1, False, "none"),     # one row
        (3, 50, 200, 3, True, "none"),     # N, K not multiples of the tiles, uneven split, bias
        (8, 33, 130, 2, False, "none"),    # the CUDA-core kernel's most rows, a split past K
        (32, 64, 256, 4, True, "none"),    # the most rows (BLOCK_M 32), even split
        (3, 40, 100, 1, True, "dynamic"),  # activations per token (an FP8 checkpoint)
    ],
)
def test_decode_kernel_equals_the_emulated_product(kernel, m, n, k, split, bias, activations):
    x, w, b = fp8_operands(m, n, k, bias, seed=m * 1000 + n + k, activations=activations)
    out = triton_gemm.launch(x, w, b, GemmConfig(16, 32, split, kernel=kernel))
    if kernel == "fma" and m > triton_gemm.FMA_ROWS:
        assert out is None  # more rows than the CUDA-core kernel takes: the caller falls back
        return
    assert out is not None and out.shape == (m, n) and out.dtype == DTYPE
    reads = x if activations != "none" else as_kernel_reads(x, kernel)  # FP8 activations are exact in float16
    assert rel(out, fp8.linear(reads, w, b)) < TOL


@pytest.mark.parametrize("kernel", F16)
@pytest.mark.parametrize("m", [1, 5])
def test_float16_forms_take_activations_past_float16s_range(kernel, m):
    """A down projection's input may pass 65504 (massive activations), where a plain
    float16 rounding is infinite: the float16 forms scale the activations by 2^-4 first,
    so activations up to 2^20 give the exact form's product (E4M3 weights and bf16
    activations are both float16 values once scaled)."""
    x, w, b = fp8_operands(m, 40, 96, True, seed=m)
    x = x * 1e5
    x[:, 0] = 2.0**20 - 2.0**12  # the largest magnitude kept, near 2^20
    x[:, 1] = 3e-4  # and a small one, still exact
    x = x.to(DTYPE)
    assert x.float().abs().max() > 65504
    out = triton_gemm.launch(x, w, b, GemmConfig(16, 32, 1, kernel=kernel))
    assert torch.isfinite(out.float()).all()
    reads = as_kernel_reads(x, kernel)
    if DTYPE == torch.bfloat16:
        assert torch.equal(reads, x)  # bf16 activations are float16 values once scaled
    assert rel(out, fp8.linear(reads, w, b)) < TOL


@pytest.mark.parametrize(("m", "n", "k", "split", "block_k"), [(1, 48, 96, 1, 32), (3, 50, 200, 3, 32),
                                                               (8, 33, 130, 2, 64), (2, 40, 64, 1, 64)])
def test_fma_with_its_weight_loaded_a_step_ahead_equals_the_emulated_product(m, n, k, split, block_k):
    """Two stages: each step's FP8 tile is loaded during the step before (the last of a
    split loads nothing past it)."""
    x, w, b = fp8_operands(m, n, k, True, seed=m + n + k)
    out = triton_gemm.launch(x, w, b, GemmConfig(16, block_k, split, 4, 2, kernel="fma"))
    assert rel(out, fp8.linear(x, w, b)) < TOL


@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_fma_tile_is_the_rows_power_of_two(m):
    """The CUDA-core kernel pads no rows to 16: its tile holds m's power of two."""
    config = GemmConfig(16, 32, kernel="fma")
    assert triton_gemm.block_m_of(config, m) == {1: 1, 2: 2, 5: 8, 8: 8}[m]
    assert triton_gemm.block_m_of(GemmConfig(16, 32), m) == 16


@pytest.mark.parametrize("kernel", NEW_KERNELS)
@pytest.mark.parametrize(("m", "k", "parts", "split"), [(1, 96, 6, 1), (5, 200, 13, 3)])
def test_decode_kernel_applies_the_norm_to_its_activations(kernel, m, k, parts, split):
    """rms_norm(x, g) @ W.T with the norm applied as the activations load (FP8 weights
    cannot hold the norm's weight), from the rows' sums of squares in parts."""
    x, w, _ = fp8_operands(m, 48, k, False, seed=m + k)
    g = 0.5 + torch.rand(k, generator=torch.Generator(device=DEVICE).manual_seed(k), device=DEVICE).to(DTYPE)
    squares = x.float().pow(2)
    cuts = torch.linspace(0, k, parts + 1).long()
    sums = torch.stack([squares[:, a:c].sum(1) for a, c in zip(cuts[:-1], cuts[1:])], dim=1).contiguous()
    out = triton_gemm.launch(x, w, None, GemmConfig(16, 32, split, kernel=kernel), norm=FoldedNorm(1e-5, sums, g))
    normed = as_kernel_reads(ref_ops.rms_norm(x, g, 1e-5), kernel)
    assert rel(out, fp8.linear(normed, w)) < TOL


@pytest.mark.parametrize("kernel", NEW_KERNELS)
@pytest.mark.parametrize(("m", "n", "k", "split"), [(1, 48, 96, 1), (5, 50, 200, 3)])
def test_decode_kernel_adds_to_the_stream(kernel, m, n, k, split):
    x, w, b = fp8_operands(m, n, k, True, seed=m * 7 + n)
    residual = torch.randn(m, n, dtype=DTYPE, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(m))
    summed, parts = triton_gemm.launch(x, w, b, GemmConfig(16, 32, split, kernel=kernel), residual=residual)
    assert rel(summed, residual + fp8.linear(as_kernel_reads(x, kernel), w, b)) < TOL
    assert rel(parts.sum(1), summed.float().pow(2).sum(1)) < 1e-5


@pytest.mark.parametrize("kernel", NEW_KERNELS)
@pytest.mark.parametrize(("m", "split", "padded"), [(1, 1, ()), (3, 2, (1,))])
def test_decode_kernel_rotary_epilogue_is_its_product_then_rotary_write_kv(kernel, m, split, padded):
    """A fused FP8 qkv projection with RoPE and the KV write in the epilogue: what the
    same kernel's plain product, then `triton_ops.rotary_write_kv`, gives (q, k, v and
    both caches; padded rows leave the caches alone)."""
    from hybridd.model.config import RopeConfig
    from hybridd.model.rope import cos_sin_table

    heads, kv_heads, d, k = 4, 2, 16, 72
    x, w, b = fp8_operands(m, (heads + 2 * kv_heads) * d, k, True, seed=m + split)
    g = torch.Generator(device=DEVICE).manual_seed(m)
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), d, 64, torch.device(DEVICE))
    slots = torch.randperm(48, device=DEVICE, generator=g)[:m]
    slots[list(padded)] = -1

    def rotary():
        cache = torch.full((13, 4, kv_heads, d), -1234.0, dtype=DTYPE, device=DEVICE)
        return RotaryArgs(heads, kv_heads, d, torch.arange(m, device=DEVICE) * 5, slots, cache, cache.clone(), cos,
                          sin)

    config = GemmConfig(16, 32, split, kernel=kernel)
    fused = rotary()
    q, k_rot, v = fused.split_qkv(triton_gemm.launch(x, w, b, config, rotary=fused))
    sep = rotary()
    sq, sk, sv = sep.split_qkv(triton_gemm.launch(x, w, b, config))
    sq, sk = triton_ops.rotary_write_kv(sep.positions, sq, sk, sv, sep.k_cache, sep.v_cache, sep.slot_mapping,
                                        sep.cos, sep.sin)
    for got, want in ((q, sq), (k_rot, sk), (v, sv), (fused.k_cache, sep.k_cache), (fused.v_cache, sep.v_cache)):
        assert rel(got, want) < (TOL if CUDA else 1e-6)


def test_other_kernels_take_fp8_weights_only():
    x = torch.randn(2, 64, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="the fma kernel multiplies FP8 weights only"):
        triton_gemm.launch(x, torch.randn(32, 64, dtype=DTYPE, device=DEVICE), None, GemmConfig(16, 32, kernel="fma"))
    with pytest.raises(ValueError, match="kernel must be one of dot, dot_f16, fma, dot_f16_t, got 'mma'"):
        GemmConfig(16, 32, kernel="mma")
    with pytest.raises(ValueError, match="the dot_f16 kernel takes decode's rows only"):
        GemmConfig(16, 32, block_m=16, tile_m=True, kernel="dot_f16")


# ---------------------------------------------------------------- the measured table


def test_an_empty_table_leaves_the_rule():
    """Until the GPU's winners are written in, FP8 configs come from the rule."""
    if fp8_decode_table.WINNERS:
        pytest.skip("the table holds measured winners")
    for m in (1, 4, 17, 32):
        assert triton_gemm.config_for(m, 4096, 4096, 132, 1) == triton_gemm.rule_config(m, 4096, 4096, 132, 1)


def test_fp8_configs_come_from_the_nearest_measured_shape_at_the_next_measured_rows(monkeypatch):
    """An FP8 product takes the winner of the smallest measured row count at least its
    own, of the measured shape nearest its (N, K); above the largest measured row count,
    and for bf16 weights, the rule. One config per row count: fixed per captured bucket."""
    winners = {(4096, 4096, 1): ("fma", 16, 256, 4, 4, 1), (4096, 4096, 4): ("fma", 8, 256, 4, 4, 1),
               (12288, 4096, 4): ("dot_f16_t", 64, 256, 1, 4, 6), (4096, 4096, 16): ("dot_f16", 64, 256, 1, 4, 7)}
    monkeypatch.setattr(fp8_decode_table, "WINNERS", winners)
    assert triton_gemm.config_for(1, 4096, 4096, 132, 1) == GemmConfig(16, 256, 4, 4, 1, kernel="fma")
    assert triton_gemm.config_for(3, 4096, 4096, 132, 1) == GemmConfig(8, 256, 4, 4, 1, kernel="fma")
    assert triton_gemm.config_for(2, 14336, 4096, 132, 1).kernel == "dot_f16_t"  # nearer 12288 than 4096
    assert triton_gemm.config_for(9, 6144, 4096, 132, 1).kernel == "dot_f16"
    assert triton_gemm.config_for(17, 4096, 4096, 132, 1) == triton_gemm.rule_config(17, 4096, 4096, 132, 1)
    assert triton_gemm.config_for(1, 4096, 4096, 132) == triton_gemm.rule_config(1, 4096, 4096, 132)


def test_every_bucket_of_a_table_compiles_before_capture(monkeypatch):
    """The first eager call launches every (config, tile height) the row counts 1-32 give,
    the CUDA-core kernel's four tile heights included, so no capture compiles."""
    winners = {(48, 96, 2): ("fma", 16, 32, 1, 4, 1), (48, 96, 8): ("fma", 16, 32, 2, 4, 1),
               (48, 96, 32): ("dot_f16_t", 16, 32, 1, 4, 2)}
    monkeypatch.setattr(fp8_decode_table, "WINNERS", winners)
    seen = []
    real = triton_gemm.launch
    monkeypatch.setattr(triton_gemm, "launch", lambda x, w, b, c, *a, **kw: seen.append(
        (c.kernel, triton_gemm.block_m_of(c, x.shape[0]))) or real(x, w, b, c, *a, **kw))
    x, w, _ = fp8_operands(2, 48, 96, False, seed=5)
    with launch_variants.forgotten():
        triton_gemm._compile_every_bucket(x, w, None)
    assert sorted(set(seen)) == [("dot_f16_t", 16), ("dot_f16_t", 32), ("fma", 1), ("fma", 2), ("fma", 4),
                                 ("fma", 8)]


# ---------------------------------------------------------------- the GPU: the 7B and 8B shapes


LLAMA_SHAPES = {(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (6144, 4096), (28672, 4096),
                (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", NEW_KERNELS)
@pytest.mark.parametrize("m", [1, 4, 8, 16, 32])
def test_decode_kernels_on_the_llama_shapes(kernel, m):
    """Each form on every Llama-2-7B and Llama-3-8B projection, at the rule's tiles (the
    CUDA-core form at the bench's first config), against the emulated product in bf16."""
    from dataclasses import replace

    mps = triton_gemm._multiprocessors(torch.device(DEVICE))
    for n, k in sorted(LLAMA_SHAPES):
        x, w, _ = fp8_operands(m, n, k, False, seed=m + n + k)
        if kernel == "fma":
            config = GemmConfig(16 if m <= 2 else 8, 256, 2, 4, 2, kernel="fma")
        else:
            config = replace(triton_gemm.rule_config(m, n, k, mps, 1), kernel=kernel)
        out = triton_gemm.launch(x, w, None, config)
        if kernel == "fma" and m > triton_gemm.FMA_ROWS:
            assert out is None
            continue
        assert rel(out, fp8.linear(as_kernel_reads(x, kernel), w)) < TOL, (n, k)


@pytest.mark.gpu
def test_the_tables_configs_replay_in_a_graph_as_they_run_eagerly():
    """Each row count's config (`config_of`: the measured table's, where it has one) on a
    qkv weight with the norm on the activation side, captured after one eager call and
    replayed: the eager result, bit for bit."""
    n, k = 6144, 4096
    _, w, _ = fp8_operands(1, n, k, False, seed=3)
    g = 0.5 + torch.rand(k, device=DEVICE).to(DTYPE)
    for m in (1, 2, 3, 4, 8, 16, 32):
        x = torch.randn(m, k, dtype=DTYPE, device=DEVICE)
        sums = x.float().pow(2).sum(1, keepdim=True).contiguous()
        eager = triton_gemm.skinny(x, w, None, norm=FoldedNorm(1e-5, sums, g))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = triton_gemm.skinny(x, w, None, norm=FoldedNorm(1e-5, sums, g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), m
