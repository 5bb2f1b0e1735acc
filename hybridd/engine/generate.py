"""In-process generation: the engine core over a model in this process.

The same scheduler, block manager, sampler and stop criteria as the daemon, driven one
step deep by `InProcessRunner` instead of the graph generator. Tests and quick scripts
use it; the two-process runtime is checked against the model it wraps.
"""

from __future__ import annotations

import torch

from hybridd.engine.block_manager import BlockManager
from hybridd.engine.core import EngineCore
from hybridd.engine.grammar import CompiledGrammar
from hybridd.engine.in_process_runner import InProcessRunner
from hybridd.engine.scheduler import Scheduler
from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.drafter import HiddenStateDrafter
from hybridd.engine.speculation.speculator import Speculator
from hybridd.model.kv_cache import KVCache, blocks_for
from hybridd.model.llama import LlamaModel
from hybridd.protocol.messages import SamplingParams


def generate(
    model: LlamaModel,
    prompts: list[list[int]],
    params: SamplingParams,
    block_size: int = 16,
    kv_cache: KVCache | None = None,
    tokenizer=None,
    grammar: CompiledGrammar | None = None,
    speculator: Speculator | None = None,
    max_batch: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> list[list[Sequence]]:
    """Run every prompt with `params` to its end (under `grammar`, the compiled
    `params.structured`, when given), speculating with `speculator` when given; returns
    the finished requests' sequences, one list per prompt (`params.n` sequences each).
    `max_batch` (default: every sequence at once) bounds the batch. `kv_dtype` (default:
    the model's) is the KV cache's dtype where no `kv_cache` is given."""
    lengths = [len(p) + params.max_tokens for p in prompts]
    model.check_sequence_length(max(lengths, default=0))
    manager_blocks = sum(params.n * blocks_for(n, block_size) for n in lengths)
    if kv_cache is None:
        kv_cache = KVCache.allocate(model.config, manager_blocks + 1, block_size, kv_dtype or model.dtype,
                                   model.device)
    blocks = BlockManager(kv_cache.num_blocks, block_size, watermark=0.0)
    max_batch = max_batch or max(1, len(prompts) * params.n)
    k = speculator.max_tokens if speculator is not None else 0
    scheduler = Scheduler(
        blocks, max_batch=max_batch, max_prefill_tokens=max(sum(map(len, prompts)), 1),
        max_model_len=model.max_positions, eos_token_ids=model.config.eos_token_ids, tokenizer=tokenizer,
        speculator=speculator, max_verify_rows=max_batch * (k + 1),
    )
    drafter = speculator.drafter if speculator is not None else None
    hidden_drafter = drafter if isinstance(drafter, HiddenStateDrafter) else None
    core = EngineCore(scheduler, InProcessRunner(model, kv_cache, hidden_drafter=hidden_drafter), tokenizer,
                      pipeline_depth=1)
    requests = [core.add(str(i), prompt, params, grammar=grammar) for i, prompt in enumerate(prompts)]
    while core.has_work:
        core.step()
    return [request.seqs for request in requests]


def greedy_generate(
    model: LlamaModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
    kv_cache: KVCache | None = None,
    kv_dtype: torch.dtype | None = None,
) -> list[list[int]]:
    """Greedy decoding of each prompt for exactly `max_new_tokens` tokens (no stop at
    EOS); returns the new tokens."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return [list(seqs[0].output_token_ids)
            for seqs in generate(model, prompts, params, block_size, kv_cache, kv_dtype=kv_dtype)]
