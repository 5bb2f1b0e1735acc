"""Graph-safe paged decode attention ("flash-decoding") in Triton.

Each program handles one (sequence, kv head, split) and walks its share of the
sequence's tokens through the block table; the sequence length and the block table
are read from device memory, so a graph captured once serves every length. A second
kernel merges the splits by their log-sum-exp. The grid depends only on the batch
bucket, the kv heads and the split count, all fixed per captured graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 64
_TARGET_PROGRAMS = 264  # about two waves on an H200's 132 multiprocessors


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, len_ptr, part_o_ptr, part_lse_ptr, scale,
    stride_qb, stride_qh, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(len_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # A while loop (not range) so the bound read from memory also works in Triton's
    # CPU interpreter, which the CPU tests use.
    tok0 = start
    while tok0 < end:
        toks = tok0 + tl.arange(0, TILE)
        valid = toks < end
        blk = tl.load(bt_ptr + b * stride_bt + toks // PAGE, mask=valid, other=0).to(tl.int64)
        off = blk * stride_c_blk + (toks % PAGE) * stride_c_tok + kvh * stride_c_head
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        tok0 += TILE
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
    hmask = g < GROUP
    tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=hmask[:, None])
    tl.store(part_lse_ptr + row, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(part_lse_ptr + bh * NUM_SPLITS + s)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    o = tl.load(part_o_ptr + (bh * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :])
    total = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + bh * HEAD_DIM + d, res.to(out_ptr.dtype.element_ty))


def num_splits_for(batch: int, kv_heads: int, max_tokens: int) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU, no more than tiles."""
    want = max(1, -(-_TARGET_PROGRAMS // (batch * kv_heads)))
    most = max(1, -(-max_tokens // _TILE))
    return triton.next_power_of_2(min(want, most, 64))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, d], caches [blocks, page, KVH, d] -> [B, H, d]; same contract as the torch path."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    page = k_cache.shape[1]
    group = h // kvh
    splits = num_splits_for(b, kvh, block_tables.shape[1] * page)
    q = q.contiguous()
    part_o = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _decode_split_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, PAGE=page,
        TILE=_TILE, NUM_SPLITS=splits, NUM_HEADS=h,
        # float32 caches get true float32 products, not TF32 (bf16 ignores this).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    _decode_merge_kernel[(b * h,)](part_o, part_lse, out, NUM_SPLITS=splits, HEAD_DIM=d)
    return out
