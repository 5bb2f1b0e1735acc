"""The sampler as fused Triton kernels: the same pipeline as the eager functions in
`hybridd.engine.sampler` (which stay its specification and its CPU path), in a
handful of launches whose compilation takes seconds, not the tens of seconds a
traced graph per sampling path took.

Each row's vocabulary is split into blocks of BLOCK entries, one program per
(row, block), so that a batch of one still spreads over the GPU:

1. `_block_max`: each block's largest penalised logit and its first index.
2. Top-k/top-p rows only: `_processed` writes the scaled logits, `torch.sort` ranks
   them, and `_cut` finds each row's threshold (the last kept value).
3. `_block_draw`: sampled rows' Gumbel-max over their block, `(logit - row max) *
   1/temperature + g`, entries below the threshold at -inf; the noise is the same
   integer hash of (seed, position, vocab index) as `gumbel_noise`.
4. `_finish`: each row's token, the first index of its largest entry (greedy rows
   from step 1, sampled rows from step 3).

Logprobs take the processed logits from `_processed` and a log-softmax and top-k
from torch. Penalties and the top-k/top-p cut are compile-time switches, so each
combination is its own small kernel, compiled once at warm-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
_UNIFORM_SCALE = tl.constexpr(2.0**-23)


@triton.jit
def _mix32(x):
    # "triple32" integer hash (C. Wellons) on uint32, as `sampler._mix32` computes it in int64.
    x = x ^ (x >> 17)
    x = x * 0xED5AD4BB
    x = x ^ (x >> 11)
    x = x * 0xAC4C1B51
    x = x ^ (x >> 15)
    x = x * 0x31848BAB
    return x ^ (x >> 14)


@triton.jit
def _penalised(logits_ptr, row, offs, in_range, vocab, counts_ptr, prompt_ptr, rep_ptr, inv_rep_ptr, presence_ptr,
               frequency_ptr, HAS_PENALTIES: tl.constexpr):
    """A block of one row's logits in float32, NaN as -inf and +inf as the largest
    float; penalised as `sampler._penalize` does, when the batch has penalties."""
    x = tl.load(logits_ptr + row * vocab + offs, mask=in_range, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    x = tl.where(x == float("inf"), _FLOAT32_MAX, x)
    if HAS_PENALTIES:
        counts = tl.load(counts_ptr + row * vocab + offs, mask=in_range, other=0)
        in_prompt = tl.load(prompt_ptr + row * vocab + offs, mask=in_range, other=0) != 0
        repetition = tl.load(rep_ptr + row)
        inverse_repetition = tl.load(inv_rep_ptr + row)
        in_output = counts > 0
        repeated = tl.where(x > 0, x * inverse_repetition, x * repetition)
        penalised = tl.where(in_output | in_prompt, repeated, x)
        penalised = penalised - tl.load(frequency_ptr + row) * counts.to(tl.float32)
        penalised = penalised - tl.load(presence_ptr + row) * in_output.to(tl.float32)
        penalised = tl.minimum(tl.maximum(penalised, -_FLOAT32_MAX), _FLOAT32_MAX)
        x = tl.where(x == float("-inf"), x, penalised)
    return x


@triton.jit
def _row_top(block_max_ptr, row, num_blocks, NUM_BLOCKS_POW2: tl.constexpr):
    """The row's largest penalised logit, or 0 when it is -inf (as `sampler._scale`)."""
    blocks = tl.arange(0, NUM_BLOCKS_POW2)
    top = tl.max(tl.load(block_max_ptr + row * num_blocks + blocks, mask=blocks < num_blocks,
                         other=float("-inf")), axis=0)
    return tl.where(top == float("-inf"), 0.0, top)


@triton.jit
def _scaled(x, top, inverse_temperature, threshold_ptr, row, HAS_THRESHOLD: tl.constexpr):
    """(logit - row max) / temperature (greedy rows: by 1), as `sampler._scale`; with a
    threshold, the entries below it at -inf, as `sampler._top_k_top_p` cuts them."""
    scaled = (x - top) * tl.where(inverse_temperature > 0, inverse_temperature, 1.0)
    if HAS_THRESHOLD:
        scaled = tl.where(scaled < tl.load(threshold_ptr + row), float("-inf"), scaled)
    return scaled


@triton.jit
def _block_max(logits_ptr, vocab, counts_ptr, prompt_ptr, rep_ptr, inv_rep_ptr, presence_ptr, frequency_ptr,
               block_max_ptr, block_arg_ptr, HAS_PENALTIES: tl.constexpr, BLOCK: tl.constexpr):
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    x = _penalised(logits_ptr, row, offs, offs < vocab, vocab, counts_ptr, prompt_ptr, rep_ptr, inv_rep_ptr,
                   presence_ptr, frequency_ptr, HAS_PENALTIES)
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    num_blocks = tl.num_programs(1)
    tl.store(block_max_ptr + row * num_blocks + block, value)
    tl.store(block_arg_ptr + row * num_blocks + block, block * BLOCK + index)


@triton.jit
def _processed(logits_ptr, vocab, counts_ptr, prompt_ptr, rep_ptr, inv_rep_ptr, presence_ptr, frequency_ptr,
               inv_temp_ptr, block_max_ptr, threshold_ptr, out_ptr, HAS_PENALTIES: tl.constexpr,
               HAS_THRESHOLD: tl.constexpr, FOR_SORT: tl.constexpr, NUM_BLOCKS_POW2: tl.constexpr,
               BLOCK: tl.constexpr):
    """FOR_SORT: every row's scaled logits (greedy rows scaled by 1), as `_top_k_top_p`
    ranks them. Otherwise the logits each row draws from, as `sampler._processed`:
    sampled rows scaled and cut at their threshold, greedy rows penalised only."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < vocab
    x = _penalised(logits_ptr, row, offs, in_range, vocab, counts_ptr, prompt_ptr, rep_ptr, inv_rep_ptr,
                   presence_ptr, frequency_ptr, HAS_PENALTIES)
    inverse_temperature = tl.load(inv_temp_ptr + row)
    top = _row_top(block_max_ptr, row, tl.num_programs(1), NUM_BLOCKS_POW2)
    scaled = _scaled(x, top, inverse_temperature, threshold_ptr, row, HAS_THRESHOLD and not FOR_SORT)
    if not FOR_SORT:
        scaled = tl.where(inverse_temperature > 0, scaled, x)
    tl.store(out_ptr + row * vocab + offs, scaled, mask=in_range)


@triton.jit
def _cut(sorted_ptr, vocab, top_k_ptr, top_p_ptr, threshold_ptr, BLOCK: tl.constexpr):
    """Each row's threshold over its sorted scaled logits, as `sampler._top_k_top_p`:
    the value of the last token kept by both top-k and top-p (at least one)."""
    row = tl.program_id(0).to(tl.int64)
    base = sorted_ptr + row * vocab
    top_k = tl.minimum(tl.load(top_k_ptr + row), vocab).to(tl.int32)
    top_p = tl.load(top_p_ptr + row)
    best = tl.load(base)
    # The softmax over the top-k prefix: its normaliser first.
    total = tl.zeros((), tl.float32)
    start = tl.zeros((), tl.int32)
    while start < top_k:
        ranks = start + tl.arange(0, BLOCK)
        values = tl.load(base + ranks, mask=ranks < top_k, other=float("-inf"))
        total += tl.sum(tl.exp(values - best), axis=0)
        start += BLOCK
    kept = top_k
    if top_p < 1.0:
        # A token stays while the mass ranked above it is below top_p; the mass only
        # grows, so the scan ends with the first block that cuts a token.
        kept = tl.zeros((), tl.int32)
        mass = tl.zeros((), tl.float32)
        start = tl.zeros((), tl.int32)
        while start < top_k:
            ranks = start + tl.arange(0, BLOCK)
            in_k = ranks < top_k
            probs = tl.exp(tl.load(base + ranks, mask=in_k, other=float("-inf")) - best) / total
            before = tl.cumsum(probs, axis=0) + mass - probs
            stays = tl.sum(((before < top_p) & in_k).to(tl.int32), axis=0)
            kept += stays
            mass += tl.sum(probs, axis=0)
            start = tl.where(stays < BLOCK, top_k, start + BLOCK)
    kept = tl.maximum(kept, 1)
    tl.store(threshold_ptr + row, tl.load(base + kept - 1))


@triton.jit
def _block_draw(logits_ptr, vocab, counts_ptr, prompt_ptr, rep_ptr, inv_rep_ptr, presence_ptr, frequency_ptr,
                inv_temp_ptr, seeds_ptr, positions_ptr, block_max_ptr, threshold_ptr, draw_max_ptr, draw_arg_ptr,
                HAS_PENALTIES: tl.constexpr, HAS_THRESHOLD: tl.constexpr, NUM_BLOCKS_POW2: tl.constexpr,
                BLOCK: tl.constexpr):
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    inverse_temperature = tl.load(inv_temp_ptr + row)
    if inverse_temperature > 0:  # greedy rows draw nothing
        offs = block * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < vocab
        x = _penalised(logits_ptr, row, offs, in_range, vocab, counts_ptr, prompt_ptr, rep_ptr, inv_rep_ptr,
                       presence_ptr, frequency_ptr, HAS_PENALTIES)
        num_blocks = tl.num_programs(1)
        scaled = _scaled(x, _row_top(block_max_ptr, row, num_blocks, NUM_BLOCKS_POW2), inverse_temperature,
                         threshold_ptr, row, HAS_THRESHOLD)
        seed = tl.load(seeds_ptr + row)
        position = tl.load(positions_ptr + row)
        key = _mix32((position & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
        key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        key = _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))
        bits = _mix32(_mix32(key ^ offs.to(tl.uint32)) ^ 0x85EBCA6B)
        uniform = ((bits >> 9).to(tl.float32) + 0.5) * _UNIFORM_SCALE
        gumbel = -tl.log(-tl.log(uniform))
        value, index = tl.max(scaled + gumbel, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(draw_max_ptr + row * num_blocks + block, value)
        tl.store(draw_arg_ptr + row * num_blocks + block, block * BLOCK + index)


@triton.jit
def _finish(inv_temp_ptr, block_max_ptr, block_arg_ptr, draw_max_ptr, draw_arg_ptr, out_ptr, num_blocks,
            NUM_BLOCKS_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, NUM_BLOCKS_POW2)
    in_row = blocks < num_blocks
    at = row * num_blocks + blocks
    if tl.load(inv_temp_ptr + row) > 0:
        values = tl.load(draw_max_ptr + at, mask=in_row, other=float("-inf"))
        args = tl.load(draw_arg_ptr + at, mask=in_row, other=0)
    else:
        values = tl.load(block_max_ptr + at, mask=in_row, other=float("-inf"))
        args = tl.load(block_arg_ptr + at, mask=in_row, other=0)
    best = tl.max(values, axis=0)
    # The first index among the blocks' maxima; each block already gave its first.
    args = tl.where(in_row & (values == best), args, 2147483647)
    tl.store(out_ptr + row, tl.min(args, axis=0).to(tl.int64))


def _kernel_ready(tensor: torch.Tensor) -> bool:
    """Contiguous and 16-byte aligned, as every tensor the warm-up passes: Triton compiles
    a kernel anew for a pointer of another alignment, which on the serving loop would
    stall every stream, so such a tensor goes through an aligned copy instead."""
    return tensor.is_contiguous() and tensor.data_ptr() % 16 == 0


class FusedSampling:
    """One batch's launches; `tokens` and `processed` read the row maxima once."""

    def __init__(self, logits: torch.Tensor, t) -> None:  # t: sampler.SamplingTensors
        if not _kernel_ready(logits):
            logits = logits.clone(memory_format=torch.contiguous_format)
        self.logits, self.t = logits, t
        self.rows, self.vocab = logits.shape
        self.num_blocks = triton.cdiv(self.vocab, BLOCK)
        self.blocks_pow2 = triton.next_power_of_2(self.num_blocks)
        self.has_penalties = t.output_counts is not None and t.prompt_mask is not None
        if self.has_penalties:
            self.penalties = (t.output_counts, t.prompt_mask.view(torch.uint8), t.repetition_penalty,
                              t.inverse_repetition_penalty, t.presence_penalty, t.frequency_penalty)
        else:
            dummy = t.inverse_temperature
            self.penalties = (dummy,) * 6
        grid = (self.rows, self.num_blocks)
        self.block_max = torch.empty(grid, dtype=torch.float32, device=logits.device)
        self.block_arg = torch.empty(grid, dtype=torch.int32, device=logits.device)
        _block_max[grid](logits, self.vocab, *self.penalties, self.block_max, self.block_arg,
                         HAS_PENALTIES=self.has_penalties, BLOCK=BLOCK, num_warps=8)
        self.threshold = None
        if t.do_sort and not t.all_greedy:
            scaled = self._processed(for_sort=True)
            ranked = scaled.sort(dim=-1, descending=True).values
            self.threshold = torch.empty(self.rows, dtype=torch.float32, device=logits.device)
            _cut[(self.rows,)](ranked, self.vocab, t.top_k, t.top_p, self.threshold, BLOCK=BLOCK, num_warps=8)

    def tokens(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's next token, int64 [B], written into `out` as well when given."""
        t = self.t
        target = out
        if out is None or not _kernel_ready(out) or out.dtype != torch.int64:
            target = torch.empty(self.rows, dtype=torch.int64, device=self.logits.device)
            out = target if out is None else out
        draw_max, draw_arg = self.block_max, self.block_arg
        if not t.all_greedy:
            draw_max, draw_arg = torch.empty_like(self.block_max), torch.empty_like(self.block_arg)
            _block_draw[(self.rows, self.num_blocks)](
                self.logits, self.vocab, *self.penalties, t.inverse_temperature, t.seeds, t.positions,
                self.block_max, self._threshold(), draw_max, draw_arg, HAS_PENALTIES=self.has_penalties,
                HAS_THRESHOLD=self.threshold is not None, NUM_BLOCKS_POW2=self.blocks_pow2, BLOCK=BLOCK,
                num_warps=8,
            )
        _finish[(self.rows,)](t.inverse_temperature, self.block_max, self.block_arg, draw_max, draw_arg, target,
                              self.num_blocks, NUM_BLOCKS_POW2=self.blocks_pow2, num_warps=1)
        if target is not out:
            out.copy_(target)
        return out

    def processed(self) -> torch.Tensor:
        """The logits each row draws from, float32 [B, V] (see `sampler._processed`)."""
        return self._processed(for_sort=False)

    def _threshold(self) -> torch.Tensor:
        return self.threshold if self.threshold is not None else self.block_max

    def _processed(self, for_sort: bool) -> torch.Tensor:
        out = torch.empty(self.rows, self.vocab, dtype=torch.float32, device=self.logits.device)
        _processed[(self.rows, self.num_blocks)](
            self.logits, self.vocab, *self.penalties, self.t.inverse_temperature, self.block_max,
            self._threshold(), out, HAS_PENALTIES=self.has_penalties,
            HAS_THRESHOLD=self.threshold is not None and not for_sort, FOR_SORT=for_sort,
            NUM_BLOCKS_POW2=self.blocks_pow2, BLOCK=BLOCK, num_warps=8,
        )
        return out
