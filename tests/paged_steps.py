"""Packed steps over a paged KV cache for the attention tests: sequences whose rows start
at any position, their earlier context already in the cache, laid out as the graph
runner pads a bucket; and the dense causal attention they must equal."""

from __future__ import annotations

import torch

from hybridd.model.step_inputs import StepInputs


def paged_step(g, device, dtype, spans, heads, kv_heads, d, page=16, pad=0, padded_seqs=0, table_width=None,
               caches=None):
    """A step of sequences given as (start position, rows) `spans`, plus `pad` padding
    rows and `padded_seqs` empty sequences. Returns (step, q, k_cache, v_cache, contexts):
    each sequence's blocks are a random permutation of the cache's, and holds random keys
    and values at every position up to its last row (the step's own KV written, as the
    forward writes it before attention); `contexts[i]` is sequence i's (keys, values)
    [positions, KVH, d] in position order. `table_width`: blocks per table row (default
    one more than the longest sequence needs), as a graph's tables have for
    max_model_len; `caches`: (k_cache, v_cache) to lay the sequences out in, their last
    block left out (the scratch block), instead of new ones."""
    ends = [start + rows for start, rows in spans]
    widths = [-(-end // page) for end in ends]
    if caches is None:
        num_blocks = sum(widths) + 3
        k_cache = torch.randn(num_blocks + 1, page, kv_heads, d, dtype=dtype, device=device, generator=g)
        v_cache = torch.randn(num_blocks + 1, page, kv_heads, d, dtype=dtype, device=device, generator=g)
    else:
        k_cache, v_cache = caches
        num_blocks = k_cache.shape[0] - 1
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(spans))).tolist()
    tables, contexts = [], []
    for width, end in zip(widths, ends, strict=True):
        table, order = order[:width], order[width:]
        tables.append(table)
        blocks = torch.tensor(table, device=device)
        contexts.append(tuple(c[blocks].reshape(-1, kv_heads, d)[:end] for c in (k_cache, v_cache)))
    step = StepInputs.prefill([[1] * rows for _, rows in spans], tables, page, device,
                              start_positions=[start for start, _ in spans],
                              table_width=table_width or max(widths) + 1)
    real = step.num_tokens
    t = real + pad
    zeros = torch.zeros(pad, dtype=step.positions.dtype, device=device)
    step = StepInputs(
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=torch.cat([step.positions, zeros]),
        slot_mapping=torch.cat([step.slot_mapping, zeros - 1]),
        block_tables=torch.cat([step.block_tables, step.block_tables.new_zeros(padded_seqs, step.block_tables.shape[1])]),
        seq_lens=torch.cat([step.seq_lens, step.seq_lens.new_ones(padded_seqs)]),
        query_start_loc=torch.cat([step.query_start_loc,
                                   torch.full((padded_seqs,), real, dtype=torch.int32, device=device)]),
        logits_indices=torch.cat([step.logits_indices, step.logits_indices.new_zeros(padded_seqs)]),
        is_prefill=True,
    )
    q = torch.randn(t, heads, d, dtype=dtype, device=device, generator=g)
    return step, q, k_cache, v_cache, contexts


def dense_causal(q, spans, contexts, scale, sliding_window=None):
    """Each sequence's rows over its contiguous context with a plain causal mask; padding
    rows are 0. The reference the paged attention must equal."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for (start, rows), (keys, values) in zip(spans, contexts, strict=True):
        group = q.shape[1] // keys.shape[1]
        k = keys.float().repeat_interleave(group, 1)
        v = values.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[row:row + rows].float(), k) * scale
        pos_q = torch.arange(start, start + rows, device=q.device)[:, None]
        pos_k = torch.arange(k.shape[0], device=q.device)[None, :]
        visible = pos_k <= pos_q
        if sliding_window is not None:
            visible &= pos_q - pos_k < sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[row:row + rows] = torch.einsum("hqk,khd->qhd", probs, v)
        row += rows
    return out


def step_kv(spans, contexts, pad, heads):
    """The step's own keys and values [T, KVH, d] (each sequence's rows at their positions,
    from `contexts`; padding rows 0), as the fused qkv projection leaves them: strided
    views of one [T, (heads + 2 KVH) d] tensor."""
    keys0 = contexts[0][0]
    kv_heads, d = keys0.shape[1], keys0.shape[2]
    t = sum(rows for _, rows in spans) + pad
    qkv = torch.zeros(t, (heads + 2 * kv_heads) * d, dtype=keys0.dtype, device=keys0.device)
    _, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    k, v = k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    row = 0
    for (start, rows), (keys, values) in zip(spans, contexts, strict=True):
        k[row:row + rows] = keys[start:start + rows]
        v[row:row + rows] = values[start:start + rows]
        row += rows
    return k, v


def poison_step_slots(step, k_cache, v_cache, spans):
    """Copies of the caches whose slots of the step's own rows hold NaN: attention that
    reads the step's keys and values from the step, not the cache, is unchanged."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    real = sum(rows for _, rows in spans)
    slots = step.slot_mapping[:real].long()
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[slots] = float("nan")
    return k_cache, v_cache
