"""The FP8 KV cache's numbers: each head vector of a key or value stored as float8 E4M3
with one float32 scale, the vector's absmax / 448 (float8 E4M3's largest finite value), so
its largest element maps to FP8's largest and no calibration is needed; outlier channels
of one head raise that head's scale only. `quantize_heads` is the reference every writer
of an FP8 cache rounds as (the Triton KV writes do the same arithmetic)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] as FP8 E4M3 with one float32 scale per head vector (its absmax / 448; an
    all-zero head gets scale 1): (values [..., d], scales [...])."""
    x32 = x.float()
    absmax = x32.abs().amax(dim=-1)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (x32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_heads(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """float32 head vectors [..., d] from a cache's values and their scales [...] (None: not quantized)."""
    return values.float() if scales is None else values.float() * scales[..., None]
