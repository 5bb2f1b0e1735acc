"""The paged KV cache: one contiguous arena `[layers, 2, blocks + 1, block_size, kv_heads, head_dim]`.

The extra last block is scratch: writes for padded rows (slot -1) are redirected
there by the torch path, so no real block is ever touched by padding. The block
manager hands out blocks `0 .. num_blocks - 1` only.

A sequence's token at position p lives in slot `block_table[p // block_size] *
block_size + p % block_size`: `slot` is that formula, for one position or a tensor of them.

An FP8 cache (`kv_cache_dtype = "fp8"`) stores keys and values as float8 E4M3 with one
float32 scale per (token, kv head): the head vector's absmax / 448, so a head's largest
element maps to FP8's largest and no calibration is needed. The scales live in a parallel
arena `[layers, 2, blocks + 1, block_size, kv_heads]` indexed like the values; every
writer quantizes (`quantize_heads`), every reader multiplies back, and every block copy
moves both arenas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from hybridd.kernels.kv_quantize import dequantize_heads, is_fp8, quantize_heads
from hybridd.model.config import ModelConfig

__all__ = ["KVCache", "copy_blocks", "dequantize_heads", "quantize_heads"]

Position = TypeVar("Position", int, torch.Tensor)


def slot(block_table: Sequence[int] | torch.Tensor, position: Position, block_size: int) -> Position:
    """The KV slot of the token at `position` (an int, or a tensor with a tensor table)."""
    return block_table[position // block_size] * block_size + position % block_size


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def copy_blocks(arena: torch.Tensor, copies: list[tuple[int, int]], scales: torch.Tensor | None = None) -> None:
    """Copy whole blocks (source, destination) of the KV arena, in every layer, keys and
    values (forked sequences' copies of a prompt's partly filled last block), and of the
    scale arena with an FP8 cache."""
    indices = torch.tensor(copies, dtype=torch.int64).T.contiguous()
    if arena.is_cuda:  # a pageable host-to-device copy would synchronize the stream
        indices = indices.pin_memory().to(arena.device, non_blocking=True)
    src, dst = indices
    for a in (arena,) if scales is None else (arena, scales):
        if is_fp8(a.dtype):  # index_copy_ has no float8 kernel: copy the bytes
            a = a.view(torch.uint8)
        a.index_copy_(2, dst, a.index_select(2, src))


def kv_arena_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, 2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)


def kv_scales_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The scale arena of an FP8 cache: one float32 per (layer, key/value, slot, kv head)."""
    return (config.num_layers, 2, num_blocks + 1, block_size, config.num_kv_heads)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block in every layer, keys and values, with an FP8 cache's scales."""
    elem = torch.finfo(dtype).bits // 8
    per_head = config.head_dim * elem + (4 if is_fp8(dtype) else 0)
    return config.num_layers * 2 * block_size * config.num_kv_heads * per_head


class KVCache:
    """A view of the KV arena (and an FP8 cache's scale arena) with the geometry the
    attention code needs."""

    def __init__(self, arena: torch.Tensor, block_size: int, scales: torch.Tensor | None = None):
        if arena.dim() != 6 or arena.shape[1] != 2 or arena.shape[3] != block_size:
            raise ValueError(f"KV arena has shape {tuple(arena.shape)}, expected [L, 2, blocks+1, {block_size}, H, D]")
        if is_fp8(arena.dtype) != (scales is not None) or (scales is not None and scales.shape != arena.shape[:5]):
            raise ValueError(f"an FP8 KV arena needs a scale arena {tuple(arena.shape[:5])}, and only it has one")
        self.arena = arena
        self.scales = scales
        self.block_size = block_size
        self.num_blocks = arena.shape[2] - 1
        self.scratch_slot = self.num_blocks * block_size

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        arena = torch.zeros(kv_arena_shape(config, num_blocks, block_size), dtype=dtype, device=device)
        scales = None
        if is_fp8(dtype):
            scales = torch.ones(kv_scales_shape(config, num_blocks, block_size), dtype=torch.float32, device=device)
        return cls(arena, block_size, scales)

    @property
    def dtype(self) -> torch.dtype:
        return self.arena.dtype

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value caches of one layer, each [blocks + 1, block_size, kv_heads, head_dim]."""
        return self.arena[index, 0], self.arena[index, 1]

    def layer_scales(self, index: int) -> dict[str, torch.Tensor]:
        """The keyword arguments of one layer's KV writes and attention that an FP8 cache
        adds: `k_scale` and `v_scale` [blocks + 1, block_size, kv_heads]; none otherwise."""
        if self.scales is None:
            return {}
        return {"k_scale": self.scales[index, 0], "v_scale": self.scales[index, 1]}

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_blocks(self.arena, copies, self.scales)
