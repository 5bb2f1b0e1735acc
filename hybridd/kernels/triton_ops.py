"""Fused Triton kernels for the per-layer operations of the decode and prefill forward.

Each kernel keeps the rounding points of the torch reference (`hybridd/kernels/ops.py`):
sums and products are rounded to the activation dtype where torch rounds them, so the
fused path differs from the reference only by the order of float32 reductions.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybridd import environment
from hybridd.kernels import pdl
from hybridd.kernels.pdl import wait_for_predecessor
from hybridd.kernels.rotary import RotaryArgs

# Triton's interpreter converts float32 to float8 wrongly near a binade's top: there the
# KV write rounds first (`_round_e4m3`); the GPU's own conversion rounds correctly.
_INTERPRET = environment.flag("TRITON_INTERPRET")

# Programs per token of RoPE with the KV write: each takes an equal share of the token's
# q heads and of its k and v heads (the largest count up to this that divides both),
# with this many warps.
ROTARY_SPLITS = 1
ROTARY_WARPS = 4
# SiLU·mul's columns per program and warps, without and with the row norm (each program
# of a row's norm reads the whole row of h: fewer, wider programs then).
SILU_LAUNCH = (1024, 4)
SILU_NORM_LAUNCH = (4096, 8)


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
def _inverse_rms(row_ptr, n_cols, eps, BLOCK: tl.constexpr):
    """1 / rms of one row of `n_cols` values, in float32: the RMSNorm whose weight is
    folded into the projection before (`LlamaModel.fold_norms`), applied after it."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)


@triton.jit
def _rope_rows(base, stride_h, heads, mask, c1, c2, s1, s2, HALF: tl.constexpr, row_scale, SCALED: tl.constexpr):
    """The two rotated halves of rows `heads` of one token, rounded as torch rounds:
    out = x * cos + rotate_half(x) * sin, each product in the activation dtype; with
    SCALED, x is first scaled by `row_scale` (rounded to the activation dtype)."""
    offs = tl.arange(0, HALF)
    x1 = tl.load(base + heads[:, None] * stride_h + offs[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + heads[:, None] * stride_h + HALF + offs[None, :], mask=mask, other=0.0)
    dt = x1.dtype
    if SCALED:
        x1 = (x1.to(tl.float32) * row_scale).to(dt)
        x2 = (x2.to(tl.float32) * row_scale).to(dt)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = ((x1f * c1).to(dt).to(tl.float32) + (-(x2f * s1)).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _round_e4m3(y):
    """y (float32, within +-448) rounded to the nearest float8 E4M3 value, ties to even, as
    float32: the value's own binade's spacing (2^-9 below the normal range) added and taken
    away at 2^23 times it. The conversion to float8 after is then exact, on the GPU as in
    Triton's interpreter (whose own rounding conversion is wrong near a binade's top)."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True) * 8388608.0
    return (tl.abs(y) + magic - magic) * tl.where(y < 0, -1.0, 1.0)


@triton.jit
def _to_e4m3(y, INTERPRET: tl.constexpr):
    """y (float32, within +-448) as float8 E4M3, rounded to nearest, ties to even: the GPU's
    own conversion (`cvt.rn.satfinite`), or in the interpreter `_round_e4m3` first."""
    if INTERPRET:
        y = _round_e4m3(y)
    return y.to(tl.float8e4nv)


@triton.jit
def _store_heads(c_ptr, s_ptr, cache, scale_at, x1, x2, mask, HALF: tl.constexpr, FP8: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Head vectors (two halves [heads, HALF] each) to the cache at offsets `cache`; with
    FP8, each quantized as `kv_quantize.quantize_heads` does, its scale to `s_ptr + scale_at`."""
    if FP8:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(x1f), axis=1), tl.max(tl.abs(x2f), axis=1))
        scale = tl.where(absmax > 0, tl.math.div_rn(absmax, 448.0), 1.0)  # division rounded as torch's
        y1 = tl.minimum(tl.maximum(tl.math.div_rn(x1f, scale[:, None]), -448.0), 448.0)
        y2 = tl.minimum(tl.maximum(tl.math.div_rn(x2f, scale[:, None]), -448.0), 448.0)
        tl.store(c_ptr + cache, _to_e4m3(y1, INTERPRET), mask=mask)
        tl.store(c_ptr + cache + HALF, _to_e4m3(y2, INTERPRET), mask=mask)
        tl.store(s_ptr + scale_at, scale, mask=tl.max(mask.to(tl.int32), axis=1) > 0)
    else:
        tl.store(c_ptr + cache, x1, mask=mask)
        tl.store(c_ptr + cache + HALF, x2, mask=mask)


@triton.jit
def _rotary_write_kv_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    x_ptr, v_out_ptr, n_cols, eps,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF: tl.constexpr,
    ROW_NORM: tl.constexpr, BLOCK_X: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """One token's share of its heads: program (t, c) takes q heads [c * HEADS, (c + 1) *
    HEADS) and k, v heads [c * KV_HEADS, (c + 1) * KV_HEADS) (HEADS and KV_HEADS are the
    share's counts; the rows' own head counts are HEADS and KV_HEADS times the grid's)."""
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    share = tl.program_id(1)
    all_heads = HEADS * tl.num_programs(1)
    all_kv_heads = KV_HEADS * tl.num_programs(1)
    # With ROW_NORM, q, k and v are the product of the un-normalised rows x and are scaled
    # by the row's 1 / rms of x first; v then goes to `v_out` as well as to the cache.
    row_scale = 1.0
    if ROW_NORM:
        row_scale = _inverse_rms(x_ptr + t * n_cols, n_cols, eps, BLOCK_X)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    dt = q_ptr.dtype.element_ty
    # cos/sin are float32 tables; torch rounds them to the activation dtype first.
    c1 = tl.load(cos_ptr + pos * (2 * HALF) + offs).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * (2 * HALF) + HALF + offs).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * (2 * HALF) + offs).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * (2 * HALF) + HALF + offs).to(dt).to(tl.float32)[None, :]

    lane = tl.arange(0, HEADS_PAD)
    hq = share * HEADS + lane
    qmask = (lane < HEADS)[:, None]
    o1, o2 = _rope_rows(q_ptr + t * stride_qt, stride_qh, hq, qmask, c1, c2, s1, s2, HALF, row_scale, ROW_NORM)
    q_out = q_out_ptr + t * (all_heads * 2 * HALF) + hq[:, None] * (2 * HALF) + offs[None, :]
    tl.store(q_out, o1, mask=qmask)
    tl.store(q_out + HALF, o2, mask=qmask)

    kv_lane = tl.arange(0, KV_PAD)
    hk = share * KV_HEADS + kv_lane
    kmask = (kv_lane < KV_HEADS)[:, None]
    k1, k2 = _rope_rows(k_ptr + t * stride_kt, stride_kh, hk, kmask, c1, c2, s1, s2, HALF, row_scale, ROW_NORM)
    row = hk[:, None] * (2 * HALF) + offs[None, :]
    k_out = k_out_ptr + t * (all_kv_heads * 2 * HALF) + row
    tl.store(k_out, k1, mask=kmask)
    tl.store(k_out + HALF, k2, mask=kmask)
    # Slot -1 (bucket padding) writes nothing to the cache.
    cmask = kmask & (slot >= 0)
    cache = slot * (all_kv_heads * 2 * HALF) + row
    scale_at = slot * all_kv_heads + hk
    _store_heads(kc_ptr, ks_ptr, cache, scale_at, k1, k2, cmask, HALF, FP8, INTERPRET)
    v_row = v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs[None, :]
    if ROW_NORM:
        v1 = (tl.load(v_row, mask=kmask, other=0.0).to(tl.float32) * row_scale).to(dt)
        v2 = (tl.load(v_row + HALF, mask=kmask, other=0.0).to(tl.float32) * row_scale).to(dt)
        v_out = v_out_ptr + t * (all_kv_heads * 2 * HALF) + row
        tl.store(v_out, v1, mask=kmask)
        tl.store(v_out + HALF, v2, mask=kmask)
    else:
        v1 = tl.load(v_row, mask=cmask, other=0.0)
        v2 = tl.load(v_row + HALF, mask=cmask, other=0.0)
    _store_heads(vc_ptr, vs_ptr, cache, scale_at, v1, v2, cmask, HALF, FP8, INTERPRET)


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [T, H, d] and k [T, KVH, d], and the rotated k with v stored in the paged
    caches at their slots (an FP8 cache: quantized, their scales in `k_scale`, `v_scale`),
    in one launch; returns the rotated (q, k). Slot -1 writes nothing."""
    q_out, k_out, _ = _rotary_write_kv(positions, q, k, v, k_cache, v_cache, slot_mapping, cos, sin, None, 0.0,
                                       k_scale, v_scale)
    return q_out, k_out


def norm_rotary_write_kv(
    x: torch.Tensor, eps: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: RotaryArgs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rotary_write_kv` (with `rotary`'s positions, slots, caches and tables) of q, k and v
    that are the product of the un-normalised rows x [T, hidden] with a weight that holds
    its RMSNorm's (`LlamaModel.fold_norms`): each token's q, k and v are first scaled by
    the 1 / rms of its row of x. Returns (q, k, v), q and k rotated, all three scaled; the
    cache gets the scaled k and v."""
    _check_norm_rows("x", x, q.shape[0])
    return _rotary_write_kv(rotary.positions, q, k, v, rotary.k_cache, rotary.v_cache, rotary.slot_mapping,
                            rotary.cos, rotary.sin, x, eps, rotary.k_scale, rotary.v_scale)


def _rotary_write_kv(positions, q, k, v, k_cache, v_cache, slot_mapping, cos, sin, x, eps, k_scale=None, v_scale=None):
    t, h, d = q.shape
    kvh = k.shape[1]
    for name, rows in (("q", q), ("k", k), ("v", v)):
        if rows.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its head dimension, got strides {rows.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches of a layer must be contiguous")
    fp8 = k_scale is not None
    if fp8 and not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("the KV scale caches of a layer must be contiguous")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, kvh, d), dtype=k.dtype, device=k.device)
    v_out = None if x is None else torch.empty((t, kvh, d), dtype=v.dtype, device=v.device)
    n_cols = 0 if x is None else x.shape[-1]
    splits = math.gcd(h, kvh, ROTARY_SPLITS)
    if t:
        _rotary_write_kv_kernel[(t, splits)](
            positions, slot_mapping, q, k, v, cos, sin, q_out, k_out, k_cache, v_cache,
            k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q if x is None else x, q if v_out is None else v_out, n_cols, eps,
            HEADS=h // splits, KV_HEADS=kvh // splits, HEADS_PAD=triton.next_power_of_2(h // splits),
            KV_PAD=triton.next_power_of_2(kvh // splits),
            HALF=d // 2, ROW_NORM=x is not None, BLOCK_X=triton.next_power_of_2(max(n_cols, 1)), FP8=fp8,
            INTERPRET=_INTERPRET, num_warps=ROTARY_WARPS, **pdl.launch_args(q.device),
        )
    return q_out, k_out, v_out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, n_cols, h_ptr, h_cols, eps, BLOCK: tl.constexpr, ROW_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(x_ptr + row * 2 * n_cols + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * 2 * n_cols + n_cols + offs, mask=mask, other=0.0)
    if ROW_NORM:
        # gate and up are the product of the un-normalised row h: scale by its 1 / rms first.
        row_scale = _inverse_rms(h_ptr + row * h_cols, h_cols, eps, BLOCK_H)
        g = (g.to(tl.float32) * row_scale).to(u.dtype)
        u = (u.to(tl.float32) * row_scale).to(u.dtype)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * n_cols + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _silu_and_mul(gate_up, None, 0.0)


def norm_silu_and_mul(h: torch.Tensor, eps: float, gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` of gate_up [T, 2 n], the product of the un-normalised rows h [T, hidden]
    with a weight that holds its RMSNorm's (`LlamaModel.fold_norms`): each row of gate and
    up is first scaled by the 1 / rms of its row of h."""
    _check_norm_rows("h", h, gate_up.shape[0])
    return _silu_and_mul(gate_up, h, eps)


def _check_norm_rows(name: str, rows: torch.Tensor, tokens: int) -> None:
    """The rows a kernel takes its norm from: one contiguous row per token of its input."""
    if rows.dim() != 2 or rows.shape[0] != tokens:
        raise ValueError(f"{name} must hold one row per token ({tokens}), got shape {tuple(rows.shape)}")
    if not rows.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {rows.stride()}")


def _silu_and_mul(gate_up: torch.Tensor, h: torch.Tensor | None, eps: float) -> torch.Tensor:
    t, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block, warps = SILU_LAUNCH if h is None else SILU_NORM_LAUNCH
    h_cols = 0 if h is None else h.shape[-1]
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up.contiguous(), out, n, gate_up if h is None else h, h_cols, eps, BLOCK=block,
            ROW_NORM=h is not None, BLOCK_H=triton.next_power_of_2(max(h_cols, 1)), num_warps=warps,
            **pdl.launch_args(out.device)
        )
    return out
