"""Paged attention in plain torch: the KV write by slot mapping, prefill attention of
several packed sequences' rows over their paged context, and decode attention over
block tables.

This is the CPU path and the reference for the GPU kernels. Every bound is read from
device tensors and every shape is fixed by the step's bucket, so it is graph-safe.

With an FP8 cache every function takes the layer's scale caches `k_scale`, `v_scale`
[blocks, page, KVH] (`hybridd/model/kv_cache.py`): the write quantizes each head vector,
the attention reads keys and values back as float32 value times scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hybridd.kernels.kv_quantize import dequantize_heads, quantize_heads

if TYPE_CHECKING:  # the step's tensors are read by attribute; the model owns their type
    from hybridd.model.step_inputs import StepInputs


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v [T, kv_heads, d] at their slots (FP8 with their scales where the cache
    has scales); slot -1 lands in the scratch block."""
    scratch = k_cache.shape[0] * k_cache.shape[1] - 1
    slots = torch.where(slot_mapping >= 0, slot_mapping, scratch).long()
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        if scales is not None:
            x, x_scale = quantize_heads(x)
            scales.view(-1, scales.shape[2]).index_copy_(0, slots, x_scale)
            # index_copy_ has no float8 kernel: the bytes are copied.
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


def _read(cache: torch.Tensor, scales: torch.Tensor | None, index) -> torch.Tensor:
    """float32 head vectors of `cache[index]` (times their scales in an FP8 cache)."""
    return dequantize_heads(cache[index], None if scales is None else scales[index])


# Rows a call of `prefill_attention` gathers keys for at once: each row reads its
# sequence's whole table width, so this bounds the gathered keys' memory.
_ROWS_PER_GATHER = 64


def _blocks_reached(positions: torch.Tensor, block_size: int) -> int:
    """Blocks a table must list to reach the furthest of `positions` (host-side: CPU only)."""
    return int(positions.max()) // block_size + 1 if positions.numel() else 1


def sequence_of_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] the sequence each row of a packed step belongs to; rows past the last
    sequence's end (bucket padding) get the number of sequences, one past the last."""
    rows = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:], rows, right=True)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs, scale: float,
    sliding_window: int | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query row of a packed step over its sequence's paged context: the keys at
    positions up to its own (and within `sliding_window` W: itself and the W - 1 before
    it), read through the sequence's block table. The step's own KV is in the cache
    already (written by slot mapping), so a sequence's rows may start at any position: a
    chunk of a prompt after earlier chunks, or one decode row. q [T, H, d], caches
    [blocks, page, KVH, d] -> [T, H, d]. Padding rows (past the last sequence) give 0.
    `k`, `v`, the step's own keys and values, are the GPU kernel's to read where it can
    (`triton_attention.prefill_attention`); this reference reads every key from the cache."""
    if q.device.type == "cpu":
        return _prefill_attention_by_sequence(q, k_cache, v_cache, step, scale, sliding_window, k_scale, v_scale)
    return prefill_attention_graph_safe(q, k_cache, v_cache, step, scale, sliding_window, k_scale, v_scale)


def prefill_attention_graph_safe(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs, scale: float,
    sliding_window: int | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`prefill_attention` with every bound read on the device (a captured graph's torch
    path): each row gathers its sequence's whole table width, `_ROWS_PER_GATHER` rows at
    a time."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    block_tables = step.block_tables
    width = block_tables.shape[1] * k_cache.shape[1]
    num_seqs = block_tables.shape[0]
    seq = sequence_of_rows(step.query_start_loc, t)
    real = seq < num_seqs
    tables = block_tables[seq.clamp(max=max(num_seqs - 1, 0))] if num_seqs else None
    key_index = torch.arange(width, device=q.device)
    out = torch.zeros_like(q)
    for lo in range(0, t if num_seqs else 0, _ROWS_PER_GATHER):
        rows = slice(lo, min(lo + _ROWS_PER_GATHER, t))
        n = rows.stop - lo
        keys = _read(k_cache, k_scale, tables[rows]).reshape(n, width, kvh, d)
        values = _read(v_cache, v_scale, tables[rows]).reshape(n, width, kvh, d)
        qg = q[rows].view(n, kvh, h // kvh, d)
        scores = torch.einsum("rkgd,rskd->rkgs", qg.float(), keys) * scale
        pos = step.positions[rows, None]
        visible = (key_index[None, :] <= pos) & real[rows, None]
        if sliding_window is not None:
            visible &= pos - key_index[None, :] < sliding_window
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        # Padding rows see no key: their probabilities are 0, not NaN.
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        o = torch.einsum("rkgs,rskd->rkgd", probs, values)
        out[rows] = o.reshape(n, h, d).to(q.dtype)
    return out


def _prefill_attention_by_sequence(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs, scale: float,
    sliding_window: int | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """`prefill_attention` on the CPU, where no graph is captured and the host may read the
    step's bounds: each sequence's keys are gathered once, up to its last row's position,
    and its rows attend to them in one fused product (per-row gathers cost each row the
    whole context again)."""
    t, h, d = q.shape
    kvh, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros_like(q)
    bounds = step.query_start_loc.tolist()
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi <= lo:
            continue
        positions = step.positions[lo:hi]
        last = int(positions.max())
        blocks = step.block_tables[i, : last // block_size + 1]
        keys = _read(k_cache, k_scale, blocks).reshape(-1, kvh, d)[: last + 1]
        values = _read(v_cache, v_scale, blocks).reshape(-1, kvh, d)[: last + 1]
        key_index = torch.arange(last + 1)
        visible = key_index[None, :] <= positions[:, None]
        if sliding_window is not None:
            visible &= positions[:, None] - key_index[None, :] < sliding_window
        o = F.scaled_dot_product_attention(
            q[lo:hi].float().transpose(0, 1).unsqueeze(0),
            keys.float().transpose(0, 1).unsqueeze(0),
            values.float().transpose(0, 1).unsqueeze(0),
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        )
        out[lo:hi] = o.squeeze(0).transpose(0, 1).to(q.dtype)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context (its last `sliding_window` tokens
    when given). q [B, H, d] -> [B, H, d]."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    block_size = k_cache.shape[1]
    if q.device.type == "cpu":  # no graphs on the CPU: only the blocks the lengths reach
        block_tables = block_tables[:, :_blocks_reached(seq_lens - 1, block_size)]
    width = block_tables.shape[1] * block_size
    keys = _read(k_cache, k_scale, block_tables).reshape(b, width, kvh, d)
    values = _read(v_cache, v_scale, block_tables).reshape(b, width, kvh, d)
    qg = q.view(b, kvh, h // kvh, d)
    scores = torch.einsum("bkgd,bskd->bkgs", qg.float(), keys) * scale
    key_index = torch.arange(width, device=q.device)[None, :]
    valid = key_index < seq_lens[:, None]
    if sliding_window is not None:
        valid &= key_index >= seq_lens[:, None] - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgs,bskd->bkgd", probs, values)
    return out.reshape(b, h, d).to(q.dtype)
