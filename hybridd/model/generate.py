"""In-process greedy generation over the paged KV cache: the engine core used alone.

This is the single-process reference the two-process runtime is checked against,
and what tests and quick scripts use; it allocates blocks trivially (each sequence
owns a fixed range) because it never runs out of them by construction.
"""

from __future__ import annotations

import torch

from hybridd.model.kv_cache import KVCache, blocks_for
from hybridd.model.llama import LlamaModel
from hybridd.model.step_inputs import StepInputs


@torch.inference_mode()
def greedy_generate(
    model: LlamaModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
    kv_cache: KVCache | None = None,
) -> list[list[int]]:
    """Prefill all prompts in one step, then decode them as one batch; returns new tokens."""
    device = model.device
    lengths = [len(p) + max_new_tokens for p in prompts]
    model.check_sequence_length(max(lengths, default=0))
    blocks_each = [blocks_for(n, block_size) for n in lengths]
    if kv_cache is None:
        kv_cache = KVCache.allocate(model.config, sum(blocks_each), block_size, model.dtype, device)
    tables, start = [], 0
    for n in blocks_each:
        tables.append(list(range(start, start + n)))
        start += n
    if start > kv_cache.num_blocks:
        raise ValueError(f"prompts need {start} KV blocks, the cache has {kv_cache.num_blocks}")

    step = StepInputs.prefill(prompts, tables, block_size, device)
    next_tokens = model.forward_logits(step, kv_cache).argmax(-1).tolist()
    outputs = [[t] for t in next_tokens]
    for i in range(1, max_new_tokens):
        positions = [len(p) + i - 1 for p in prompts]
        step = StepInputs.decode(next_tokens, positions, tables, block_size, device)
        next_tokens = model.forward_logits(step, kv_cache).argmax(-1).tolist()
        for out, tok in zip(outputs, next_tokens, strict=True):
            out.append(tok)
    return outputs
