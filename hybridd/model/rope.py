"""Rotary position embeddings: inverse frequencies (default, linear, Llama 3 scaling) and the
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
    return inv_freq


def cos_sin_table(
    rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 cos and sin, each [max_positions, head_dim], in the rotate-half layout."""
    inv_freq = inverse_frequencies(rope, head_dim).to(device)
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
