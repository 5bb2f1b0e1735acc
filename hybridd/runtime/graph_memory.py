"""Measuring what a captured graph costs in device memory, and estimating it beforehand.

On CUDA the cost of a capture is the growth of the graphs' shared memory pool across
it: what the new graph's activations pin. Not the drop in the device's free memory,
which also counts whatever else the process or the other worker allocated meanwhile;
the driver's own memory for an instantiated graph (its executable) is not in the pool
and is left out. On the CPU there is nothing to measure, so the activation estimate
stands in, which keeps the budget and eviction logic exercised by the same code.
"""

from __future__ import annotations

import torch

from hybridd.model.config import ModelConfig


def activation_bytes(config: ModelConfig, num_tokens: int, num_seqs: int, elem_bytes: int) -> int:
    """Peak live activations of one forward over `num_tokens` tokens (a planning estimate)."""
    h, i = config.hidden_size, config.intermediate_size
    per_token = (4 * h + config.q_size + 2 * config.kv_size + 3 * i) * elem_bytes
    mask = num_tokens * num_tokens if num_tokens > num_seqs else 0
    logits = num_seqs * config.vocab_size * 4
    return num_tokens * per_token + mask + logits


def batch_bytes(config: ModelConfig, max_batch: int, max_prefill_seqs: int, elem_bytes: int) -> int:
    """What serving a batch of `max_batch` needs beside the weights and the KV cache: the
    step buffers' logits (a row per sequence) and the activations of its decode step (a
    captured graph pins them), estimated as `activation_bytes` does."""
    rows = max(max_batch, max_prefill_seqs)
    return rows * config.vocab_size * 4 + activation_bytes(config, max_batch, max_batch, elem_bytes)


def pool_bytes(pool: tuple[int, int] | None) -> int:
    """Bytes of the segments that belong to a graph memory pool."""
    if pool is None or not torch.cuda.is_available():
        return 0
    total = 0
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == tuple(pool):
            total += segment["total_size"]
    return total
