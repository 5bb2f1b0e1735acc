"""Skinny projections for decode: y = x @ W.T for a few token rows, at the weight-read limit.

With M <= 32 rows the product is bound by reading W [N, K] (as `nn.Linear` stores it)
once. Each program streams a [BLOCK_N, K / split] slab of W through the pipelined loads
and multiplies it by the tiny activation tile on the tensor cores (the activation is
padded to BLOCK_M = 16 or 32 rows, which costs nothing at this intensity). Where the
N tiles alone cannot fill the GPU (o_proj, down_proj) K is split; the split programs
store float32 partials and the last one to arrive for an N tile (a per-tile counter,
reset by that program) sums them and writes the output, so a split product is one
kernel with no memset and no reduce launch, and its launch grid depends only on the
shape: safe to capture in a CUDA graph. For the fused qkv projection the kernel can
apply RoPE and store k and v in the paged KV caches in its epilogue (`launch`'s
`rotary`): each tile pairs dim i of a head with dim i + d/2 of the same head, so it
holds both rotate-half partners.

A launch's config (`config_for`) follows from the product's shape, its row count and the
device's multiprocessor count alone, so every GPU and every Llama-family shape gets one;
the rule reproduces the configs that sweeps of the Llama-2-7B and Llama-3-8B shapes on an
H200 chose (docs/lab/kernels.md, "Kernels alone"); an FP8 weight's rule of its own
(`fp8_rule_config`), those an H100 sweep chose.

FP8 weights (`hybridd.kernels.fp8.Fp8Weight`): the kernel loads the FP8 tile, converts it
in registers and multiplies it in one of the forms `GemmConfig.kernel` names: on the
tensor cores in the activation dtype (exact: E4M3 fits in bf16) or in float16 (the
activations rounded to float16), W their first or second operand; or on the CUDA cores
in float32, up to FMA_ROWS rows, each thread keeping its own columns' partial sums until
the end of the loop (no rows padded, no operand layout). The per-output-channel scale
(and, where the checkpoint quantizes the activations too, each row's activation scale)
multiplies the float32 sum in the epilogue. A folded norm
cannot live in an FP8 weight (its scales are per output row, the norm's weight per input
column), so for FP8 the kernel applies the norm on the activation side instead: each
activation tile is normalised and multiplied by the norm's weight as it is loaded,
rounded where the separate norm rounds (`FoldedNorm.weight`). With `GemmConfig.tile_m`
the same kernel tiles the rows too: the FP8-weight × bf16 prefill GEMM
(`hybridd.kernels.triton_fp8`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridd import environment
from hybridd.kernels import pdl, split_scratch
from hybridd.kernels.fp8 import DECODE_ROWS, FP8_DTYPE, Fp8Weight
from hybridd.kernels.launch_variants import first_eager_call
from hybridd.kernels.pdl import wait_for_predecessor
from hybridd.kernels.rotary import RotaryArgs
from hybridd.kernels.triton_quantize import quantize_tokens

# The most rows the skinny GEMM takes: the FP8 numerics' decode rows (`fp8.product`).
MAX_ROWS = DECODE_ROWS
KERNELS = ("dot", "dot_f16", "fma", "dot_f16_t")
FMA_ROWS = 8
_INTERPRET = environment.flag("TRITON_INTERPRET")
# Float32 partials and per-tile counters for split-K, per (device, stream, capturing).
_WORKSPACE_FLOATS = 1 << 21
_COUNTERS = 1 << 14


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = 0  # rows per tile, a power of two >= 16; 0: 16 or 32 by the row count
    # Tile the rows as well (one program per row tile and N tile, no split): any row count.
    # Without it a launch takes at most one tile of rows.
    tile_m: bool = False
    # How an FP8 weight's tile is multiplied (one of KERNELS): "dot" converts it to the
    # activation dtype for the tensor cores; "dot_f16" converts it to float16 (one hardware
    # conversion a pair) and the activations, scaled by 2^-4, as well; "dot_f16_t" is that
    # with W the tensor cores' second operand (its FP8 tile read from shared memory in
    # 8-byte pieces where the first operand's layout takes 2); "fma"
    # multiplies on the CUDA cores in float32, up to FMA_ROWS rows (no padding to 16), each
    # thread summing its own K columns until the end (num_stages > 1: each weight tile
    # loaded a step ahead).
    kernel: str = "dot"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.kernel != "dot" and self.tile_m:
            raise ValueError(f"the {self.kernel} kernel takes decode's rows only (no tile_m)")
        if self.block_m and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m must be 0 (16 or 32 by the row count) or a power of two >= 16, "
                             f"got {self.block_m}")
        if self.tile_m and (not self.block_m or self.split_k != 1):
            raise ValueError("a config that tiles the rows needs its block_m and no split of K")


@triton.jit
def _multiply_add(acc, w_rows, x_ptr, offs_m, k_idx, mask_m, mask_n, stride_xm, K, EVEN_K: tl.constexpr,
                  dt: tl.constexpr, g_ptr, inv_rms, NORM_WEIGHT: tl.constexpr, MODE: tl.constexpr = 0):
    """acc [BLOCK_N, BLOCK_M] += W[n, k_idx] @ x[m, k_idx].T, both converted to `dt` (the
    activation dtype) in registers: an FP8 weight or FP8 activations exactly. With
    NORM_WEIGHT, x's rows are RMS-normalised here: x * inv_rms rounded to `dt`, times the
    norm's weight g[k_idx] rounded again, as the separate norm rounds. The weight is read
    once, so it is evicted first.

    MODE 1 ("dot_f16"): both in float16 instead (FP8 E4M3 exactly, one conversion a pair
    on sm89+; the activations scaled by 2^-4, exact from 2^-13 to 2^20, see
    `GemmConfig.kernel`); MODE 3 ("dot_f16_t"): that of 1 with acc [BLOCK_M, BLOCK_N] +=
    x @ W.T."""
    a_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_idx[None, :]
    if EVEN_K:
        w = tl.load(w_rows + k_idx[None, :], mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        if NORM_WEIGHT:
            g = tl.load(g_ptr + k_idx)
    else:
        mask_k = k_idx < K
        w = tl.load(
            w_rows + k_idx[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first"
        )
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if NORM_WEIGHT:
            g = tl.load(g_ptr + k_idx, mask=mask_k, other=0.0)
    if NORM_WEIGHT:
        a = (a.to(tl.float32) * inv_rms[:, None]).to(dt)
        a = (a.to(tl.float32) * g.to(tl.float32)[None, :]).to(dt)
    if MODE == 1 or MODE == 3:
        # Scaled by 2^-4 on the way to float16 (the epilogue scales back): a bf16 value
        # from 2^-13 to 2^20 in magnitude is then a float16 exactly, where unscaled ones
        # past 65504 (a down projection's input may reach them) would overflow.
        a = (a.to(tl.float32) * 0.0625).to(tl.float16)
    if MODE == 1:  # the mode numbers: KERNELS' indices
        return tl.dot(w.to(tl.float16), tl.trans(a), acc)
    elif MODE == 3:  # acc [BLOCK_M, BLOCK_N]: W the tensor cores' second operand
        return tl.dot(a, tl.trans(w.to(tl.float16)), acc)
    elif dt == tl.float32:
        # float32 activations mean float32 products, as torch's matmul gives them by
        # default, not Triton's default TF32 (a 10-bit mantissa).
        return tl.dot(w.to(dt), tl.trans(a.to(dt)), acc, input_precision="ieee")
    else:
        return tl.dot(w.to(dt), tl.trans(a.to(dt)), acc)


@triton.jit
def _fma_row(acc, wf, x_ptr, row, M, k_idx, mask_k, stride_xm, dt: tl.constexpr, g, inv_rms, r: tl.constexpr,
             NORM_WEIGHT: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] += wf * x[row, k_idx]: one row's products on the CUDA cores,
    each thread keeping its own columns' partial sums (reduced over K once, after the
    loop). With NORM_WEIGHT the row is normalised as `_multiply_add` normalises it."""
    a = tl.load(x_ptr + row * stride_xm + k_idx, mask=mask_k & (row < M), other=0.0)
    if NORM_WEIGHT:
        rms = tl.sum(tl.where(tl.arange(0, inv_rms.shape[0]) == r, inv_rms, 0.0))
        a = (a.to(tl.float32) * rms).to(dt)
        a = (a.to(tl.float32) * g).to(dt)
    return acc + wf * a.to(tl.float32)[None, :]


@triton.jit
def _fma_weights(w_rows, k_idx, mask_n, K, EVEN_K: tl.constexpr, live):
    """The FP8 tile W[n, k_idx] (`live` false: nothing loaded, zeros)."""
    if EVEN_K:
        mask = mask_n[:, None] & live
    else:
        mask = mask_n[:, None] & (k_idx < K)[None, :] & live
    return tl.load(w_rows + k_idx[None, :], mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _fma_step(accs, w, x_ptr, row0, M, k_idx, stride_xm, K, dt: tl.constexpr, g_ptr, inv_rms,
              NORM_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The CUDA-core product ("fma") of one step of K for up to FMA_ROWS rows, one float32
    accumulator [BLOCK_N, BLOCK_K] a row (`accs`, a tuple): the FP8 tile `w` converted
    once (E4M3 to float16, one hardware conversion a pair on sm89+, then float32) in the
    layout it was loaded in, which no tensor-core operand layout reshuffles."""
    mask_k = k_idx < K
    g = None
    if NORM_WEIGHT:
        g = tl.load(g_ptr + k_idx, mask=mask_k, other=0.0).to(tl.float32)
    wf = w.to(tl.float16).to(tl.float32)
    out = ()
    for r in tl.static_range(BLOCK_M):
        out = out + (_fma_row(accs[r], wf, x_ptr, row0 + r, M, k_idx, mask_k, stride_xm, dt, g, inv_rms, r,
                              NORM_WEIGHT),)
    return out


@triton.jit
def _fma_rows(w_rows, x_ptr, row0, M, k_start, k_per_split, mask_n, stride_xm, K, EVEN_K: tl.constexpr,
              dt: tl.constexpr, g_ptr, inv_rms, NORM_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] = W[n, split] @ x[m, split].T on the CUDA cores (`_fma_step`).
    With PREFETCH each step's weight tile is loaded a step ahead, into registers (the
    compiler pipelines no loads that feed no tensor core): two steps' bytes in flight."""
    offs_k = tl.arange(0, BLOCK_K)
    accs = ()
    for r in tl.static_range(BLOCK_M):
        accs = accs + (tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32),)
    if PREFETCH:
        w = _fma_weights(w_rows, k_start + offs_k, mask_n, K, EVEN_K, True)
    if INTERPRET:
        k = 0
        while k < k_per_split:
            if PREFETCH:
                w_next = _fma_weights(w_rows, k_start + k + BLOCK_K + offs_k, mask_n, K, EVEN_K,
                                      k + BLOCK_K < k_per_split)
            else:
                w = _fma_weights(w_rows, k_start + k + offs_k, mask_n, K, EVEN_K, True)
            accs = _fma_step(accs, w, x_ptr, row0, M, k_start + k + offs_k, stride_xm, K, dt, g_ptr, inv_rms,
                             NORM_WEIGHT, BLOCK_M)
            if PREFETCH:
                w = w_next
            k += BLOCK_K
    else:
        for k in range(0, k_per_split, BLOCK_K):
            if PREFETCH:
                w_next = _fma_weights(w_rows, k_start + k + BLOCK_K + offs_k, mask_n, K, EVEN_K,
                                      k + BLOCK_K < k_per_split)
            else:
                w = _fma_weights(w_rows, k_start + k + offs_k, mask_n, K, EVEN_K, True)
            accs = _fma_step(accs, w, x_ptr, row0, M, k_start + k + offs_k, stride_xm, K, dt, g_ptr, inv_rms,
                             NORM_WEIGHT, BLOCK_M)
            if PREFETCH:
                w = w_next
    rows = tl.arange(0, BLOCK_M)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for r in tl.static_range(BLOCK_M):
        acc = tl.where(rows == r, tl.sum(accs[r], axis=1)[:, None], acc)
    return acc


@triton.jit
def _store_out(y_ptr, b_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


@triton.jit
def _store_residual_add(y_ptr, b_ptr, res_ptr, stats_ptr, acc, offs_m, offs_n, pid_n, mask_m, mask_n, stride_ym,
                        n_tiles, HAS_BIAS: tl.constexpr):
    """y = residual + the product, rounded where the separate add rounds (the product in the
    activation dtype, then the sum), and this tile's share of each row's sum of squares of
    y in float32 at stats[m, pid_n]: the next projection's `FoldedNorm` adds the tiles up."""
    dt = y_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    offs = offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = mask_m[None, :] & mask_n[:, None]
    r = tl.load(res_ptr + offs, mask=mask, other=0.0)
    y = (r.to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
    tl.store(y_ptr + offs, y, mask=mask)
    yf = y.to(tl.float32)
    tl.store(stats_ptr + offs_m * n_tiles + pid_n, tl.sum(yf * yf, axis=0), mask=mask_m)


@triton.jit
def _rope_factors(pos_ptr, cos_ptr, sin_ptr, offs_m, mask_m, pid_n, dt: tl.constexpr, HALF: tl.constexpr,
                  PAIRS: tl.constexpr):
    """cos and sin of a rotary tile's dims [PAIRS, BLOCK_M] at each row's position, both
    halves, rounded to the activation dtype first as torch rounds them (the tables are
    float32 [positions, 2 * HALF]). Loaded before the product, so their latency hides
    behind the weight stream."""
    dims = (pid_n % (HALF // PAIRS)) * PAIRS + tl.arange(0, PAIRS)
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    table = pos[None, :] * (2 * HALF) + dims[:, None]
    c1 = tl.load(cos_ptr + table, mask=mask_m[None, :], other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF, mask=mask_m[None, :], other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=mask_m[None, :], other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF, mask=mask_m[None, :], other=0.0).to(dt).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _store_rotary_kv(y_ptr, b_ptr, acc, offs_m, offs_n, pid_n, mask_m, stride_ym, rope, slot_ptr,
                     kc_ptr, vc_ptr, HAS_BIAS: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr):
    """A tile of the fused qkv projection whose rows alternate dim i, dim i + HALF of one
    head: RoPE on q and k heads (v as projected), written to y [M, q + 2 kv] where the
    plain product would write it, and k, v also to the paged caches at each row's slot
    (slot -1: none). Rounded where the separate kernels round (the product with its bias
    stored in the activation dtype, then `triton_ops._rope_rows`); on the GPU a few
    products may round the other way than in the plain kernel."""
    dt = y_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n).to(tl.float32)[:, None]
    x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(dt), (PAIRS, 2, BLOCK_M)), (0, 2, 1)))
    head = pid_n // (HALF // PAIRS)
    dims = (pid_n % (HALF // PAIRS)) * PAIRS + tl.arange(0, PAIRS)
    c1, c2, s1, s2 = rope
    if head < HEADS + KV_HEADS:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        o1 = ((x1f * c1).to(dt).to(tl.float32) + (-(x2f * s1)).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    else:
        o1 = x1
        o2 = x2
    cols = head * (2 * HALF) + dims
    ptrs = y_ptr + offs_m[None, :] * stride_ym + cols[:, None]
    tl.store(ptrs, o1, mask=mask_m[None, :])
    tl.store(ptrs + HALF, o2, mask=mask_m[None, :])
    if head >= HEADS:
        slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
        kv_head = (head - HEADS) % KV_HEADS
        cache = slot[None, :] * (KV_HEADS * 2 * HALF) + kv_head * (2 * HALF) + dims[:, None]
        cmask = (slot >= 0)[None, :]
        if head < HEADS + KV_HEADS:
            tl.store(kc_ptr + cache, o1, mask=cmask)
            tl.store(kc_ptr + cache + HALF, o2, mask=cmask)
        else:
            tl.store(vc_ptr + cache, o1, mask=cmask)
            tl.store(vc_ptr + cache + HALF, o2, mask=cmask)


@triton.jit
def _store(y_ptr, b_ptr, acc, offs_m, offs_n, pid_n, mask_m, mask_n, N, stride_ym, rope, slot_ptr, kc_ptr, vc_ptr,
           res_ptr, stats_out_ptr, HAS_BIAS: tl.constexpr, ROTARY: tl.constexpr,
           RESIDUAL: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The product's epilogue: the plain output, or the one its mode computes."""
    if ROTARY:
        _store_rotary_kv(y_ptr, b_ptr, acc, offs_m, offs_n, pid_n, mask_m, stride_ym, rope, slot_ptr, kc_ptr,
                         vc_ptr, HAS_BIAS, HEADS, KV_HEADS, HALF, BLOCK_M, BLOCK_N // 2)
    elif RESIDUAL:
        _store_residual_add(y_ptr, b_ptr, res_ptr, stats_out_ptr, acc, offs_m, offs_n, pid_n, mask_m, mask_n,
                            stride_ym, tl.num_programs(0), HAS_BIAS)
    else:
        _store_out(y_ptr, b_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, count_ptr,
    M, N, K, k_per_split, split_k, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    pos_ptr=None, slot_ptr=None, cos_ptr=None, sin_ptr=None, kc_ptr=None, vc_ptr=None,
    ROTARY: tl.constexpr = False, HEADS: tl.constexpr = 1, KV_HEADS: tl.constexpr = 1, HALF: tl.constexpr = 1,
    stats_ptr=None, n_stats=1, eps=0.0, res_ptr=None, stats_out_ptr=None,
    NORM: tl.constexpr = False, STATS_PAD: tl.constexpr = 1, RESIDUAL: tl.constexpr = False,
    w_scale_ptr=None, W_SCALE: tl.constexpr = False, x_scale_ptr=None, X_SCALE: tl.constexpr = False,
    g_ptr=None, NORM_WEIGHT: tl.constexpr = False, MODE: tl.constexpr = 0, FMA_PREFETCH: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    dt = y_ptr.dtype.element_ty
    if ROTARY:
        # Rows alternate between dim i and dim i + HALF of one head (q heads, then k, then
        # v, as the fused weight stacks them): HALF // (BLOCK_N/2) tiles per head.
        r = tl.arange(0, BLOCK_N)
        tiles_per_head = HALF // (BLOCK_N // 2)
        offs_n = ((pid_n // tiles_per_head) * (2 * HALF) + (pid_n % tiles_per_head) * (BLOCK_N // 2)
                  + r // 2 + (r % 2) * HALF)
        mask_n = offs_n < N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    k_start = pid_k * k_per_split
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    wait_for_predecessor(PDL)
    inv_rms = None
    if NORM:
        # 1 / rms of each x row from the partial sums of squares its producer stored.
        j = tl.arange(0, STATS_PAD)
        parts = tl.load(stats_ptr + offs_m[:, None] * n_stats + j[None, :],
                        mask=mask_m[:, None] & (j < n_stats)[None, :], other=0.0)
        inv_rms = 1.0 / tl.sqrt(tl.sum(parts, axis=1) / K + eps)
    if ROTARY:
        rope = _rope_factors(pos_ptr, cos_ptr, sin_ptr, offs_m, mask_m, pid_n, dt, HALF, BLOCK_N // 2)
    else:
        rope = None
    if MODE >= 3:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The last split may run past K: its loads there are masked off (EVEN_K: never happens).
    if MODE == 2:
        acc = _fma_rows(w_rows, x_ptr, tl.program_id(2) * BLOCK_M, M, k_start, k_per_split, mask_n, stride_xm, K,
                        EVEN_K, dt, g_ptr, inv_rms, NORM_WEIGHT, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, FMA_PREFETCH)
    elif INTERPRET:
        # Triton's CPU interpreter cannot take a runtime loop bound in range(); a while
        # loop is not software-pipelined when compiled, so it serves the interpreter only.
        k = 0
        while k < k_per_split:
            acc = _multiply_add(acc, w_rows, x_ptr, offs_m, k_start + k + offs_k, mask_m, mask_n, stride_xm, K, EVEN_K,
                                dt, g_ptr, inv_rms, NORM_WEIGHT, MODE)
            k += BLOCK_K
    else:
        for k in range(0, k_per_split, BLOCK_K):
            acc = _multiply_add(acc, w_rows, x_ptr, offs_m, k_start + k + offs_k, mask_m, mask_n, stride_xm, K, EVEN_K,
                                dt, g_ptr, inv_rms, NORM_WEIGHT, MODE)
    if MODE >= 3:
        acc = tl.trans(acc)
    if MODE == 1 or MODE == 3:
        acc = acc * 16.0  # the float16 forms' activations were scaled by 2^-4
    if NORM and not NORM_WEIGHT:
        # The norm's weight is folded into W (`LlamaModel.fold_norms`): what is left of it
        # is one scale per row, which commutes with the product and with the split sum.
        acc = acc * inv_rms[None, :]
    if W_SCALE:
        # FP8 weight: its scale per output channel, which commutes with the split sum too.
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    if X_SCALE:
        # FP8 activations: each row's scale.
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)[None, :]
    if SPLIT:
        # Every split stores its partial; the last to arrive for this N tile sums them all,
        # writes y and re-arms the counter for the next launch.
        ws_n = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_n + pid_k * BLOCK_M * N, acc, mask=mask_n[:, None])
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:
            # Summed in split order, whichever program arrived last: every launch gives the
            # same bits.
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            s = 0
            while s < split_k:
                acc += tl.load(ws_n + s * BLOCK_M * N, mask=mask_n[:, None], other=0.0, cache_modifier=".cg")
                s += 1
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _store(y_ptr, b_ptr, acc, offs_m, offs_n, pid_n, mask_m, mask_n, N, stride_ym, rope, slot_ptr, kc_ptr,
                   vc_ptr, res_ptr, stats_out_ptr, HAS_BIAS, ROTARY, RESIDUAL, HEADS, KV_HEADS, HALF,
                   BLOCK_M, BLOCK_N)
    else:
        _store(y_ptr, b_ptr, acc, offs_m, offs_n, pid_n, mask_m, mask_n, N, stride_ym, rope, slot_ptr, kc_ptr, vc_ptr,
               res_ptr, stats_out_ptr, HAS_BIAS, ROTARY, RESIDUAL, HEADS, KV_HEADS, HALF, BLOCK_M, BLOCK_N)


def _rotary_operands(rotary: RotaryArgs, m: int, n: int, block_n: int) -> dict | None:
    """The kernel arguments of the rotary epilogue, or None where a tile of `block_n` rows
    cannot hold whole rotate-half pairs of one head. Raises on inconsistent operands."""
    h, kvh, d = rotary.num_heads, rotary.num_kv_heads, rotary.head_dim
    if d % 2 or n != (h + 2 * kvh) * d:
        raise ValueError(f"a qkv weight of {n} rows does not hold {h} q and 2 x {kvh} kv heads of dim {d}")
    if not (rotary.k_cache.is_contiguous() and rotary.v_cache.is_contiguous()):
        raise ValueError("the KV caches of a layer must be contiguous")
    for name, table in (("cos", rotary.cos), ("sin", rotary.sin)):
        if table.dim() != 2 or table.shape[1] != d or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [positions, {d}] table, got {tuple(table.shape)}")
    if rotary.positions.numel() < m or rotary.slot_mapping.numel() < m:
        raise ValueError(f"{m} rows need as many positions and slots")
    pairs = block_n // 2
    if block_n % 2 or pairs == 0 or (d // 2) % pairs:
        return None
    return dict(
        pos_ptr=rotary.positions.contiguous(), slot_ptr=rotary.slot_mapping.contiguous(), cos_ptr=rotary.cos,
        sin_ptr=rotary.sin, kc_ptr=rotary.k_cache, vc_ptr=rotary.v_cache, ROTARY=True, HEADS=h, KV_HEADS=kvh,
        HALF=d // 2,
    )


def block_m_of(config: GemmConfig, m: int) -> int:
    """The rows of a launch's tile for m rows: the config's, or 16 or 32 by the row count
    for the tensor cores, or m's power of two on the CUDA cores (`fma`)."""
    if config.block_m:
        return config.block_m
    if config.kernel == "fma":
        return triton.next_power_of_2(max(m, 1))
    return 16 if m <= 16 else 32


@dataclass(frozen=True, eq=False)
class FoldedNorm:
    """The RMSNorm of a product's input rows, whose weight is folded into the product's W
    (W diag(g)): what is left is each row's 1 / rms, from `eps` and the rows' sums of
    squares as their producer left them, in parts (`sum_squares` [M, parts] float32, see
    `launch`'s `residual`). With `weight` (the norm's g [K], for an FP8 W, which cannot
    hold it) the norm is applied whole to the activations as the kernel loads them."""

    eps: float
    sum_squares: torch.Tensor
    weight: torch.Tensor | None = None


def launch(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None, config: GemmConfig,
    rotary: RotaryArgs | None = None, norm: FoldedNorm | None = None, residual: torch.Tensor | None = None,
):
    """The skinny product with an explicit config; None where it cannot run (the caller
    falls back to cuBLAS): too many rows, a weight not stored row-major as `nn.Linear`
    keeps it, or split-K scratch missing during capture. `weight` in x's dtype, or FP8
    with its scales (`Fp8Weight`; where it quantizes its input, x is quantized to FP8 per
    row here first, `triton_quantize.quantize_tokens`). `rotary`: W is a fused qkv projection
    and the result [M, q_size + 2 kv_size] holds q and k rotated and v, which also go to
    the KV caches (see `RotaryArgs`); None where BLOCK_N / 2 does not divide head_dim / 2.
    `norm`: x's rows are RMS-normalised, the product of each row scaled by its 1 / rms,
    for a W that holds the norm's weight (or with `norm.weight`, normalised whole as
    loaded). `residual` [M, N]: the result is (residual + x @ W.T, its rows' sums of
    squares in parts [M, N tiles]), the parts a `FoldedNorm` takes."""
    m = x.shape[0]
    out_dtype = x.dtype
    fp8 = weight if isinstance(weight, Fp8Weight) else None
    if fp8 is not None:
        weight = fp8.weight
        if fp8.scale.dtype != torch.float32 or fp8.scale.shape != (weight.shape[0],):
            raise ValueError(f"an FP8 weight of {weight.shape[0]} rows needs float32 scales [{weight.shape[0]}]")
        if fp8.activations != "none" and norm is not None:
            raise ValueError("a folded norm cannot feed a product whose input is quantized to FP8 (the scale of a "
                             "row is taken from the normalised row): normalise the rows first")
    elif weight.dtype == FP8_DTYPE:
        raise ValueError("an FP8 weight comes with its scales: pass an Fp8Weight")
    n, k = weight.shape
    if rotary is not None and residual is not None:
        raise ValueError("a product's epilogue is one of rotary or residual")
    if norm is not None and (norm.sum_squares.shape[0] < m or not norm.sum_squares.is_contiguous()):
        raise ValueError(f"a folded norm of {m} rows needs their sums of squares, contiguous [{m}, parts]")
    if norm is not None and norm.weight is not None and norm.weight.shape != (k,):
        raise ValueError(f"the norm weight of a product over {k} columns must be [{k}], got {tuple(norm.weight.shape)}")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"the residual of a [{m}, {n}] product must be a contiguous [{m}, {n}] tensor")
    if config.kernel != "dot" and fp8 is None:
        raise ValueError(f"the {config.kernel} kernel multiplies FP8 weights only")
    if config.kernel == "fma" and m > FMA_ROWS:
        return None
    block_m = block_m_of(config, m)
    if m == 0 or (m > block_m and not config.tile_m) or x.shape[1] != k or weight.stride() != (k, 1):
        return None
    rotary_args = {} if rotary is None else _rotary_operands(rotary, m, n, config.block_n)
    if rotary_args is None:
        return None
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiles_n = triton.cdiv(n, config.block_n)
    tiles_m = triton.cdiv(m, block_m) if config.tile_m else 1
    split = max(1, min(config.split_k, triton.cdiv(k, config.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    if split > 1:
        if split * block_m * n > _WORKSPACE_FLOATS or tiles_n > _COUNTERS:
            return None
        ws = split_scratch.scratch(x.device, "gemm_partials", _WORKSPACE_FLOATS, torch.float32)
        counts = split_scratch.scratch(x.device, "gemm_counters", _COUNTERS, torch.int32)
        if ws is None or counts is None:
            return None
    else:
        ws, counts = x, x
    fused = {}
    if fp8 is not None:
        fused |= dict(w_scale_ptr=fp8.scale, W_SCALE=True)
        if fp8.activations != "none":
            x, x_scale = quantize_tokens(x, fp8)
            fused |= dict(x_scale_ptr=x_scale, X_SCALE=True)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if norm is not None:
        parts = norm.sum_squares
        fused |= dict(stats_ptr=parts, n_stats=parts.shape[1], eps=norm.eps, NORM=True,
                      STATS_PAD=triton.next_power_of_2(parts.shape[1]))
        if norm.weight is not None:
            fused |= dict(g_ptr=norm.weight.contiguous(), NORM_WEIGHT=True)
    if residual is not None:
        sum_squares = torch.empty((m, tiles_n), dtype=torch.float32, device=x.device)
        fused |= dict(res_ptr=residual, stats_out_ptr=sum_squares, RESIDUAL=True)
    _skinny_gemm_kernel[(tiles_n, split, tiles_m)](
        x, weight, bias if bias is not None else weight, y, ws, counts,
        m, n, k, k_per_split, split, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1, EVEN_K=k % k_per_split == 0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, INTERPRET=_INTERPRET,
        MODE=KERNELS.index(config.kernel), FMA_PREFETCH=config.kernel == "fma" and config.num_stages > 1,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_args(x.device), **rotary_args,
        **fused,
    )
    return y if residual is None else (y, sum_squares)


# The multiprocessors a config is planned for where no GPU is (Triton's interpreter).
_INTERPRETER_MULTIPROCESSORS = 132
# A split of K in two streams at least this many columns a half (see `config_for`).
_SPLIT_MIN_COLUMNS = 6144


def config_for(m: int, n: int, k: int, multiprocessors: int, weight_bytes: int = 2,
               shared_bytes: int | None = None) -> GemmConfig | None:
    """The config of an [m, k] @ [n, k].T product on a GPU of `multiprocessors`
    multiprocessors, for a weight of `weight_bytes` bytes an element (2: the model's
    dtype; 1: FP8, `fp8_rule_config`): `rule_config`'s; None above MAX_ROWS rows (cuBLAS,
    or for FP8 the prefill GEMM, takes those). A function of the shape and the row count
    alone: fixed for each captured bucket. With `shared_bytes` (the shared memory a block
    may take on the GPU), a pipeline deeper than fits keeps fewer stages: the rules were
    measured on GPUs of 227 KiB, and a kernel that asks for more than the GPU has does not
    compile (an L40S or an RTX card gives a block 99 KiB)."""
    config = rule_config(m, n, k, multiprocessors, weight_bytes)
    if config is None or shared_bytes is None:
        return config
    stages = config.num_stages
    while stages > 1 and pipeline_bytes(replace(config, num_stages=stages), m, weight_bytes) > shared_bytes:
        stages -= 1
    return replace(config, num_stages=stages)


def pipeline_bytes(config: GemmConfig, m: int, weight_bytes: int) -> int:
    """The shared memory a config's software pipeline takes at most: each stage a weight
    tile and an activation tile (float32 activations for a float32 weight, else 16-bit).
    Triton's own figure is at most this (a stage less, plus an activation tile where the
    tensor cores take it from shared memory)."""
    activation_bytes = 4 if weight_bytes == 4 else 2
    return config.num_stages * config.block_k * (config.block_n * weight_bytes + block_m_of(config, m) * activation_bytes)


def rule_config(m: int, n: int, k: int, multiprocessors: int, weight_bytes: int = 2) -> GemmConfig | None:
    """`config_for`'s rule, from the shape and the device's multiprocessors.

    The product is bound by its weight read, so the config keeps every multiprocessor
    streaming weight rows with as much of them in flight as fits:

    - 64-row tiles of 128-column steps four stages deep, by default;
    - 128-row tiles where there are plenty of them (at least 1.75 waves at 17-32 rows,
      4 waves up to 16): fewer, longer programs (the LM heads);
    - where the 64-row tiles fill at most every multiprocessor (Llama-3-8B's qkv), six
      stages, and where they fill at most half (o and down): seven stages up to 16 rows,
      and at 17-32 rows, whose 32-row activation tile takes the shared memory of the
      deep pipeline, 256-column steps four deep, with K split in two where each half
      still streams at least `_SPLIT_MIN_COLUMNS` columns (Llama-3-8B's down, not
      Llama-2-7B's);
    - a float32 weight streams half the columns, the same bytes a stage;
    - an FP8 weight has a rule of its own (`fp8_rule_config`).

    What each choice measured against its alternatives is in docs/lab/kernels.md."""
    if not 1 <= m <= MAX_ROWS:
        return None
    if weight_bytes == 1:
        return fp8_rule_config(m, n, k, multiprocessors)
    tall = m > 16
    if n >= 128 * multiprocessors * (7 / 4 if tall else 4):
        config = GemmConfig(128, 128, 1, 4, 4)
    else:
        tiles = triton.cdiv(n, 64)
        if 2 * tiles <= multiprocessors:
            if not tall:
                config = GemmConfig(64, 128, 1, 4, 7)
            else:
                config = GemmConfig(64, 256, 2 if k >= 2 * _SPLIT_MIN_COLUMNS else 1, 4, 4)
        elif tiles <= multiprocessors:
            config = GemmConfig(64, 128, 1, 4, 6)
        else:
            config = GemmConfig(64, 128, 1, 4, 4)
    if weight_bytes == 4:
        # A float32 model (the tests' exact path on CUDA): half the columns a step, so
        # that each stage holds the bytes of the bf16 config (seven stages of 128 float32
        # columns need 280 KiB of shared memory, past an H100's 227).
        config = replace(config, block_k=config.block_k // 2)
    return config


# The CUDA-core form at one row splits K until its programs fill the multiprocessors this
# many times over, each split at least `_FMA_SPLIT_MIN_COLUMNS` columns.
_FMA_WAVES = 4
_FMA_SPLIT_MIN_COLUMNS = 1024


def fp8_rule_config(m: int, n: int, k: int, multiprocessors: int) -> GemmConfig | None:
    """`rule_config` for an FP8 weight [n, k] at m rows, from its 64-row weight tiles
    per multiprocessor (`waves`, N / 64 over the multiprocessors) and the row count.

    Every form multiplies in float16 (`GemmConfig.kernel`): E4M3 converts to it one
    instruction a pair, and no product measured a bf16-converting form faster. By rows:

    - one row, where the 64-row tiles are at most one wave or more than three: the CUDA
      cores (`fma`: no activation padded to 16 rows, the weight straight into
      registers), 16-row tiles of 256 columns, each tile loaded when used (no prefetch),
      K split in powers of two until the programs fill the multiprocessors `_FMA_WAVES`
      times over; between one and three waves the config of 2-16 rows (there the sweep
      timed the fma form only with prefetch, and it lost);
    - 2-16 rows (a 16-row activation tile): up to one wave, W the tensor cores' first
      operand in 32-row tiles of 256 columns (twice the programs of 64-row tiles, so
      that every multiprocessor streams), seven stages deep up to half a wave and six up
      to one (as the bf16 rule's); above, 64-row tiles with W the second operand
      (`dot_f16_t`, its shared-memory reads 8 bytes wide), 256 columns four deep up to
      two waves and 128 columns four deep up to three; beyond three waves, W the first
      operand in 32-row tiles of 256 columns four deep;
    - 17-32 rows (a 32-row activation tile): W the first operand in 64-row tiles, 256
      columns four deep with K split in two up to half a wave (the programs then fill
      the multiprocessors), five deep up to one wave; above, 128 columns four deep,
      except between two and three waves: W the second operand, 256 columns three deep.

    Each band's config is the one an H100 sweep of the Llama-2-7B and Llama-3-8B
    projections at 1-32 rows timed near the fastest at each of the band's products; the
    bands above one wave hold one measured shape each (Llama-2-7B's qkv, its gate_up,
    Llama-3-8B's gate_up), so their bounds lie between those. The per-product times
    against the fastest, and the sweep's command, are in docs/lab/kernels.md ("FP8
    decode configs: a rule instead of the table")."""
    if not 1 <= m <= MAX_ROWS:
        return None
    tiles = triton.cdiv(n, 64)
    waves = tiles / multiprocessors
    if m == 1 and (waves <= 1 or waves > 3):
        programs, split = triton.cdiv(n, 16), 1
        while programs * split < _FMA_WAVES * multiprocessors and k // (2 * split) >= _FMA_SPLIT_MIN_COLUMNS:
            split *= 2
        return GemmConfig(16, 256, split, 4, 1, kernel="fma")
    if m <= 16:
        if waves <= 1:
            return GemmConfig(32, 256, 1, 4, 7 if 2 * tiles <= multiprocessors else 6, kernel="dot_f16")
        if waves <= 2:
            return GemmConfig(64, 256, 1, 4, 4, kernel="dot_f16_t")
        if waves <= 3:
            return GemmConfig(64, 128, 1, 4, 4, kernel="dot_f16_t")
        return GemmConfig(32, 256, 1, 4, 4, kernel="dot_f16")
    if 2 * tiles <= multiprocessors:
        return GemmConfig(64, 256, 2, 4, 4, kernel="dot_f16")
    if waves <= 1:
        return GemmConfig(64, 256, 1, 4, 5, kernel="dot_f16")
    if 2 < waves <= 3:
        return GemmConfig(64, 256, 1, 4, 3, kernel="dot_f16_t")
    return GemmConfig(64, 128, 1, 4, 4, kernel="dot_f16")


@functools.cache
def _shared_bytes(device: torch.device) -> int | None:
    """The shared memory a block may take on `device` (None where no GPU is: the
    interpreter has no limit)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_MULTIPROCESSORS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def config_of(m: int, weight: torch.Tensor | Fp8Weight) -> GemmConfig | None:
    """`config_for` an [m, K] input to `weight` [N, K] on the weight's device."""
    w = weight.weight if isinstance(weight, Fp8Weight) else weight
    return config_for(m, *w.shape, _multiprocessors(w.device), w.element_size(), _shared_bytes(w.device))


def _compile_every_bucket(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None,
                          rotary: RotaryArgs | None = None, norm: FoldedNorm | None = None,
                          residual: torch.Tensor | None = None) -> None:
    """Launch each kernel variant this shape's row counts can pick (each config at each
    tile height its row counts give, `block_m_of`) once, on the first eager call: a graph
    captured later for another row count then finds its kernel compiled and loaded
    instead of compiling inside the capture. The launches run on zero rows; a rotary
    variant's slots are all -1, so it writes nothing to the caches."""
    w = weight.weight if isinstance(weight, Fp8Weight) else weight
    key = ("gemm", tuple(w.shape), w.dtype, x.device, bias is not None, residual is not None,
           pdl.enabled(x.device))
    if isinstance(weight, Fp8Weight):
        key += (weight.activations,)
    if rotary is not None:
        key += (rotary.num_heads, rotary.num_kv_heads, rotary.head_dim, rotary.k_cache.dtype)
    if norm is not None:
        key += (triton.next_power_of_2(norm.sum_squares.shape[1]), norm.weight is not None)
    if not first_eager_call(key, x.device):
        return
    if rotary is not None:
        rotary = RotaryArgs(
            rotary.num_heads, rotary.num_kv_heads, rotary.head_dim,
            torch.zeros(MAX_ROWS, dtype=rotary.positions.dtype, device=x.device),
            torch.full((MAX_ROWS,), -1, dtype=rotary.slot_mapping.dtype, device=x.device),
            rotary.k_cache, rotary.v_cache, rotary.cos, rotary.sin,
        )
    if norm is not None:
        parts = torch.zeros((MAX_ROWS, norm.sum_squares.shape[1]), dtype=torch.float32, device=x.device)
        norm = FoldedNorm(norm.eps, parts, norm.weight)
    rows = torch.zeros((MAX_ROWS, w.shape[1]), dtype=x.dtype, device=x.device)
    sums = None if residual is None else torch.zeros((MAX_ROWS, w.shape[0]), dtype=x.dtype, device=x.device)
    seen = set()
    for m in range(1, MAX_ROWS + 1):
        config = config_of(m, weight)
        if config is not None and (config, block_m_of(config, m)) not in seen:
            seen.add((config, block_m_of(config, m)))
            launch(rows[:m], weight, bias, config, rotary, norm, None if sums is None else sums[:m])


def skinny(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None, **fused):
    """`launch` with `config_of` x's row count (the keywords: its `rotary`, `norm` or
    `residual`; `weight` in x's dtype or FP8); None where there is none or the kernel
    cannot run (also for CPU tensors outside Triton's interpreter)."""
    if x.dim() != 2 or not (x.is_cuda or _INTERPRET):
        return None
    config = config_of(x.shape[0], weight)
    if config is None:
        return None
    if x.is_cuda:
        _compile_every_bucket(x, weight, bias, **fused)
    return launch(x, weight, bias, config, **fused)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K]: the skinny kernel up to MAX_ROWS rows, else
    cuBLAS's first-choice algorithm (`F.linear`; what chosen cuBLASLt algorithms saved
    over it on two GPUs, and why they went, is in docs/lab/kernels.md)."""
    y = skinny(x, weight, bias) if x.is_cuda else None
    return F.linear(x, weight, bias) if y is None else y


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ W_gate.T) * (x @ W_up.T) for W = [W_gate; W_up] [2I, K] (a fused
    gate_up_proj) and x [M, K]: the projection, then `triton_ops.silu_and_mul`."""
    from hybridd.kernels import triton_ops

    return triton_ops.silu_and_mul(linear(x, weight))
