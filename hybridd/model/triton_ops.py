"""Fused Triton kernels for the per-layer operations of the decode and prefill forward.

Each kernel keeps the rounding points of the torch reference (`hybridd/model/ops.py`):
sums and products are rounded to the activation dtype where torch rounds them, so the
fused path differs from the reference only by the order of float32 reductions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
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
    _rms_norm_kernel[(x.numel() // n,)](x, x, weight, out, out, n, eps, HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n))
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.numel() // n,)](
        x, residual, weight, out, summed, n, eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n)
    )
    return out, summed


@triton.jit
def _rotary_kernel(
    pos_ptr, x_ptr, out_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, n_heads, HALF: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + offs)
    x2 = tl.load(base + HALF + offs)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + pos * (2 * HALF) + offs).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * (2 * HALF) + HALF + offs).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * (2 * HALF) + offs).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * (2 * HALF) + HALF + offs).to(dt).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, each product rounded as torch rounds it.
    o1 = ((x1f * c1).to(dt).to(tl.float32) + (-(x2f * s1)).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    out = out_ptr + (t * n_heads + h) * (2 * HALF)
    tl.store(out + offs, o1)
    tl.store(out + HALF + offs, o2)


def _rotate(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _rotary_kernel[(t, h)](positions, x, out, cos, sin, x.stride(0), x.stride(1), h, HALF=d // 2)
    return out


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(positions, q, cos, sin), _rotate(positions, k, cos, sin)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
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
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](gate_up.contiguous(), out, n, BLOCK=block)
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt, ROW: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < ROW) & ((tl.zeros([BLOCK], tl.int64) + slot) >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(kc_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, v, mask=mask)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, kv_heads, d] at their slots; rows whose slot is -1 write nothing."""
    t, h, d = k.shape
    k = k.reshape(t, h * d)
    v = v.reshape(t, h * d)
    if t:
        _write_kv_kernel[(t,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=h * d, BLOCK=triton.next_power_of_2(h * d)
        )
