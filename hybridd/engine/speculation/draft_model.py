"""The draft-model drafter: a small Llama-family model with the target's tokenizer
proposes each sequence's next k tokens by decoding them itself.

It keeps a paged KV cache of its own (`DraftCache`: its arena, its blocks, and per
sequence the tokens whose KV that cache holds). A proposal for a batch of sequences
is one prefill-shaped forward over what each sequence's cache lacks (a new
sequence's whole prompt; after a verify step, the tokens it kept), whose last row
gives draft token 1, then k - 1 batched decode forwards, one per further token. The
cache follows the sequence's tokens, not the steps that made them: before each
proposal it keeps the longest prefix of its tokens that the sequence still has and
drops the rest (the rejected draft tokens of the last verify step), so verification,
preemption (tokens are kept, the target's KV recomputed: the draft's stays valid),
plain decode steps between verify steps and `n > 1` (forks are sequences of their
own, keyed by their `request_id`) need no hook beyond `release`. When its blocks run
short it drops the caches of the sequences that drafted least recently (they are
prefilled again when next drafted for); a sequence that still does not fit, or that
would pass the draft's positions, gets no draft.

Each token is drawn from the draft's logits by the request's own sampler (`Sampler`:
penalties, temperature, top-k/top-p) with the noise the target uses at that position
(keyed by the request's seed and the token's position), so a greedy request's draft is
the draft's argmax and a sampled request's a draw from the draft's distribution, which
verification scores by the rejection rule (`verification`: its own uniforms and residual
noise are keyed apart from this noise). `Draft.probabilities` is, for sampled requests,
the distribution each token was drawn from, the softmax of the processed draft logits
(`Sampler.processed_logits`: the request's temperature applied).

Where it runs: in the context generator, on the CPU, eagerly, called by the
scheduler between steps. It is called with every token of its sequences on the host
(speculation waits for tokens in flight), and the drafts it makes are the verify
step's inputs, which the context generator builds; the draft model and its cache here
cost the target no memory and need no protocol between the workers. On a GPU the
same forwards would belong in the graph generator (its device, its own CUDA graphs
per batch size), a step message asking for k draft tokens beside the verify step; this
class is the reference that such a runner must equal.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from hybridd.engine.sampler import Sampler, SamplingTensors
from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.drafter import NO_DRAFT, Draft
from hybridd.log import get_logger
from hybridd.model.kv_cache import KVCache, blocks_for
from hybridd.model.loader import load_model
from hybridd.model.llama import LlamaModel
from hybridd.model.step_inputs import HostStepInputs

log = get_logger(__name__)


@dataclass
class _Cached:
    """One sequence's part of the draft cache: its blocks, and the tokens whose KV they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftCache:
    """The draft model's paged KV cache and who holds which of its blocks."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        self.kv = KVCache.allocate(model.config, num_blocks, block_size, model.dtype, model.device)
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.seqs: OrderedDict[str, _Cached] = OrderedDict()  # least recently drafted for first

    def get(self, request_id: str) -> _Cached:
        cached = self.seqs.get(request_id)
        if cached is None:
            cached = self.seqs[request_id] = _Cached()
        self.seqs.move_to_end(request_id)
        return cached

    def keep(self, cached: _Cached, tokens: list[int]) -> int:
        """Keep the longest prefix of the cache that `tokens` starts with, but never the
        last token (its logits are the next draft's first row); returns its length."""
        limit = min(len(cached.tokens), len(tokens) - 1)
        common = 0
        while common < limit and cached.tokens[common] == tokens[common]:
            common += 1
        del cached.tokens[common:]
        self._free.extend(reversed(cached.blocks[blocks_for(common, self.block_size):]))
        del cached.blocks[blocks_for(common, self.block_size):]
        return common

    def reserve(self, cached: _Cached, num_tokens: int, keep: set[str]) -> bool:
        """Blocks for `num_tokens` tokens of `cached`, taking them from sequences not in
        `keep` (least recently drafted first) when none are free; False when they do not fit."""
        need = blocks_for(num_tokens, self.block_size) - len(cached.blocks)
        victims = (rid for rid in list(self.seqs) if rid not in keep)
        while len(self._free) < need:
            victim = next(victims, None)
            if victim is None:
                return False
            self.release(victim)
        cached.blocks.extend(self._free.pop() for _ in range(max(0, need)))
        return True

    def release(self, request_id: str) -> None:
        cached = self.seqs.pop(request_id, None)
        if cached is not None:
            self._free.extend(reversed(cached.blocks))


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 sampler: Sampler | None = None) -> None:
        self.model = model
        self.cache = DraftCache(model, num_blocks, block_size)
        self.sampler = sampler or Sampler(compile=False)
        self.vocab_size = model.config.vocab_size
        self.device = model.device

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[Draft]:
        drafts: list[Draft] = [NO_DRAFT] * len(seqs)
        rows: list[int] = []  # indices into seqs of the sequences drafted for
        counts: list[int] = []
        starts: list[int] = []
        keep = {seq.request_id for seq, n in zip(seqs, max_tokens, strict=True) if n > 0}
        for i, (seq, count) in enumerate(zip(seqs, max_tokens, strict=True)):
            tokens = seq.token_ids
            count = min(count, self.model.max_positions - len(tokens))
            if count <= 0:
                continue
            cached = self.cache.get(seq.request_id)
            start = self.cache.keep(cached, tokens)
            # KV for every token but the last draft one, which no forward reads.
            if not self.cache.reserve(cached, len(tokens) + count - 1, keep):
                self.cache.release(seq.request_id)
                continue
            rows.append(i)
            counts.append(count)
            starts.append(start)
        if not rows:
            return drafts
        seqs_drafted = [seqs[i] for i in rows]
        cached = [self.cache.get(seq.request_id) for seq in seqs_drafted]
        block_size = self.cache.block_size
        # What each cache lacks, in one forward; its last row's logits give draft token 1.
        pending = [seq.token_ids[start:] for seq, start in zip(seqs_drafted, starts, strict=True)]
        inputs = HostStepInputs.prefill(pending, [c.blocks for c in cached], block_size, starts)
        logits = self.model.forward_logits(inputs.on(self.device), self.cache.kv)
        for c, seq in zip(cached, seqs_drafted, strict=True):
            c.tokens = seq.token_ids
        tokens: list[list[int]] = [[] for _ in rows]
        probabilities: list[list[torch.Tensor]] = [[] for _ in rows]
        active = list(range(len(rows)))
        while True:
            drawn = self._draw(logits, [seqs_drafted[a] for a in active], [tokens[a] for a in active])
            for a, (token, probs) in zip(active, drawn, strict=True):
                tokens[a].append(token)
                if probs is not None:
                    probabilities[a].append(probs)
            active = [a for a in active if len(tokens[a]) < counts[a]]
            if not active:
                break
            # The newest draft token of each sequence that drafts on, into its cache.
            step_tokens = [tokens[a][-1] for a in active]
            positions = [len(cached[a].tokens) for a in active]
            inputs = HostStepInputs.decode(step_tokens, positions, [cached[a].blocks for a in active], block_size)
            logits = self.model.forward_logits(inputs.on(self.device), self.cache.kv)
            for a, token in zip(active, step_tokens, strict=True):
                cached[a].tokens.append(token)
        for a, i in enumerate(rows):
            probs = torch.stack(probabilities[a]).cpu() if probabilities[a] else None
            drafts[i] = Draft(tokens[a], probs)
        return drafts

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence],
              drafted: list[list[int]]) -> list[tuple[int, torch.Tensor | None]]:
        """Each row's next draft token, drawn as the target draws the token at its position
        (see the module docstring), and for a sampled request its draft distribution."""
        tensors = SamplingTensors.build(
            [seq.params for seq in seqs], [seq.seed for seq in seqs],
            [len(seq) + len(d) for seq, d in zip(seqs, drafted, strict=True)], self.vocab_size, self.device,
            [seq.prompt_token_ids for seq in seqs],
            [seq.output_token_ids + d for seq, d in zip(seqs, drafted, strict=True)])
        tokens = self.sampler(logits, tensors).tolist()
        if tensors.all_greedy:
            return [(token, None) for token in tokens]
        probs = torch.softmax(Sampler.processed_logits(logits, tensors), dim=-1)
        return [(token, None if seq.params.greedy else probs[row])
                for row, (token, seq) in enumerate(zip(tokens, seqs, strict=True))]

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)


def load_draft_model_drafter(path: str, max_positions: int | None = None, kv_tokens: int = 1 << 16,
                             block_size: int = 16) -> DraftModelDrafter:
    """The drafter over the model in directory `path`, on the CPU in float32 (where it
    runs, see the module docstring), its KV cache holding `kv_tokens` tokens."""
    model = load_model(path, dtype=torch.float32, device="cpu", max_positions=max_positions, kernels="torch")
    log.info("draft_model_loaded", path=str(path), layers=model.config.num_layers, kv_tokens=kv_tokens)
    return DraftModelDrafter(model, blocks_for(kv_tokens, block_size), block_size)
