"""A decode step's MLP as one persistent kernel: the gate/up projection with its norm and
SiLU·mul, a grid barrier, then the down projection with the residual add.

Every kernel of a decode step costs time beside reading its weights: the last programs of
one finish while the memory idles, and the next one's first loads start from nothing.
Reading a layer's bytes as one kernel whose programs, all resident, meet at a grid
barrier between phases saved 1.6-2.0 µs a boundary on an H100, but only where each
program loaded the first block of its next weights before it waited at the barrier
(`scripts/bench_kernel_boundary.py`, docs/kernels.md). The MLP is the one place of a
layer where the phase after the barrier reads nothing but its weights and the phase
before's product: this kernel runs it so.

One program per multiprocessor (`PER_SM`), launched as a cooperative grid so that all
are resident at once (the barrier's premise). Phase 1: the programs take gate/up tiles in
turn (rows alternating gate and up, as `triton_gemm`'s gated epilogue), scale each row by
its folded norm's 1 / rms and store silu(gate) * up to a scratch activation. Phase 2: each
program takes at most one down tile of one K split, loads its first weight block, waits
at the barrier, reads the activation through L2 (it was written by other programs of
this launch), and the last split of a tile to arrive sums the splits, adds the residual
and leaves each row's sum of squares in parts, as `triton_gemm.launch`'s `residual`.
The result rounds where the gated gate/up kernel and the down kernel with the residual
round; only the split's float32 sum order may differ.

Triton's CPU interpreter runs programs one after another, so a grid barrier cannot
complete there: it runs the two phases as two launches of the same kernel instead.

On an H100 the kernel measured within a percent of the three kernels it replaces (the
decode step 0.2-0.6 % shorter for Llama-2-7B, 1.3 % longer for Llama-3-8B, whose down
phase of two long K splits loses): it takes the sum of its phases' times, the early block changes nothing, and its gate/up
phase, one program a multiprocessor taking tiles in turn, is slower than the gate/up
kernel's grid of 344 programs; two a multiprocessor would match it, but the cooperative
launch refuses that grid (`scripts/bench_mlp.py`, docs/kernels.md, "The MLP as one
kernel"). So the `mlp` fusion is off by default. The config is the one measured fastest
alone (64-row tiles, gate/up 256 columns a step three deep, down 128 four deep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridd import environment
from hybridd.kernels import pdl, split_scratch
from hybridd.kernels.pdl import wait_for_predecessor
from hybridd.kernels.triton_gemm import FoldedNorm, _store_residual_add, _store_silu_and_mul

_INTERPRET = environment.flag("TRITON_INTERPRET")
MAX_ROWS = 16
# Each program loads the first block of its down weights before the barrier.
EARLY = True
# Programs a multiprocessor runs (all resident, for the barrier): one keeps the grid
# within any GPU's occupancy; more keep more loads in flight per multiprocessor.
PER_SM = 1
# Float32 partials of the down splits, and per-tile counters (split_scratch).
_WORKSPACE_FLOATS = 1 << 19
_COUNTERS = 1 << 12


@dataclass(frozen=True)
class MlpConfig:
    """The tiles of the two phases: gate/up tiles of `gate_up_block_n` weight rows (half
    gate, half up) in `gate_up_block_k` columns a step, `gate_up_stages` deep; down tiles
    of `down_block_n` rows in `down_block_k` columns a step, `down_stages` deep."""

    gate_up_block_n: int = 64
    gate_up_block_k: int = 256
    gate_up_stages: int = 4
    down_block_n: int = 64
    down_block_k: int = 128
    down_stages: int = 7
    num_warps: int = 4


CONFIG = MlpConfig(gate_up_stages=3, down_stages=4)


@triton.jit
def _grid_barrier(barrier_ptr, programs):
    """Return once every one of `programs` programs has called this. barrier[0] counts the
    arrivals and barrier[1] is the generation: the last to arrive re-arms the count for the
    next launch and starts a new generation, which the others wait for."""
    tl.debug_barrier()  # every thread's stores of this program come before its arrival
    generation = tl.atomic_add(barrier_ptr + 1, 0, sem="acquire", scope="gpu")
    arrived = tl.atomic_add(barrier_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == programs - 1:
        tl.atomic_xchg(barrier_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(barrier_ptr + 1, 1, sem="release", scope="gpu")
    else:
        seen = generation
        while seen == generation:
            seen = tl.atomic_add(barrier_ptr + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["M"])
def _fused_mlp_kernel(
    x_ptr, w_gu_ptr, w_d_ptr, h_ptr, y_ptr, res_ptr, stats_ptr, stats_out_ptr, ws_ptr, count_ptr, barrier_ptr,
    M, n_stats, eps, stride_xm,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, STATS_PAD: tl.constexpr,
    GU_BLOCK_N: tl.constexpr, GU_BLOCK_K: tl.constexpr, GU_STAGES: tl.constexpr,
    D_BLOCK_N: tl.constexpr, D_BLOCK_K: tl.constexpr, D_STAGES: tl.constexpr, SPLIT: tl.constexpr,
    PHASES: tl.constexpr, EARLY: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """PHASES 3: both phases with the barrier between; 1 or 2: that phase alone."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    wait_for_predecessor(PDL)
    if PHASES & 1:
        j = tl.arange(0, STATS_PAD)
        parts = tl.load(stats_ptr + offs_m[:, None] * n_stats + j[None, :],
                        mask=mask_m[:, None] & (j < n_stats)[None, :], other=0.0)
        inv_rms = 1.0 / tl.sqrt(tl.sum(parts, axis=1) / HIDDEN + eps)
        offs_k = tl.arange(0, GU_BLOCK_K)
        r = tl.arange(0, GU_BLOCK_N)
        a_rows = x_ptr + offs_m[:, None] * stride_xm
        tiles = INTER // (GU_BLOCK_N // 2)
        t = pid
        while t < tiles:
            # Rows alternate gate row c, up row c, for output columns c of this tile.
            offs_n = t * (GU_BLOCK_N // 2) + r // 2 + (r % 2) * INTER
            w_rows = w_gu_ptr + offs_n[:, None].to(tl.int64) * HIDDEN
            acc = tl.zeros((GU_BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k in tl.range(0, HIDDEN, GU_BLOCK_K, num_stages=GU_STAGES):
                w = tl.load(w_rows + (k + offs_k)[None, :], eviction_policy="evict_first")
                a = tl.load(a_rows + (k + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
                acc = tl.dot(w, tl.trans(a), acc)
            # The norm's weight is folded into W: what is left is one scale per row.
            acc = acc * inv_rms[None, :]
            _store_silu_and_mul(h_ptr, acc, offs_m, t, mask_m, INTER, INTER, GU_BLOCK_N // 2, BLOCK_M)
            t += programs
    if PHASES & 2:
        tiles_d: tl.constexpr = HIDDEN // D_BLOCK_N
        k_per_split: tl.constexpr = INTER // SPLIT
        pid_n = pid % tiles_d
        pid_k = pid // tiles_d
        active = pid < tiles_d * SPLIT
        offs_n = pid_n * D_BLOCK_N + tl.arange(0, D_BLOCK_N)
        mask_n = offs_n < HIDDEN
        offs_k = tl.arange(0, D_BLOCK_K)
        k_start = pid_k * k_per_split
        w_rows = w_d_ptr + offs_n[:, None].to(tl.int64) * INTER + k_start
        h_rows = h_ptr + offs_m[:, None] * INTER + k_start
        if EARLY:
            # No kernel writes the weights: this block is on its way while the last
            # programs of phase 1 finish.
            w_first = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & active, other=0.0,
                              eviction_policy="evict_first")
        if PHASES == 3:
            _grid_barrier(barrier_ptr, programs)
        if active:
            acc = tl.zeros((D_BLOCK_N, BLOCK_M), dtype=tl.float32)
            if EARLY:
                # The activation was stored by other programs of this launch: read through L2.
                a = tl.load(h_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
                acc = tl.dot(w_first, tl.trans(a), acc)
            for k in tl.range(EARLY * D_BLOCK_K, k_per_split, D_BLOCK_K, num_stages=D_STAGES):
                w = tl.load(w_rows + (k + offs_k)[None, :], eviction_policy="evict_first")
                a = tl.load(h_rows + (k + offs_k)[None, :], mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
                acc = tl.dot(w, tl.trans(a), acc)
            if SPLIT > 1:
                # As the split skinny kernel: every split stores its partial, the last to
                # arrive for the tile sums them in split order and re-arms the counter.
                ws_n = ws_ptr + offs_m[None, :] * HIDDEN + offs_n[:, None]
                tl.store(ws_n + pid_k * BLOCK_M * HIDDEN, acc)
                tl.debug_barrier()
                arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
                if arrived == SPLIT - 1:
                    acc = tl.zeros((D_BLOCK_N, BLOCK_M), dtype=tl.float32)
                    for s in tl.static_range(SPLIT):
                        acc += tl.load(ws_n + s * BLOCK_M * HIDDEN, cache_modifier=".cg")
                    tl.atomic_xchg(count_ptr + pid_n, 0)
                    _store_residual_add(y_ptr, w_d_ptr, res_ptr, stats_out_ptr, acc, offs_m, offs_n, pid_n, mask_m,
                                        mask_n, HIDDEN, tiles_d, False)
            else:
                _store_residual_add(y_ptr, w_d_ptr, res_ptr, stats_out_ptr, acc, offs_m, offs_n, pid_n, mask_m, mask_n,
                                    HIDDEN, tiles_d, False)


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any count shows the work's division
    return PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _split(config: MlpConfig, hidden: int, inter: int, programs: int) -> int:
    """The most K splits of the down projection that give every tile an even share of
    whole blocks and every split a program of its own (0: none does)."""
    tiles = hidden // config.down_block_n
    blocks = inter // config.down_block_k
    for split in range(programs // tiles if tiles else 0, 0, -1):
        if blocks % split == 0:
            return split
    return 0


def fused_mlp(x: torch.Tensor, norm: FoldedNorm, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
              residual: torch.Tensor, config: MlpConfig | None = None, phases: int = 3):
    """(residual + down(silu(gate) * up of x, normalised by `norm`), the sum's rows' sums of
    squares in parts [M, down tiles]), as `triton_gemm`'s gated gate/up and its down
    projection with `residual` give them; None where this kernel cannot run the shapes
    (the caller takes those two kernels): more than MAX_ROWS rows, tiles that do not divide
    the weights, or scratch missing during capture. `config`: CONFIG by default. `phases`
    1 or 2 launches that phase alone, without the barrier (to time it; the result is then
    incomplete)."""
    if phases not in (1, 2, 3):
        raise ValueError(f"phases must be 1, 2 or 3, got {phases!r}")
    c = config or CONFIG
    m, hidden = x.shape
    inter = gate_up_weight.shape[0] // 2
    if not (x.is_cuda or _INTERPRET) or m == 0 or m > MAX_ROWS:
        return None
    if gate_up_weight.shape != (2 * inter, hidden) or down_weight.shape != (hidden, inter):
        raise ValueError(f"an MLP of hidden size {hidden} needs gate/up [{2 * inter}, {hidden}] and down "
                         f"[{hidden}, {inter}] weights, got {tuple(gate_up_weight.shape)} and "
                         f"{tuple(down_weight.shape)}")
    if residual.shape != (m, hidden) or norm.sum_squares.shape[0] < m:
        raise ValueError(f"an MLP of {m} rows needs a [{m}, {hidden}] residual and {m} rows of sums of squares")
    if (hidden % c.gate_up_block_k or inter % (c.gate_up_block_n // 2) or hidden % c.down_block_n
            or inter % c.down_block_k or not x.is_contiguous() or not residual.is_contiguous()
            or not norm.sum_squares.is_contiguous() or not gate_up_weight.is_contiguous()
            or not down_weight.is_contiguous()):
        return None
    programs = _programs(x.device)
    split = _split(c, hidden, inter, programs)
    if split == 0:
        return None
    block_m = MAX_ROWS  # one tile height: tl.dot takes no fewer than 16 rows
    tiles_d = hidden // c.down_block_n
    counts = split_scratch.scratch(x.device, "mlp_counters", _COUNTERS, torch.int32)
    barrier = split_scratch.scratch(x.device, "mlp_barrier", 2, torch.int32)
    ws = split_scratch.scratch(x.device, "mlp_partials", _WORKSPACE_FLOATS, torch.float32)
    if counts is None or barrier is None or ws is None or split * block_m * hidden > ws.numel() or tiles_d > _COUNTERS:
        return None
    h = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    sum_squares = torch.empty((m, tiles_d), dtype=torch.float32, device=x.device)
    parts = norm.sum_squares
    args = (x, gate_up_weight, down_weight, h, y, residual, parts, sum_squares, ws, counts, barrier,
            m, parts.shape[1], norm.eps, x.stride(0))
    meta = dict(HIDDEN=hidden, INTER=inter, BLOCK_M=block_m, STATS_PAD=triton.next_power_of_2(parts.shape[1]),
                GU_BLOCK_N=c.gate_up_block_n, GU_BLOCK_K=c.gate_up_block_k, GU_STAGES=c.gate_up_stages,
                D_BLOCK_N=c.down_block_n, D_BLOCK_K=c.down_block_k, D_STAGES=c.down_stages, SPLIT=split,
                EARLY=EARLY, INTERPRET=_INTERPRET, num_warps=c.num_warps)
    if _INTERPRET:
        for phase in (1, 2):
            if phase & phases:
                _fused_mlp_kernel[(programs,)](*args, PHASES=phase, PDL=False, **meta)
    else:
        # Cooperative: the driver refuses a grid that cannot be resident at once, where a
        # plain launch would leave the barrier waiting for programs that never start.
        _fused_mlp_kernel[(programs,)](*args, PHASES=phases, launch_cooperative_grid=phases == 3,
                                       **pdl.launch_args(x.device), **meta)
    return y, sum_squares
