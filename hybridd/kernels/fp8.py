"""FP8 weights as the kernels take them, and their numerics in plain torch: the CPU path
and the reference for the GPU's FP8 GEMMs.

A weight is FP8 E4M3 (`torch.float8_e4m3fn`) [N, K] with one float32 scale per output
channel (row), `w ≈ fp8 * scale[:, None]`. The activations are the model's dtype, or
quantized to FP8 too where a checkpoint says so: per token (each row its own scale,
computed from the row) or with the checkpoint's static scale. The torch path dequantizes
and computes in float32, then rounds the product to the activation dtype, so that a
kernel that converts FP8 in registers and accumulates in float32 gives the same numbers
up to the order of its sums.

On the GPU, a product of more than DECODE_ROWS rows (a prefill) quantizes its activations
per token even where the scheme leaves them in the model dtype: it is an FP8 × FP8 product
on the tensor cores (`triton_fp8.prefill_scaled_mm`), the only FP8 prefill that ran faster
than bf16's; the weight converted in registers against bf16 activations ran at 0.4-0.5 ×
bf16's rate at 512-2,048 rows (docs/lab/benchmarks.md, "FP8 weights on the H100").
`product` is the GPU kernels' numerics for a row count, the reference their tests hold
them to. The torch path computes every product with the scheme's own numerics
(`linear`): its results then do not depend on how many rows a step packs, so that a
sequence's tokens are the same alone and batched, and transformers' model with the same
weights is its reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Where the activations are quantized: nowhere (FP8 weights × model-dtype activations), per
# token, or with a static scale per tensor.
ACTIVATIONS = ("none", "dynamic", "static")
# The most rows of a product whose activations stay as the scheme says (decode: the skinny
# GEMM, `triton_gemm.MAX_ROWS`); more rows are a prefill, quantized per token.
DECODE_ROWS = 32


class Fp8Weight(NamedTuple):
    """A projection's FP8 weight [N, K], its float32 scales [N], and how its input is
    quantized (`activations`; `input_scale` [parts], float32, the static scales of the
    projections fused into it, of which the largest applies)."""

    weight: torch.Tensor
    scale: torch.Tensor
    activations: str = "none"
    input_scale: torch.Tensor | None = None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale per row): scale = amax(|row|) / 448, the row divided by it
    and rounded to nearest. An all-zero row gets scale 1 (any scale represents it)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(weight: Fp8Weight) -> torch.Tensor:
    """The weight in float32, [N, K]."""
    return weight.weight.float() * weight.scale[:, None]


def quantize_activations(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [T, K] in float32, rounded through FP8 where `weight.activations` says so."""
    x32 = x.float()
    if weight.activations == "none":
        return x32
    if weight.activations == "dynamic":
        amax = x32.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    else:
        scale = weight.input_scale.max()
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def dynamic(weight: Fp8Weight) -> Fp8Weight:
    """The weight as a prefill takes it: activations quantized per token, unless the
    checkpoint states how."""
    return weight if weight.activations != "none" else weight._replace(activations="dynamic")


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) in float32 over the dequantized weight, rounded to x's dtype."""
    out = F.linear(quantize_activations(x, weight), dequantize(weight), None if bias is None else bias.float())
    return out.to(x.dtype)


def product(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with the numerics the GPU's kernels give x's row count: up to DECODE_ROWS
    rows with the weight's scheme, more with the activations per token (`dynamic`)."""
    return linear(x, weight if x.shape[0] <= DECODE_ROWS else dynamic(weight), bias)
