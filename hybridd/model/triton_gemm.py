"""Skinny projections for decode: y = x @ W.T for a few token rows, at the weight-read limit.

With M <= 32 rows the product is bound by reading W [N, K] (as `nn.Linear` stores it)
once. Each program streams a [BLOCK_N, K / split] slab of W through the pipelined loads
and multiplies it by the tiny activation tile on the tensor cores (the activation is
padded to BLOCK_M = 16 or 32 rows, which costs nothing at this intensity). Where the
N tiles alone cannot fill the GPU (o_proj, down_proj) K is split; the split programs
store float32 partials and the last one to arrive for an N tile (a per-tile counter,
reset by that program) sums them and writes the output, so a split product is one
kernel with no memset and no reduce launch, and its launch grid depends only on the
shape: safe to capture in a CUDA graph. For a fused gate/up projection the kernel can
also compute the MLP's SiLU·mul in its epilogue (`linear_silu_and_mul`): each tile takes
its rows alternately from the gate and the up half of W, so it holds both halves of its
output columns.

Configs per (N, K) and row count come from `scripts/bench_gemm.py`'s sweep on the H200
(`_TABLE`); a shape or row count without an entry, or where cuBLAS measured faster,
goes to cuBLAS (`F.linear`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridd.model import pdl, split_scratch
from hybridd.model.pdl import wait_for_predecessor

MAX_ROWS = 32
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
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


@triton.jit
def _multiply_add(acc, w_rows, x_ptr, offs_m, k_idx, mask_m, mask_n, stride_xm, K, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += W[n, k_idx] @ x[m, k_idx].T; the weight is read once, so it
    is evicted first."""
    a_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_idx[None, :]
    if EVEN_K:
        w = tl.load(w_rows + k_idx[None, :], mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
    else:
        mask_k = k_idx < K
        w = tl.load(
            w_rows + k_idx[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first"
        )
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    return tl.dot(w, tl.trans(a), acc)


@triton.jit
def _store_out(y_ptr, b_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


@triton.jit
def _store_silu_and_mul(y_ptr, acc, offs_m, pid_n, mask_m, n_out, stride_ym, HALF: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """y = silu(gate) * up from a tile whose rows alternate gate, up; rounded where the
    separate kernels round (the product stored in the activation dtype, then
    `triton_ops.silu_and_mul`), so the fused result is theirs bit for bit."""
    dt = y_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(acc, (HALF, 2, BLOCK_M)), (0, 2, 1)))
    g = gate.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt)
    out = (s.to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)
    cols = pid_n * HALF + tl.arange(0, HALF)
    ptrs = y_ptr + offs_m[None, :] * stride_ym + cols[:, None]
    tl.store(ptrs, out, mask=mask_m[None, :] & (cols < n_out)[:, None])


@triton.jit
def _prefetch_to_l2(ptrs, nbytes):
    """Start copying `nbytes` from each of `ptrs` into L2 (Hopper's bulk prefetch; no
    registers, no waiting)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, count_ptr,
    M, N, K, k_per_split, split_k, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr, W_BYTES: tl.constexpr, GATED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    if GATED:
        # Rows alternate between the gate half of W and the up half: row 2j is gate row
        # c and row 2j+1 up row c, for the tile's output column c = pid_n * BLOCK_N/2 + j.
        r = tl.arange(0, BLOCK_N)
        cols_out = pid_n * (BLOCK_N // 2) + r // 2
        offs_n = cols_out + (r % 2) * (N // 2)
        mask_n = cols_out < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    k_start = pid_k * k_per_split
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    if PREFETCH_K > 0:
        # The weights are never written by a step: their first columns can be on their
        # way to L2 while the previous kernel still runs.
        rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * K + k_start
        cols = tl.minimum(tl.minimum(k_per_split, K - k_start), PREFETCH_K)
        _prefetch_to_l2(rows, tl.full([BLOCK_N], 0, tl.int32) + cols * W_BYTES)
    wait_for_predecessor(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The last split may run past K: its loads there are masked off (EVEN_K: never happens).
    if INTERPRET:
        # Triton's CPU interpreter cannot take a runtime loop bound in range(); a while
        # loop is not software-pipelined when compiled, so it serves the interpreter only.
        k = 0
        while k < k_per_split:
            acc = _multiply_add(acc, w_rows, x_ptr, offs_m, k_start + k + offs_k, mask_m, mask_n, stride_xm, K, EVEN_K)
            k += BLOCK_K
    else:
        for k in range(0, k_per_split, BLOCK_K):
            acc = _multiply_add(acc, w_rows, x_ptr, offs_m, k_start + k + offs_k, mask_m, mask_n, stride_xm, K, EVEN_K)
    if SPLIT:
        # Every split stores its partial; the last to arrive for this N tile sums the others
        # into its own, writes y and re-arms the counter for the next launch.
        ws_n = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_n + pid_k * BLOCK_M * N, acc, mask=mask_n[:, None])
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:
            s = 0
            while s < split_k:
                if s != pid_k:
                    acc += tl.load(ws_n + s * BLOCK_M * N, mask=mask_n[:, None], other=0.0, cache_modifier=".cg")
                s += 1
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _store_out(y_ptr, b_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)
    elif GATED:
        _store_silu_and_mul(y_ptr, acc, offs_m, pid_n, mask_m, N // 2, stride_ym, BLOCK_N // 2, BLOCK_M)
    else:
        _store_out(y_ptr, b_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


# Columns of its weight rows each program prefetches into L2 before waiting for the
# previous kernel (0: none). The prefetch runs only under PDL, where the wait overlaps it.
PREFETCH_COLUMNS = int(os.environ.get("HYBRIDD_GEMM_PREFETCH_K", "512"))


def _prefetch_columns(weight: torch.Tensor, config: GemmConfig) -> int:
    """The bulk prefetch copies whole 16-byte units from 16-byte aligned addresses."""
    k = weight.shape[1]
    size = weight.element_size()
    if not pdl.enabled(weight.device) or (k * size) % 16 or weight.data_ptr() % 16:
        return 0
    return max(0, PREFETCH_COLUMNS - PREFETCH_COLUMNS % (16 // size))


def launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig, gated: bool = False
) -> torch.Tensor | None:
    """The skinny product with an explicit config; None where it cannot run (the caller
    falls back to cuBLAS): too many rows, a weight not stored row-major as `nn.Linear`
    keeps it, or split-K scratch missing during capture. `gated`: W stacks a gate and an
    up projection ([2I, K], as a fused gate_up_proj) and the result is silu(gate) * up
    [M, I], computed in the product's epilogue; a split or a bias is not supported there."""
    m = x.shape[0]
    n, k = weight.shape
    if m == 0 or m > MAX_ROWS or x.shape[1] != k or weight.stride() != (k, 1):
        return None
    if gated and (bias is not None or n % 2 or config.block_n < 2):
        return None
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_m = 16 if m <= 16 else 32
    tiles_n = triton.cdiv(n // 2, config.block_n // 2) if gated else triton.cdiv(n, config.block_n)
    split = max(1, min(config.split_k, triton.cdiv(k, config.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    if gated and split > 1:
        return None
    if split > 1:
        if split * block_m * n > _WORKSPACE_FLOATS or tiles_n > _COUNTERS:
            return None
        ws = split_scratch.scratch(x.device, "gemm_partials", _WORKSPACE_FLOATS, torch.float32)
        counts = split_scratch.scratch(x.device, "gemm_counters", _COUNTERS, torch.int32)
        if ws is None or counts is None:
            return None
    else:
        ws, counts = x, x
    y = torch.empty((m, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(tiles_n, split)](
        x, weight, bias if bias is not None else weight, y, ws, counts,
        m, n, k, k_per_split, split, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1, EVEN_K=k % k_per_split == 0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, INTERPRET=_INTERPRET,
        PREFETCH_K=_prefetch_columns(weight, config), W_BYTES=weight.element_size(), GATED=gated,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_args(x.device),
    )
    return y


# (N, K) -> [(largest row count, config or None for cuBLAS), ...] ascending, from
# `python scripts/bench_gemm.py --sweep` on the H200 (2026-12-01); where configs were within
# the run-to-run spread of each other, one config serves all row counts.
_TABLE: dict[tuple[int, int], list[tuple[int, GemmConfig | None]]] = {
    # o_proj of both models
    (4096, 4096): [(32, GemmConfig(64, 256, 1, 4, 4))],
    # Llama-2-7B
    (12288, 4096): [(32, GemmConfig(64, 128, 1, 4, 4))],
    (22016, 4096): [(8, GemmConfig(64, 256, 1, 4, 4)), (32, None)],
    (4096, 11008): [(32, GemmConfig(64, 256, 1, 4, 4))],
    (32000, 4096): [(16, GemmConfig(64, 128, 1, 4, 4)), (32, GemmConfig(128, 128, 1, 4, 4))],
    # Llama-3-8B
    (6144, 4096): [(32, GemmConfig(64, 128, 1, 4, 6))],
    (28672, 4096): [(32, GemmConfig(64, 128, 1, 4, 4))],
    (4096, 14336): [(16, GemmConfig(64, 256, 1, 4, 4)), (32, GemmConfig(64, 256, 2, 4, 4))],
    (128256, 4096): [(32, GemmConfig(128, 128, 1, 4, 4))],
}


def config_for(m: int, n: int, k: int) -> GemmConfig | None:
    for rows, config in _TABLE.get((n, k), ()):
        if m <= rows:
            return config
    return None


_compiled: set[tuple] = set()


def _compile_every_bucket(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          gated: bool = False) -> None:
    """Launch each kernel variant this shape's table can pick (its config at BLOCK_M 16 and
    32) once, on the first eager call: a graph captured later for another row count then
    finds its kernel compiled and loaded instead of compiling inside the capture."""
    key = (tuple(weight.shape), weight.dtype, x.device, bias is not None, gated)
    if key in _compiled or torch.cuda.is_current_stream_capturing():
        return
    _compiled.add(key)
    rows = torch.zeros((MAX_ROWS, weight.shape[1]), dtype=x.dtype, device=x.device)
    seen = set()
    for m in range(1, MAX_ROWS + 1):
        config = config_for(m, *weight.shape)
        if config is not None and (config, m <= 16) not in seen:
            seen.add((config, m <= 16))
            launch(rows[:m], weight, bias, config, gated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K]; the skinny kernel where the table has a config."""
    if x.dim() == 2 and x.is_cuda:
        config = config_for(x.shape[0], *weight.shape)
        if config is not None:
            _compile_every_bucket(x, weight, bias)
            y = launch(x, weight, bias, config)
            if y is not None:
                return y
    return F.linear(x, weight, bias)


# Whether `linear_silu_and_mul` computes SiLU·mul in the product's epilogue (one kernel)
# or runs the separate kernel after it; the two give the same bits. Off unless
# HYBRIDD_FUSE_SILU_AND_MUL=1: `python scripts/bench_gemm.py --skip-compare --decode-step`
# on the H200 timed the fused 7B decode step 0.6 % slower than the two kernels (the
# epilogue's shuffle of gate and up rows costs more than the launch it saves);
# `scripts/bench.py`'s `hybridd_silu` part measures it at the client.
def _switch(name: str) -> bool:
    """An on/off environment variable: "1" or "0" (unset: "0")."""
    value = os.environ.get(name, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 1 (on) or 0 (off), got {value!r}")
    return value == "1"


FUSE_SILU_AND_MUL = _switch("HYBRIDD_FUSE_SILU_AND_MUL")


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ W_gate.T) * (x @ W_up.T) for W = [W_gate; W_up] [2I, K] (a fused
    gate_up_proj) and x [M, K]: one skinny kernel where the table has a config, else
    the projection and then `triton_ops.silu_and_mul`."""
    if FUSE_SILU_AND_MUL and x.dim() == 2 and x.is_cuda:
        config = config_for(x.shape[0], *weight.shape)
        if config is not None:
            _compile_every_bucket(x, weight, None, gated=True)
            y = launch(x, weight, None, config, gated=True)
            if y is not None:
                return y
    from hybridd.model import triton_ops

    return triton_ops.silu_and_mul(linear(x, weight))
