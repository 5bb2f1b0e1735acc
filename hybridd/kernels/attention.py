"""Paged attention in plain torch: the KV write by slot mapping, prefill attention over
several packed sequences, and decode attention over block tables.

This is the CPU path and the reference for the GPU kernels. Every bound is read from
device tensors and every shape is fixed by the step's bucket, so it is graph-safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the step's tensors are read by attribute; the model owns their type
    from hybridd.model.step_inputs import StepInputs



def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, kv_heads, d] at their slots; slot -1 lands in the scratch block."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    scratch = flat_k.shape[0] - 1
    slots = torch.where(slot_mapping >= 0, slot_mapping, scratch).long()
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)


def prefill_mask(step: StepInputs, num_tokens: int, sliding_window: int | None = None) -> torch.Tensor:
    """[T, T] bool: which keys each query of the packed step sees — the same sequence,
    at a position not after its own (and within `sliding_window` W: itself and the W - 1
    tokens before it). The Triton prefill kernel applies this rule tile by tile.

    Tokens after the last sequence (bucket padding) form one extra sequence of their
    own, so no row is fully masked and no NaN appears."""
    token_index = torch.arange(num_tokens, device=step.positions.device, dtype=step.query_start_loc.dtype)
    seq_of_token = torch.searchsorted(step.query_start_loc[1:], token_index, right=True)
    same_seq = seq_of_token[:, None] == seq_of_token[None, :]
    causal = step.positions[None, :] <= step.positions[:, None]
    mask = same_seq & causal
    if sliding_window is not None:
        mask &= step.positions[:, None] - step.positions[None, :] < sliding_window
    return mask


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence (`prefill_mask`). q [T, H, d],
    k/v [T, KVH, d] -> [T, H, d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=prefill_mask(step, q.shape[0], sliding_window),
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context (its last `sliding_window` tokens
    when given). q [B, H, d] -> [B, H, d]."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    block_size = k_cache.shape[1]
    width = block_tables.shape[1] * block_size
    keys = k_cache[block_tables].reshape(b, width, kvh, d)
    values = v_cache[block_tables].reshape(b, width, kvh, d)
    qg = q.view(b, kvh, h // kvh, d)
    scores = torch.einsum("bkgd,bskd->bkgs", qg.float(), keys.float()) * scale
    key_index = torch.arange(width, device=q.device)[None, :]
    valid = key_index < seq_lens[:, None]
    if sliding_window is not None:
        valid &= key_index >= seq_lens[:, None] - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgs,bskd->bkgd", probs, values.float())
    return out.reshape(b, h, d).to(q.dtype)
