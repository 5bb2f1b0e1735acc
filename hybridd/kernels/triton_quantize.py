"""FP8 activations on the GPU: each token's row quantized to FP8 E4M3 with a scale of its
own (or the checkpoint's static scale), rounded as `hybridd.kernels.fp8.quantize_activations`
rounds, bit for bit. The FP8 × FP8 prefill (`triton_fp8`) and the skinny GEMM of a
checkpoint that quantizes its activations (`triton_gemm`) take its output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridd.kernels import pdl
from hybridd.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Weight
from hybridd.kernels.pdl import wait_for_predecessor


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest FP8 E4M3 value, ties to even, still in
    float32: the conversion after it is then exact. Done by hand because Triton's CPU
    interpreter rounds wrongly where the mantissa carries into the exponent (124.3 to 64);
    the GPU's conversion rounds as this does. E4M3 keeps 3 mantissa bits, and below its
    smallest normal exponent (-6) steps of 2^-9."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    per_step = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    # Adding and taking away 1.5 * 2^23 rounds a float32 below 2^22 to an integer, ties to even.
    return ((v * per_step + 12582912.0) - 12582912.0) * step


@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, n_cols, n_static, stride_x,
                            STATIC: tl.constexpr, BLOCK: tl.constexpr, STATIC_PAD: tl.constexpr,
                            FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    """One row: scale = amax(|row|) / FP8_MAX (1 for an all-zero row), or the largest of
    the static scales; the row divided by it, clamped and rounded to nearest FP8."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        j = tl.arange(0, STATIC_PAD)
        scale = tl.max(tl.load(static_ptr + j, mask=j < n_static, other=0.0), axis=0)
    else:
        amax = tl.max(tl.abs(x), axis=0)
        # IEEE division, as torch divides (Triton's `/` is the fast approximate one on the GPU).
        scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
    tl.store(q_ptr + row * n_cols + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_tokens(x: torch.Tensor, weight: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] in FP8, float32 scales [M]) as `fp8.quantize_activations` rounds them:
    per token, or with the weight's static scale where its activations are "static"."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    static = weight.activations == "static"
    if static and weight.input_scale is None:
        raise ValueError("an FP8 weight with static activation scales needs its input_scale")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m:
        parts = weight.input_scale if static else scales
        _quantize_tokens_kernel[(m,)](
            x, q, scales, parts, k, parts.numel(), x.stride(0), STATIC=static, BLOCK=triton.next_power_of_2(k),
            STATIC_PAD=triton.next_power_of_2(max(parts.numel(), 1)), FP8_MAX=FP8_MAX,
            num_warps=8 if k >= 4096 else 4, **pdl.launch_args(x.device),
        )
    return q, scales
