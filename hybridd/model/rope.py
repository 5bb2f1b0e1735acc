"""Rotary position embeddings: inverse frequencies (default, linear, Llama 3 and YaRN scaling) and the
cos/sin table that the forward indexes with device-resident positions (the operands of a
layer's RoPE kernel are `hybridd.kernels.rotary.RotaryArgs`)."""

from __future__ import annotations

import math
import torch

from hybridd.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """On the CPU (explicitly: a model is built under the meta device)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim, inv_freq)
    return inv_freq


def _yarn_inverse_frequencies(rope: RopeConfig, head_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Extrapolated (unscaled) frequencies for the dimensions that turn more than
    `beta_fast` times over the pre-training length, interpolated (divided by the factor)
    below `beta_slow` turns, and a linear ramp between; as transformers computes them."""

    def dimension(turns: float) -> float:
        return head_dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (inv_freq / rope.factor) * (1 - extrapolated) + inv_freq * extrapolated


def cos_sin_table(
    rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 cos and sin, each [max_positions, head_dim], in the rotate-half layout (YaRN's
    attention factor folded into both)."""
    inv_freq = inverse_frequencies(rope, head_dim).to(device)
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if rope.attention_factor != 1.0:
        return emb.cos() * rope.attention_factor, emb.sin() * rope.attention_factor
    return emb.cos(), emb.sin()
