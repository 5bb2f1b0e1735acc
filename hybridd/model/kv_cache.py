"""The paged KV cache: one contiguous arena `[layers, 2, blocks + 1, block_size, kv_heads, head_dim]`.

The extra last block is scratch: writes for padded rows (slot -1) are redirected
there by the torch path, so no real block is ever touched by padding. The block
manager hands out blocks `0 .. num_blocks - 1` only.

A sequence's token at position p lives in slot `block_table[p // block_size] *
block_size + p % block_size`: `slot` is that formula, for one position or a tensor of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from hybridd.model.config import ModelConfig

Position = TypeVar("Position", int, torch.Tensor)


def slot(block_table: Sequence[int] | torch.Tensor, position: Position, block_size: int) -> Position:
    """The KV slot of the token at `position` (an int, or a tensor with a tensor table)."""
    return block_table[position // block_size] * block_size + position % block_size


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def copy_blocks(arena: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks (source, destination) of the KV arena, in every layer, keys and
    values (forked sequences' copies of a prompt's partly filled last block)."""
    indices = torch.tensor(copies, dtype=torch.int64).T.contiguous()
    if arena.is_cuda:  # a pageable host-to-device copy would synchronize the stream
        indices = indices.pin_memory().to(arena.device, non_blocking=True)
    src, dst = indices
    arena.index_copy_(2, dst, arena.index_select(2, src))


def kv_arena_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, 2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.finfo(dtype).bits // 8
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


class KVCache:
    """A view of the KV arena with the geometry the attention code needs."""

    def __init__(self, arena: torch.Tensor, block_size: int):
        if arena.dim() != 6 or arena.shape[1] != 2 or arena.shape[3] != block_size:
            raise ValueError(f"KV arena has shape {tuple(arena.shape)}, expected [L, 2, blocks+1, {block_size}, H, D]")
        self.arena = arena
        self.block_size = block_size
        self.num_blocks = arena.shape[2] - 1
        self.scratch_slot = self.num_blocks * block_size

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        arena = torch.zeros(kv_arena_shape(config, num_blocks, block_size), dtype=dtype, device=device)
        return cls(arena, block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value caches of one layer, each [blocks + 1, block_size, kv_heads, head_dim]."""
        return self.arena[index, 0], self.arena[index, 1]
