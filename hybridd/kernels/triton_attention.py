"""Graph-safe paged attention in Triton: decode over block tables ("flash-decoding")
and prefill over the packed step (varlen flash attention, no T×T mask).

Decode: each program handles one (sequence, kv head, split); the query heads of the kv
head's group share each key/value tile it reads. It walks its share of the sequence's
tokens through the block table; the sequence length and the block table are read from
device memory, so a graph captured once serves every length. With one split the program
writes the output itself; with several, each writes its partial output and log-sum-exp
and the last split of a (sequence, kv head) to finish merges them, the whole group's
heads at once (a ticket counter, reset by that same program), so a step is one launch
either way. The grid depends only on the batch bucket, the kv heads and the split count,
all fixed per captured graph.

Prefill: each program handles a tile of one sequence's query rows for one head and walks
that sequence's keys up to the tile's last position, so a sequence's rows may start
anywhere (a prompt's later chunk, or a decode row in a mixed step): the keys of earlier
steps through its block table, the step's own from the step's k and v as the projection
left them (their rows are consecutive positions), which needs no block table load before
each tile's keys; a cold prompt's keys are all its own. (An FP8 cache is read for the
step's keys too: attention then sees them quantized, as later steps will.) Which sequence
and tile a program has comes from `query_start_loc` on the device, so the grid depends
only on the bucket's token and sequence counts. Masking follows the torch reference (`hybridd/kernels/attention.py`):
key position <= query position; padding rows after the last sequence give 0.

A step of few query tiles over a long context (a prompt's tail after a cached prefix, a
chunk late in a long prompt) would leave most of the GPU idle, each program walking
thousands of keys. Its bucket's plan then splits each tile's keys over several programs
(flash-decoding's split for prefill): each sizes its run of keys from its tile's context
at replay, writes its partial output and log-sum-exp, and, as in decode, the last of a
tile's splits to finish merges them. Splits without keys (a short context) exit, and a
tile whose keys fit one run is written by that run's program directly.

An FP8 cache (`hybridd/model/kv_cache.py`) is read as it is stored: each tile's FP8 keys
and values are converted to the query's dtype (exact: E4M3 fits in bfloat16 and float32)
for the tensor-core products, and the per-(token, kv head) scales are applied to the
products' vectors instead of to the tile: the scores' columns times the key scales, the
probabilities times the value scales before they weigh the values. That is two vector
multiplies a tile where dequantizing would be two [tile, head_dim] ones, and the same
numbers as the dequantized cache up to float32 rounding. A layer's caches are contiguous,
so a key's scale is at its value offset / head_dim in the scale cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from hybridd import environment
from hybridd.kernels import pdl, split_scratch
from hybridd.kernels.launch_variants import first_eager_call
from hybridd.kernels.pdl import wait_for_predecessor

if TYPE_CHECKING:  # the step's tensors are read by attribute; the model owns their type
    from hybridd.model.step_inputs import StepInputs

# Triton's CPU interpreter (the CPU tests) cannot loop over a bound read from memory
# with `range`; the compiled kernel must, so that the loop is software-pipelined.
_INTERPRET = environment.flag("TRITON_INTERPRET")


@dataclass(frozen=True)
class DecodePlan:
    """Launch shape of one decode attention call: fixed per captured batch bucket."""

    splits: int
    tile: int
    num_warps: int
    num_stages: int


# The programs a batch-1 call aims for, read when a plan is made (so when a graph is
# captured); docs/lab/design_choices.md has what others measured in the whole step.
BATCH1_PROGRAMS = 1024
# Warps, pipeline stages and tile (tokens) of a batch-1 program.
BATCH1_WARPS = 1
BATCH1_STAGES = 3
BATCH1_TILE = 16


def decode_plan(batch: int, kv_heads: int, max_tokens: int) -> DecodePlan:
    """Splits per (sequence, kv head) for about 512 programs (1024 at batch 1), at most 32
    and no more than tiles of the bucket's width; at large batch one split streams the
    whole context.

    Above batch 1, enough programs to fill the GPU hide each one's latency, and a split
    that reads 64-token tiles streams the cache best; a single split saves the merge but
    leaves most of the GPU idle on short batches (docs/lab/design_choices.md, the H200 sweep).

    At batch 1 the attention is bound by each program's chain of dependent steps, not by
    its read, so many small programs run it shortest: one warp and one 16-token tile (a
    page) a program, up to 32 splits. Starting a split's loads before the wait for the
    previous kernel gained nothing, so the kernel waits first. The sweeps and the decode
    steps that chose these are in docs/lab/kernels.md, "Decode attention"."""
    tile = BATCH1_TILE if batch == 1 else 64
    target = BATCH1_PROGRAMS if batch == 1 else 512
    want = max(1, -(-target // (batch * kv_heads)))
    most = max(1, -(-max_tokens // tile))
    splits = triton.next_power_of_2(min(want, most, 32))
    if batch == 1:
        return DecodePlan(splits=splits, tile=tile, num_warps=BATCH1_WARPS, num_stages=BATCH1_STAGES)
    return DecodePlan(splits=splits, tile=tile, num_warps=4, num_stages=3)


@triton.jit
def _load_kv(kc_ptr, vc_ptr, ks_ptr, vs_ptr, off, valid, dt, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """A tile's keys and values [tokens, HEAD_DIM] at offsets `off` in dtype `dt`, and with
    FP8 their scales [tokens] (1.0 otherwise). One return: Triton's code generator visits
    what follows a return inside a compile-time branch too, so an early return there would
    give the function two return types."""
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if FP8:
        k_scale = tl.load(ks_ptr + off // HEAD_DIM, mask=valid, other=0.0)
        v_scale = tl.load(vs_ptr + off // HEAD_DIM, mask=valid, other=0.0)
        k = k.to(dt)
        v = v.to(dt)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k, v, k_scale, v_scale


@triton.jit
def _decode_tile(
    q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, kvh, tok0, end, scale, m_i, l_i, acc,
    stride_c_blk, stride_c_tok, stride_c_head,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    toks = tok0 + tl.arange(0, TILE)
    valid = toks < end
    blk = tl.load(bt_row + toks // PAGE, mask=valid, other=0).to(tl.int64)
    off = blk * stride_c_blk + (toks % PAGE) * stride_c_tok + kvh * stride_c_head
    k, v, k_scale, v_scale = _load_kv(kc_ptr, vc_ptr, ks_ptr, vs_ptr, off, valid, q.dtype, HEAD_DIM, FP8)
    if FP8:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (k_scale * scale)[None, :]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_splits(out_ptr, part_o_ptr, part_lse_ptr, b, kvh, stride_ob, stride_oh,
                  GROUP: tl.constexpr, MERGE_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr):
    """The output of the group's heads from every split's partial output and log-sum-exp,
    MERGE_ROWS heads at a time (one round of loads for each, not one per head)."""
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    for first in tl.static_range(0, GROUP, MERGE_ROWS):
        gi = first + tl.arange(0, MERGE_ROWS)
        gmask = gi < GROUP
        heads = kvh * GROUP + gi
        rows = (b * NUM_HEADS + heads)[:, None] * NUM_SPLITS + s[None, :]
        lses = tl.load(part_lse_ptr + rows, mask=gmask[:, None], other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(part_o_ptr + rows[:, :, None] * HEAD_DIM + d[None, None, :], mask=gmask[:, None, None],
                        other=0.0, cache_modifier=".cg")
        m = tl.max(lses, axis=1)
        w = tl.exp(lses - tl.where(m == float("-inf"), 0.0, m)[:, None])
        total = tl.sum(w, axis=1)
        res = tl.sum(w[:, :, None] * parts, axis=1) / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, len_ptr, out_ptr, part_o_ptr, part_lse_ptr, ticket_ptr, scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: tl.constexpr, MERGE_ROWS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(len_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    hmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    if INTERPRET:
        tok0 = start
        while tok0 < end:
            m_i, l_i, acc = _decode_tile(
                q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, kvh, tok0, end, scale, m_i, l_i, acc,
                stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, PAGE, TILE, PRECISION, FP8,
            )
            tok0 += TILE
    else:
        for tok0 in tl.range(start, end, TILE):
            m_i, l_i, acc = _decode_tile(
                q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, kvh, tok0, end, scale, m_i, l_i, acc,
                stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, PAGE, TILE, PRECISION, FP8,
            )
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    out_rows = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=hmask[:, None])
        tl.store(part_lse_ptr + row, lse, mask=hmask)
        # Every thread's partial is stored before the ticket is taken; the program that
        # takes the last ticket sees all splits' partials and merges them.
        tl.debug_barrier()
        ticket = ticket_ptr + b * KV_HEADS + kvh
        taken = tl.atomic_add(ticket, 1, sem="acq_rel")
        if taken == NUM_SPLITS - 1:
            _merge_splits(out_ptr, part_o_ptr, part_lse_ptr, b, kvh, stride_ob, stride_oh,
                          GROUP, MERGE_ROWS, HEAD_DIM, NUM_SPLITS, NUM_HEADS)
            tl.atomic_xchg(ticket, 0)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, d], caches [blocks, page, KVH, d] (FP8 with their scales [blocks, page, KVH])
    -> [B, H, d]; same contract as the torch path."""
    fp8 = _check_fp8_caches(k_cache, v_cache, k_scale, v_scale)
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    page = k_cache.shape[1]
    group = h // kvh
    if plan is None:
        _compile_decode_plans(q, k_cache, v_cache, block_tables, scale, k_scale, v_scale)
        plan = decode_plan(b, kvh, block_tables.shape[1] * page)
    splits = plan.splits
    out = torch.empty_like(q)
    if splits > 1:
        part_o = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
        tickets = split_scratch.scratch(q.device, "decode_tickets", max(b * kvh, 4096), torch.int32)
        if tickets is None:  # a capture before any eager call this large: the graph zeroes its own
            tickets = torch.zeros(b * kvh, dtype=torch.int32, device=q.device)
    else:
        part_o = part_lse = tickets = out
    # The merge holds MERGE_ROWS heads' partials in registers, at most 4096 floats.
    merge_rows = min(triton.next_power_of_2(group), 1 << (max(1, 4096 // (splits * d)).bit_length() - 1))
    _decode_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, block_tables, seq_lens, out,
        part_o, part_lse, tickets, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        # The group's query rows padded to the 16 rows of a tensor-core tile: the KV read is
        # the cost, and the tensor cores take even one row (no GQA) sooner than the CUDA cores.
        GROUP=group, MERGE_ROWS=merge_rows, ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, PAGE=page,
        TILE=plan.tile, NUM_SPLITS=splits, NUM_HEADS=h, KV_HEADS=kvh,
        # float32 caches get true float32 products, not TF32 (bf16 ignores this).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET=_INTERPRET, FP8=fp8, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **pdl.launch_args(q.device),
    )
    return out


def _check_fp8_caches(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches are FP8 (they then need contiguous scales, one per token and kv
    head, and must be contiguous: a key's scale is found from its value offset)."""
    if k_scale is None:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_scale.is_contiguous()
            and v_scale.is_contiguous()) or k_scale.shape != k_cache.shape[:3] or v_scale.shape != v_cache.shape[:3]:
        raise ValueError(f"an FP8 KV cache needs contiguous caches and scales [blocks, page, kv_heads], got caches "
                         f"{tuple(k_cache.shape)} and scales {tuple(k_scale.shape)}")
    return True


_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillPlan:
    """Launch shape of one prefill attention call: fixed per captured token bucket.

    `splits`: programs per (query tile, head), each over its share of the tile's keys (1:
    one program walks them all and writes the output). A tile's keys are shared out in
    runs of whole `block_n` tiles, at least `min_split` keys each, so a short context
    leaves the later splits without keys: they exit, and with one run left its program
    writes the output itself."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    splits: int = 1
    min_split: int = 256


# (most tokens in the step, its plan), from the prefill sweep
# (docs/lab/kernels.md, "Prefill attention tiles"):
# up to 128 tokens the kernel is bound by each program's latency, not by the GPU's
# throughput, so short steps run more programs of shorter query tiles (at 128 tokens,
# 32-row tiles that each take up to 128 keys at a time).
_PREFILL_PLANS: tuple[tuple[int, PrefillPlan], ...] = (
    (16, PrefillPlan(block_m=16, block_n=64, num_warps=4, num_stages=2)),
    (32, PrefillPlan(block_m=32, block_n=64, num_warps=4, num_stages=2)),
    (64, PrefillPlan(block_m=16, block_n=64, num_warps=4, num_stages=2)),
    (128, PrefillPlan(block_m=32, block_n=128, num_warps=4, num_stages=2)),
)
_LONG_PREFILL_PLAN = PrefillPlan(block_m=64, block_n=64, num_warps=4, num_stages=2)

# The KV split of a step with few query tiles over a long context (a prompt's tail after a
# cached prefix, a chunk late in a long prompt), measured on an H100 by
# `pytest -m gpu tests/test_gpu_kernels.py -k split_prefill_attention_timings` (every
# split count at the shapes that need them; docs/lab/kernels.md, "Split-KV prefill"):
# programs with keys to read the split aims for, per multiprocessor, rounded down to a
# power of two: four for tiles of up to 32 query rows (a 64-token tail after 1,936
# cached tokens: 68 µs unsplit, 33 at 4 splits, 38 at 5), two for 64-row tiles (a
# 256-token chunk at context 1,792: 77 µs unsplit, 52 at 2, 62 at 4; a 1,024-token step
# is fastest unsplit);
SPLIT_PROGRAMS_PER_SM = 4
LONG_TILE_SPLIT_PROGRAMS_PER_SM = 2
# the most programs a split grid may have, per multiprocessor: a program of a padding
# tile slot still starts and reads the step's bounds before it exits, and one of a split
# that a short context leaves without keys reads its tile's positions too;
SPLIT_GRID_PER_SM = 16
# keys a split reads at least (its partial output and the merge cost about as much as a
# 64-key tile; the first value is four of them);
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 16
# Multiprocessors counted for a plan made on the CPU (the interpreter's tests).
CPU_MULTIPROCESSORS = 4
_multiprocessors: dict[torch.device, int] = {}


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (CPU_MULTIPROCESSORS on the CPU)."""
    if device.type != "cuda":
        return CPU_MULTIPROCESSORS
    if device not in _multiprocessors:
        _multiprocessors[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _multiprocessors[device]


def prefill_plan(tokens: int, heads: int = 1, max_context: int = 0, seqs: int = 1,
                 sms: int = CPU_MULTIPROCESSORS) -> PrefillPlan:
    """The launch plan of a prefill step of `tokens` packed tokens of up to `seqs`
    sequences (the bucket's rows), `heads` query heads and contexts of up to `max_context`
    keys, on `sms` multiprocessors.

    The query tiles are split over the keys when a prompt's tiles alone leave the GPU
    idle: enough splits for SPLIT_PROGRAMS_PER_SM programs a multiprocessor
    (LONG_TILE_SPLIT_PROGRAMS_PER_SM for 64-row tiles; counting one sequence's tiles: the
    bucket's other rows are mostly padding), a power of two, no more than the whole
    grid, every tile slot and padding sequence's included, allows (SPLIT_GRID_PER_SM), nor
    than `max_context` has runs of MIN_SPLIT_KEYS. The bucket fixes the split count; each
    program sizes its run from its tile's context at replay."""
    plan = _LONG_PREFILL_PLAN
    for most, candidate in _PREFILL_PLANS:
        if tokens <= most:
            plan = candidate
            break
    tiles = triton.cdiv(tokens, plan.block_m)
    grid = (tiles + seqs + 1) * heads
    per_sm = SPLIT_PROGRAMS_PER_SM if plan.block_m <= 32 else LONG_TILE_SPLIT_PROGRAMS_PER_SM
    splits = min(per_sm * sms // (tiles * heads), max(1, SPLIT_GRID_PER_SM * sms // grid),
                 triton.cdiv(max_context, MIN_SPLIT_KEYS), MAX_SPLITS)
    splits = 1 << (max(1, splits).bit_length() - 1)  # a power of two: whole key tiles a split
    min_split = triton.cdiv(MIN_SPLIT_KEYS, plan.block_n) * plan.block_n
    return dataclasses.replace(plan, splits=max(1, splits), min_split=min_split)


@triton.jit
def _prefill_tile(
    q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, kvh, n0, pos_q, end, qk_scale, m_i, l_i, acc,
    stride_c_blk, stride_c_tok, stride_c_head,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """A tile of keys from the paged cache, through the block table."""
    toks = n0 + tl.arange(0, BLOCK_N)
    kvalid = toks < end
    blk = tl.load(bt_row + toks // PAGE, mask=kvalid, other=0).to(tl.int64)
    off = blk * stride_c_blk + (toks % PAGE) * stride_c_tok + kvh * stride_c_head
    k, v, k_scale, v_scale = _load_kv(kc_ptr, vc_ptr, ks_ptr, vs_ptr, off, kvalid, q.dtype, HEAD_DIM, FP8)
    return _prefill_update(q, k, v, k_scale, v_scale, toks, kvalid, pos_q, qk_scale, m_i, l_i, acc, PRECISION, FP8)


@triton.jit
def _prefill_fresh_tile(
    q, k_ptr, v_ptr, kvh, n0, first_pos, first_row, pos_q, end, qk_scale, m_i, l_i, acc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """A tile of the step's own keys: the one at position p is the step's row
    first_row + p - first_pos (a sequence's rows are consecutive positions)."""
    toks = n0 + tl.arange(0, BLOCK_N)
    kvalid = toks < end
    rows = (first_row + toks - first_pos).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kvalid[:, None], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kvalid[:, None], other=0.0)
    return _prefill_update(q, k, v, 1.0, 1.0, toks, kvalid, pos_q, qk_scale, m_i, l_i, acc, PRECISION, False)


@triton.jit
def _prefill_update(q, k, v, k_scale, v_scale, toks, kvalid, pos_q, qk_scale, m_i, l_i, acc,
                    PRECISION: tl.constexpr, FP8: tl.constexpr):
    """The running max, sum and unnormalised output (base 2) with one tile of keys folded in."""
    visible = (toks[None, :] <= pos_q[:, None]) & kvalid[None, :]
    if FP8:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (k_scale * qk_scale)[None, :]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that see no key of this tile yet keep m = -inf; subtract 0 for them instead.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_keys(
    q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, k_ptr, v_ptr, kvh, start, end, first_pos, first_row, pos_q, qk_scale,
    stride_c_blk, stride_c_tok, stride_c_head, stride_kt, stride_kh, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FP8: tl.constexpr, FRESH: tl.constexpr,
):
    """The tile's running max, sum and unnormalised output (base 2) over keys [start, end):
    with FRESH, those before the sequence's first row in this step (`first_pos`) from the
    paged cache and the rest from the step's own keys; else all from the cache."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cached_end = end
    if FRESH:
        cached_end = tl.minimum(end, first_pos)
    if INTERPRET:
        n0 = start
        while n0 < cached_end:
            m_i, l_i, acc = _prefill_tile(
                q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, kvh, n0, pos_q, cached_end, qk_scale, m_i, l_i, acc,
                stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, PAGE, BLOCK_N, PRECISION, FP8,
            )
            n0 += BLOCK_N
        if FRESH:
            n0 = tl.maximum(start, first_pos)
            while n0 < end:
                m_i, l_i, acc = _prefill_fresh_tile(
                    q, k_ptr, v_ptr, kvh, n0, first_pos, first_row, pos_q, end, qk_scale, m_i, l_i, acc,
                    stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM, BLOCK_N, PRECISION,
                )
                n0 += BLOCK_N
    else:
        for n0 in tl.range(start, cached_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, kvh, n0, pos_q, cached_end, qk_scale, m_i, l_i, acc,
                stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, PAGE, BLOCK_N, PRECISION, FP8,
            )
        if FRESH:
            for n0 in tl.range(tl.maximum(start, first_pos), end, BLOCK_N):
                m_i, l_i, acc = _prefill_fresh_tile(
                    q, k_ptr, v_ptr, kvh, n0, first_pos, first_row, pos_q, end, qk_scale, m_i, l_i, acc,
                    stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM, BLOCK_N, PRECISION,
                )
    return m_i, l_i, acc


@triton.jit
def _merge_prefill_split(m, total, acc, part_o_ptr, part_lse_ptr, rows, rvalid, HEAD_DIM: tl.constexpr):
    """(m, total, acc) with one split's partial output and log-sum-exp (base 2) at `rows`
    folded in. Other programs wrote them: they are read from L2, past this SM's L1."""
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(part_lse_ptr + rows, mask=rvalid, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(part_o_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=rvalid[:, None], other=0.0,
                   cache_modifier=".cg")
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    w = tl.exp2(lse - m_safe)
    alpha = tl.exp2(m - m_safe)
    return m_new, total * alpha + w, acc * alpha[:, None] + w[:, None] * part


@triton.jit
def _merge_prefill_splits(
    out_rows, part_o_ptr, part_lse_ptr, part_rows, rvalid, runs, part_stride,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The tile's output from its `runs` splits' partials, one split at a time; `part_rows`
    are the tile's rows in split 0's partials, each next split's `part_stride` rows on."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if INTERPRET:
        s = 0
        while s < runs:
            m, total, acc = _merge_prefill_split(m, total, acc, part_o_ptr, part_lse_ptr, part_rows + s * part_stride,
                                                 rvalid, HEAD_DIM)
            s += 1
    else:
        for s in tl.range(0, runs):
            m, total, acc = _merge_prefill_split(m, total, acc, part_o_ptr, part_lse_ptr, part_rows + s * part_stride,
                                                 rvalid, HEAD_DIM)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=rvalid[:, None])


# Token, sequence and split counts are not specialised on (divisibility, == 1): an eager
# step of any size reuses the bucket's compiled kernel instead of compiling one while serving.
@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "num_splits", "min_split"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, qsl_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    ticket_ptr, qk_scale, num_tokens, num_seqs, num_splits, min_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SEQS_PAD: tl.constexpr, NUM_HEADS: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FP8: tl.constexpr, FRESH: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    # Sequence i's query tiles are programs qsl[i] // BLOCK_M + i onwards (never more than
    # that leaves before the next sequence's); i == num_seqs is the padding rows after the
    # last sequence, which see no key and give 0. So each program finds its sequence and
    # tile from `query_start_loc` alone, and a tile never spans two sequences.
    si = tl.arange(0, SEQS_PAD)
    # SEQS_PAD > num_seqs + 1, so starts[num_seqs + 1] is num_tokens: the padding rows' end.
    starts = tl.load(qsl_ptr + si, mask=si <= num_seqs, other=num_tokens)
    first_tile = starts // BLOCK_M + si
    seq = tl.max(tl.where((first_tile <= pid) & (si <= num_seqs), si, 0), axis=0)
    seq_start = tl.max(tl.where(si == seq, starts, 0), axis=0)
    seq_end = tl.max(tl.where(si == seq + 1, starts, 0), axis=0)
    tile = pid - tl.max(tl.where(si == seq, first_tile, 0), axis=0)
    is_real = seq < num_seqs
    row0 = seq_start + tile * BLOCK_M
    # Tile slots past their sequence's rows (the grid has one more per sequence) exit here,
    # every split of them, after the one load.
    if row0 < seq_end:
        rows = row0 + tl.arange(0, BLOCK_M)
        rvalid = rows < seq_end
        pos_q = tl.load(pos_ptr + rows, mask=rvalid & is_real, other=-1)
        # A row sees its sequence's keys at positions up to its own: those of earlier steps
        # in the paged cache, this step's in the cache too and (FRESH) in the step's k, v.
        hi = tl.max(pos_q, axis=0) + 1
        first_pos = hi
        if FRESH:
            first_pos = tl.load(pos_ptr + seq_start, mask=is_real, other=0)
        # Split `split` reads keys [split * run, (split + 1) * run): whole key tiles, at
        # least `min_split` keys, as few runs as `num_splits` allows; splits past the last
        # run exit.
        split = tl.program_id(2)
        run = hi
        runs = 1
        if SPLIT:
            run = tl.maximum(tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N, min_split)
            runs = tl.maximum(tl.cdiv(hi, run), 1)
        if split < runs:
            start = split * run
            end = tl.minimum(start + run, hi)
            d = tl.arange(0, HEAD_DIM)
            rows64 = rows.to(tl.int64)
            q = tl.load(q_ptr + rows64[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rvalid[:, None],
                        other=0.0)
            bt_row = bt_ptr + tl.where(is_real, seq, 0).to(tl.int64) * stride_bt
            m_i, l_i, acc = _prefill_keys(
                q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, k_ptr, v_ptr, kvh, start, end, first_pos, seq_start,
                pos_q, qk_scale, stride_c_blk, stride_c_tok, stride_c_head, stride_kt, stride_kh, stride_vt, stride_vh,
                HEAD_DIM, PAGE, BLOCK_M, BLOCK_N, PRECISION, INTERPRET, FP8, FRESH,
            )
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_rows = out_ptr + rows64[:, None] * stride_ot + h * stride_oh + d[None, :]
            if not SPLIT:
                tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=rvalid[:, None])
            elif runs == 1:
                tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=rvalid[:, None])
            else:
                # Partials [split, token, head]: a row is in one tile, so tiles never collide.
                part_rows = rows64 * NUM_HEADS + h
                part_stride = num_tokens.to(tl.int64) * NUM_HEADS
                mine = part_rows + split * part_stride
                lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
                tl.store(part_o_ptr + mine[:, None] * HEAD_DIM + d[None, :], out, mask=rvalid[:, None])
                tl.store(part_lse_ptr + mine, lse, mask=rvalid)
                # As in decode: every thread's partial is stored before the ticket is taken;
                # the program that takes the tile's last ticket merges and gives it back.
                tl.debug_barrier()
                ticket = ticket_ptr + pid * NUM_HEADS + h
                taken = tl.atomic_add(ticket, 1, sem="acq_rel")
                if taken == runs - 1:
                    _merge_prefill_splits(out_rows, part_o_ptr, part_lse_ptr, part_rows, rvalid, runs, part_stride,
                                          HEAD_DIM, BLOCK_M, INTERPRET)
                    tl.atomic_xchg(ticket, 0)


def _seqs_pad(seqs: int) -> int:
    """The prefill kernel's SEQS_PAD for `seqs` sequences, the padding rows' one past them
    and the end of those rows: a compile-time constant."""
    return triton.next_power_of_2(seqs + 2)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs, scale: float,
    plan: PrefillPlan | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query row of a packed step over its sequence's paged context, up to its own
    position. q [T, H, d], caches [blocks, page, KVH, d] (FP8 with their scales [blocks,
    page, KVH]) -> [T, H, d]; same contract as the torch path (without a sliding window).
    `k`, `v` [T, KVH, d]: the step's own keys and values as written to the cache; where
    given (and the cache holds them as they are, not in FP8), each sequence's keys from its
    first row in the step on are read from them, without the block table."""
    fp8 = _check_fp8_caches(k_cache, v_cache, k_scale, v_scale)
    fresh = k is not None and v is not None and not fp8 and k.dtype == k_cache.dtype == v.dtype
    if fresh and (k.shape[0] < q.shape[0] or k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape
                  or k.stride(2) != 1 or v.stride(2) != 1):
        raise ValueError(f"the step's keys and values must be [T, kv_heads, head_dim] with unit stride in head_dim, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)} for q {tuple(q.shape)}")
    if not fresh:
        k = v = None

    t, h, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    seqs = step.query_start_loc.shape[0] - 1
    if plan is None:
        _compile_prefill_plans(q, k_cache, v_cache, step, scale, k_scale, v_scale, k, v)
        plan = prefill_plan(t, h, step.block_tables.shape[1] * k_cache.shape[1], seqs, multiprocessors(q.device))
    tiles = triton.cdiv(t, plan.block_m) + seqs + 1
    if plan.splits > 1:
        part_o = torch.empty((plan.splits, t, h, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((plan.splits, t, h), dtype=torch.float32, device=q.device)
        tickets = split_scratch.scratch(q.device, "prefill_tickets", max(tiles * h, 8192), torch.int32)
        if tickets is None:  # a capture before any eager call this large: the graph zeroes its own
            tickets = torch.zeros(tiles * h, dtype=torch.int32, device=q.device)
    else:
        part_o = part_lse = tickets = out
    _prefill_kernel[(tiles, h, plan.splits)](
        q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, k if fresh else k_cache,
        v if fresh else v_cache, step.block_tables,
        step.positions, step.query_start_loc, out, part_o, part_lse, tickets,
        scale * _LOG2E, t, seqs, plan.splits, plan.min_split,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), step.block_tables.stride(0),
        *((k.stride(0), k.stride(1), v.stride(0), v.stride(1)) if fresh else (0, 0, 0, 0)),
        GROUP=h // kvh, HEAD_DIM=d, PAGE=k_cache.shape[1], BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        SEQS_PAD=_seqs_pad(seqs), NUM_HEADS=h, SPLIT=plan.splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET=_INTERPRET, FP8=fp8, FRESH=fresh, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **pdl.launch_args(q.device),
    )
    return out


# Graph buckets of other sizes pick other launch plans (split counts, query tile heights);
# the first eager call for a geometry launches every plan a bucket can pick
# (`launch_variants`). With and without dependent launch they are different kernels
# (`pdl`), each compiled by its first call.
_MAX_BUCKET_BATCH = 512


def _compile_decode_plans(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    kvh, page, width = k_cache.shape[2], k_cache.shape[1], block_tables.shape[1]
    key = ("decode", q.device, q.dtype, k_cache.dtype, tuple(q.shape[1:]), tuple(k_cache.shape[1:]), width,
           pdl.enabled(q.device))
    if not first_eager_call(key, q.device):
        return
    plans = {decode_plan(b, kvh, width * page) for b in range(1, _MAX_BUCKET_BATCH + 1)}
    empty = torch.zeros(1, dtype=torch.int32, device=q.device)
    for plan in plans:
        decode_attention(q[:1], k_cache, v_cache, block_tables[:1], empty, scale, plan=plan, k_scale=k_scale,
                         v_scale=v_scale)


def _aligned_as(t: torch.Tensor, n: int) -> torch.Tensor:
    """n zeros of t's dtype on t's device whose address has t's alignment to 16 bytes (Triton
    specialises a kernel on whether each pointer is 16-byte aligned)."""
    shift = (t.data_ptr() % 16) // t.element_size()
    return torch.zeros(n + shift, dtype=t.dtype, device=t.device)[shift:]


def _like(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """`rows` rows of zeros laid out as t (its strides, its alignment to 16 bytes)."""
    if t is None:
        return None
    size = (rows - 1) * t.stride(0) + sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:])) + 1
    return torch.as_strided(_aligned_as(t, size), (rows, *t.shape[1:]), t.stride())


def _compile_prefill_plans(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
) -> None:
    """Every plan a bucket can pick (each query tile height, split and not where a context
    can be split), for every padding of the sequence count up to this step's: an eager
    prefill (a bucket not captured yet) has its own count of sequences."""
    seqs = step.query_start_loc.shape[0] - 1
    key = ("prefill", q.device, q.dtype, k_cache.dtype, tuple(q.shape[1:]), tuple(k_cache.shape[1:]), seqs,
           step.block_tables.shape[1], pdl.enabled(q.device), None if k is None else (k.stride(), v.stride()))
    if not first_eager_call(key, q.device):
        return
    plans = list(dict.fromkeys([plan for _, plan in _PREFILL_PLANS] + [_LONG_PREFILL_PLAN]))
    if step.block_tables.shape[1] * k_cache.shape[1] > MIN_SPLIT_KEYS:
        # Split counts share one kernel: only whether a plan splits is compiled in.
        plans += [dataclasses.replace(plan, splits=2) for plan in plans]
    tokens = 16  # any multiple of 16 (as every bucket is) compiles the kernel a bucket runs
    counts = {_seqs_pad(n): n for n in range(1, seqs + 1)}  # the most sequences of each padding
    for n in counts.values():
        for plan in plans:
            dummy = dataclasses.replace(
                step,
                input_ids=step.input_ids[:0],
                positions=_aligned_as(step.positions, tokens),
                slot_mapping=step.slot_mapping[:0],
                block_tables=step.block_tables[:n],
                seq_lens=step.seq_lens[:n],
                query_start_loc=_aligned_as(step.query_start_loc, n + 1),
                logits_indices=step.logits_indices[:n],
                is_prefill=True,
            )
            q_rows = torch.zeros((tokens, *q.shape[1:]), dtype=q.dtype, device=q.device)
            prefill_attention(q_rows, k_cache, v_cache, dummy, scale, plan=plan, k_scale=k_scale, v_scale=v_scale,
                              k=_like(k, tokens), v=_like(v, tokens))
