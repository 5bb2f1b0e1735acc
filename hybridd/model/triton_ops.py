"""Fused Triton kernels for the per-layer operations of the decode and prefill forward.

Each kernel keeps the rounding points of the torch reference (`hybridd/model/ops.py`):
sums and products are rounded to the activation dtype where torch rounds them, so the
fused path differs from the reference only by the order of float32 reductions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridd.model import pdl
from hybridd.model.pdl import wait_for_predecessor


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n_cols + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + offs, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.numel() // n,)](
        x, x, weight, out, out, n, eps, HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n),
        **pdl.launch_args(x.device),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.numel() // n,)](
        x, residual, weight, out, summed, n, eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n),
        **pdl.launch_args(x.device),
    )
    return out, summed


@triton.jit
def _rope_rows(base, stride_h, heads, mask, c1, c2, s1, s2, HALF: tl.constexpr):
    """The two rotated halves of rows `heads` of one token, rounded as torch rounds:
    out = x * cos + rotate_half(x) * sin, each product in the activation dtype."""
    offs = tl.arange(0, HALF)
    x1 = tl.load(base + heads[:, None] * stride_h + offs[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + heads[:, None] * stride_h + HALF + offs[None, :], mask=mask, other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = ((x1f * c1).to(dt).to(tl.float32) + (-(x2f * s1)).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _rotary_write_kv_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, kc_ptr, vc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    dt = q_ptr.dtype.element_ty
    # cos/sin are float32 tables; torch rounds them to the activation dtype first.
    c1 = tl.load(cos_ptr + pos * (2 * HALF) + offs).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * (2 * HALF) + HALF + offs).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * (2 * HALF) + offs).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * (2 * HALF) + HALF + offs).to(dt).to(tl.float32)[None, :]

    hq = tl.arange(0, HEADS_PAD)
    qmask = (hq < HEADS)[:, None]
    o1, o2 = _rope_rows(q_ptr + t * stride_qt, stride_qh, hq, qmask, c1, c2, s1, s2, HALF)
    q_out = q_out_ptr + t * (HEADS * 2 * HALF) + hq[:, None] * (2 * HALF) + offs[None, :]
    tl.store(q_out, o1, mask=qmask)
    tl.store(q_out + HALF, o2, mask=qmask)

    hk = tl.arange(0, KV_PAD)
    kmask = (hk < KV_HEADS)[:, None]
    k1, k2 = _rope_rows(k_ptr + t * stride_kt, stride_kh, hk, kmask, c1, c2, s1, s2, HALF)
    row = hk[:, None] * (2 * HALF) + offs[None, :]
    k_out = k_out_ptr + t * (KV_HEADS * 2 * HALF) + row
    tl.store(k_out, k1, mask=kmask)
    tl.store(k_out + HALF, k2, mask=kmask)
    # Slot -1 (bucket padding) writes nothing to the cache.
    cmask = kmask & (slot >= 0)
    cache = slot * (KV_HEADS * 2 * HALF) + row
    tl.store(kc_ptr + cache, k1, mask=cmask)
    tl.store(kc_ptr + cache + HALF, k2, mask=cmask)
    v_row = v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs[None, :]
    v1 = tl.load(v_row, mask=cmask, other=0.0)
    v2 = tl.load(v_row + HALF, mask=cmask, other=0.0)
    tl.store(vc_ptr + cache, v1, mask=cmask)
    tl.store(vc_ptr + cache + HALF, v2, mask=cmask)


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [T, H, d] and k [T, KVH, d], and the rotated k with v stored in the paged
    caches at their slots, in one launch; returns the rotated (q, k). Slot -1 writes nothing."""
    t, h, d = q.shape
    kvh = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its head dimension, got strides {x.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches of a layer must be contiguous")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, kvh, d), dtype=k.dtype, device=k.device)
    if t:
        _rotary_write_kv_kernel[(t,)](
            positions, slot_mapping, q, k, v, cos, sin, q_out, k_out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            HEADS=h, KV_HEADS=kvh, HEADS_PAD=triton.next_power_of_2(h), KV_PAD=triton.next_power_of_2(kvh),
            HALF=d // 2, **pdl.launch_args(q.device),
        )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(x_ptr + row * 2 * n_cols + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * 2 * n_cols + n_cols + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * n_cols + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    t, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up.contiguous(), out, n, BLOCK=block, **pdl.launch_args(out.device)
        )
    return out
