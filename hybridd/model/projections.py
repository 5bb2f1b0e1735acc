"""The decoder's linear projections as the kernels take them: a weight in the model's
dtype, or an FP8 weight with its scales (`hybridd.kernels.fp8.Fp8Weight`) where the model
is quantized. Each projection hands the kernels its `operand`."""

from __future__ import annotations

import torch
from torch import nn

from hybridd.kernels.fp8 import FP8_DTYPE, Fp8Weight


class Linear(nn.Linear):
    """A projection in the model's dtype."""

    @property
    def operand(self) -> torch.Tensor:
        return self.weight


class Fp8Linear(nn.Module):
    """A projection whose weight [out, in] is FP8 E4M3 with one float32 scale per output
    row (`weight_scale`), its bias (if any) in the model's dtype. Where the checkpoint
    quantizes its input with static scales, `input_scale` holds one per projection fused
    into this one (`parts`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activations: str = "none", parts: int = 1):
        super().__init__()
        self.activations = activations
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.input_scale = (nn.Parameter(torch.empty(parts, dtype=torch.float32), requires_grad=False)
                            if activations == "static" else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @property
    def operand(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.activations, self.input_scale)


def projection(in_features: int, out_features: int, bias: bool, fp8_activations: str | None,
               parts: int = 1) -> Linear | Fp8Linear:
    """A projection in the model's dtype, or FP8 with input activations `fp8_activations`
    ("none", "dynamic", "static"; None: not quantized)."""
    if fp8_activations is None:
        return Linear(in_features, out_features, bias=bias)
    return Fp8Linear(in_features, out_features, bias, fp8_activations, parts)
