"""The operands of one layer's RoPE with its KV-cache write, as every kernel set takes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class RotaryArgs:
    """The operands of one layer's RoPE and KV-cache write after its fused qkv projection
    (W [q_size + 2 kv_size, K], heads of `head_dim` rows stacked q, k, v): each token row
    m is rotated at `positions[m]` with the float32 `cos`/`sin` tables [max_positions,
    head_dim], and its rotated k and its v go to the paged caches at `slot_mapping[m]`
    (-1: nowhere), laid out as `triton_ops.rotary_write_kv` stores them. `qk_norm`, where
    the model has one (Qwen3), is (q's weight [d], k's weight [d], eps): an RMSNorm over each
    head of q and of k before the rotation. With an FP8 cache, `k_scale` and `v_scale`
[blocks + 1, page, kv_heads] take each stored head vector's scale."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of a KV write that an FP8 cache adds (none otherwise)."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, d], k and v [T, KVH, d]: views of a fused qkv projection's output [T, q + 2 kv]."""
        t, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        return q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
