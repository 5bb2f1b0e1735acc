"""FP8-weight projections on the GPU: which kernel takes a product of how many rows, and
the two prefill candidates.

- Up to `triton_gemm.MAX_ROWS` rows (decode): the skinny GEMM with the FP8 weight
  converted in registers and the scales in its epilogue (`hybridd/kernels/triton_gemm.py`;
  its form and tiles per shape and row count from `triton_gemm.fp8_rule_config`);
  bound by reading the FP8 bytes.
- More rows (prefill): FP8 × FP8 on the tensor cores, `torch._scaled_mm` with rowwise
  scales (`prefill_scaled_mm`): each token's activations are quantized to FP8 with a
  scale of their own (`triton_quantize.quantize_tokens`), each output channel has the
  weight's. The activations are rounded to FP8 here even where the checkpoint leaves
  them in the model dtype (`fp8.product`'s numerics): the weight converted in registers
  against bf16 activations, the other candidate measured, ran at 0.4-0.5 × bf16's rate
  at 512-2,048 rows and was dropped as a choice (docs/lab/benchmarks.md, "FP8 weights on
  the H100").

Products `torch._scaled_mm` does not take (N or K not multiples of 16, an fp16 output on
CUDA) run the same numerics on the Triton kernel (`prefill_dequant`): quantized
activations, FP8 products, the same scales.
"""

from __future__ import annotations

import torch
import triton

from hybridd.kernels import pdl, triton_gemm
from hybridd.kernels.fp8 import Fp8Weight, dynamic
from hybridd.kernels.launch_variants import first_eager_call
from hybridd.kernels.triton_gemm import GemmConfig
from hybridd.kernels.triton_quantize import quantize_tokens

# The `dequant` prefill GEMM's columns per step: each stage of a 128 x 128 tile holds
# 16 KiB of FP8 weight and 32 KiB of bf16 activations, three stages deep.
_PREFILL_BLOCK_K = 128


def prefill_configs() -> list[GemmConfig]:
    """Every config `prefill_config` may pick: compiled together on a weight's first eager call."""
    return [_prefill_config(block_m, block_n) for block_m in (64, 128) for block_n in (64, 128)]


def _prefill_config(block_m: int, block_n: int) -> GemmConfig:
    return GemmConfig(block_n, _PREFILL_BLOCK_K, 1, 8 if block_m * block_n >= 128 * 128 else 4, 3,
                      block_m=block_m, tile_m=True)


def prefill_config(m: int, n: int, multiprocessors: int) -> GemmConfig:
    """The `dequant` GEMM's tiles for m rows: 128 x 128 where they fill the GPU, else
    halved (rows first) until they do or reach 64 x 64."""
    block_m, block_n = 128, 128
    for _ in range(2):
        if triton.cdiv(m, block_m) * triton.cdiv(n, block_n) >= multiprocessors:
            break
        if block_m > 64:
            block_m = 64
        else:
            block_n = 64
    return _prefill_config(block_m, block_n)


def prefill_dequant(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                    config: GemmConfig | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for any row count: the FP8 weight converted in registers, the
    activations in the model dtype (or quantized, where the weight says so)."""
    w = weight.weight
    mps = triton_gemm._multiprocessors(w.device)
    if config is None:
        config = prefill_config(x.shape[0], w.shape[0], mps)
        if x.is_cuda:
            _compile_prefill_variants(x, weight, bias)
    if x.shape[0] == 0:
        return torch.empty((0, w.shape[0]), dtype=x.dtype, device=x.device)
    y = triton_gemm.launch(x, weight, bias, config)
    if y is None:
        raise ValueError(f"the FP8 prefill GEMM cannot take x {tuple(x.shape)} with a weight of strides "
                         f"{w.stride()} (it needs W [N, K] row-major)")
    return y


def _compile_prefill_variants(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> None:
    """Launch every config `prefill_config` may pick for this weight once, on its first
    eager call (the graph runner warms prefill up at one size only, `launch_variants`)."""
    w = weight.weight
    key = ("fp8_prefill", tuple(w.shape), x.dtype, x.device, bias is not None, weight.activations,
           pdl.enabled(x.device))
    if not first_eager_call(key, x.device):
        return
    rows = torch.zeros((128, w.shape[1]), dtype=x.dtype, device=x.device)
    for config in prefill_configs():
        triton_gemm.launch(rows[:config.block_m], weight, bias, config)


def _scaled_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes the product with rowwise scales: N and K multiples
    of 16, W row-major, and (on CUDA) a bf16 output, the only one it has for rowwise."""
    n, k = w.shape
    return k % 16 == 0 and n % 16 == 0 and w.stride() == (k, 1) and (x.dtype == torch.bfloat16 or not x.is_cuda)


def prefill_scaled_mm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) as FP8 × FP8: x quantized per token (`quantize_tokens`), then
    `torch._scaled_mm` with each row's scale and each output channel's, out in x's dtype.
    The numerics of `fp8.linear(x, dynamic(weight), bias)`."""
    weight = dynamic(weight)
    w = weight.weight
    if not _scaled_mm_fits(x, w) or x.shape[0] == 0:
        return prefill_dequant(x, weight, bias)
    q, scales = quantize_tokens(x, weight)
    y = torch._scaled_mm(q, w.t(), scale_a=scales[:, None], scale_b=weight.scale[None, :], out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for an FP8 weight: the skinny kernel up to MAX_ROWS rows,
    else `prefill_scaled_mm`."""
    y = triton_gemm.skinny(x, weight, bias)
    return prefill_scaled_mm(x, weight, bias) if y is None else y
