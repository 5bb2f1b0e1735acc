"""The draft-model drafter: a small Llama-family model with the target's tokenizer
proposes each sequence's next k tokens by decoding them itself.

It keeps a paged KV cache of its own (`DraftCache`: its blocks, and per sequence the
tokens whose KV that cache holds). A proposal for a batch of sequences is one
prefill-shaped forward over what each sequence's cache lacks (a new sequence's whole
prompt; after a verify step, the tokens it kept; split into several forwards where it
passes what one forward takes), whose last row gives draft token 1, then k - 1 batched
decode forwards, one per further token. The cache follows the sequence's tokens, not
the steps that made them: before each proposal it keeps the longest prefix of its
tokens that the sequence still has and drops the rest (the rejected draft tokens of
the last verify step), so verification, preemption (tokens are kept, the target's KV
recomputed: the draft's stays valid), plain decode steps between verify steps and
`n > 1` (forks are sequences of their own, keyed by their `request_id`) need no hook
beyond `release`. When its blocks run short it drops the caches of the sequences that
drafted least recently (they are prefilled again when next drafted for); a sequence
that still does not fit, or that would pass the draft's positions, gets no draft.

Each token is drawn from the draft's logits by the request's own sampler (`Sampler`:
penalties, temperature, top-k/top-p) with the noise the target uses at that position
(keyed by the request's seed and the token's position), so a greedy request's draft is
the draft's argmax and a sampled request's a draw from the draft's distribution, which
verification scores by the rejection rule (`verification`: its own uniforms and residual
noise are keyed apart from this noise). `Draft.probabilities` is, for sampled requests,
the distribution each token was drawn from, the softmax of the processed draft logits
(`Sampler.processed_logits`: the request's temperature applied).

Where its forwards run is the `DraftForward` it is given. In the daemon the drafter
lives in the graph generator (`draft_runner`: the draft model on the target's device,
its KV arena, its step buffers and its CUDA graphs per bucket), and the context
generator asks it for drafts (`graph_drafter`). In this process (`EagerForward`, the
default) it is the in-process engine's drafter and the reference the daemon's is
tested against: the same code, forwards run eagerly on a KV cache of its own.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridd.engine.device_copy import to_device
from hybridd.engine.sampler import Sampler, SamplingTensorCache
from hybridd.engine.speculation.drafter import NO_DRAFT, Draft, draft_sampling_tensors
from hybridd.model.kv_cache import KVCache, blocks_for
from hybridd.model.llama import LlamaModel
from hybridd.model.step_inputs import HostStepInputs
from hybridd.protocol.messages import SamplingParams


class DraftedSequence(Protocol):
    """What the drafter reads of a sequence (`hybridd.engine.sequence.Sequence` is one)."""

    request_id: str
    params: SamplingParams
    seed: int

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    def __len__(self) -> int: ...


class DraftForward(Protocol):
    """One forward of the draft model over a step's inputs, on its KV cache: the logits of
    the step's logits rows, valid until the next forward. `tokens` [T] (on the model's
    device), where given, are the step's input tokens in place of `inputs`' own: a draft
    step's tokens, which the host has not read."""

    max_tokens: int | None  # the most tokens one forward takes (None: any)
    max_seqs: int | None  # the most sequences one forward takes (None: any)

    def __call__(self, inputs: HostStepInputs, tokens: torch.Tensor | None = None) -> torch.Tensor: ...


class EagerForward:
    """The draft model's forwards in this process, eagerly, on a KV cache of its own."""

    max_tokens = None
    max_seqs = None

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.kv = KVCache.allocate(model.config, num_blocks, block_size, model.dtype, model.device)

    def __call__(self, inputs: HostStepInputs, tokens: torch.Tensor | None = None) -> torch.Tensor:
        step = inputs.on(self.model.device)
        if tokens is not None:
            step = dataclasses.replace(step, input_ids=tokens.to(step.input_ids.dtype))
        return self.model.forward_logits(step, self.kv)


@dataclass
class _Cached:
    """One sequence's part of the draft cache: its blocks, and the tokens whose KV they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftCache:
    """Who holds which blocks of the draft model's paged KV cache, and the tokens whose KV
    each sequence's blocks hold."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.seqs: OrderedDict[str, _Cached] = OrderedDict()  # least recently drafted for first

    @property
    def num_free(self) -> int:
        return len(self._free)

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
                 sampler: Sampler | None = None, forward: DraftForward | None = None) -> None:
        """`forward` runs the draft model's steps on its KV cache of `num_blocks` blocks
        (default: eagerly in this process, `EagerForward`)."""
        self.model = model
        self.cache = DraftCache(num_blocks, block_size)
        self.forward = forward if forward is not None else EagerForward(model, num_blocks, block_size)
        self.sampler = sampler or Sampler(compile=False)
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        self.sampling_tensors = SamplingTensorCache(model.device)

    @torch.inference_mode()
    def propose(self, seqs: Seq[DraftedSequence], max_tokens: Seq[int]) -> list[Draft]:
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
        # What each cache lacks; each sequence's last row's logits give its draft token 1.
        pending = [seq.token_ids[start:] for seq, start in zip(seqs_drafted, starts, strict=True)]
        logits = self._catch_up(pending, [c.blocks for c in cached], starts)
        for c, seq in zip(cached, seqs_drafted, strict=True):
            c.tokens = list(seq.token_ids)  # its own list: the draft tokens are appended to it
        # Each draft step's tokens stay on the device and feed the next forward there; the
        # host reads them once, at the end (a read per step would leave the GPU idle while
        # the host prepares the next one). Penalties count the tokens drafted so far, so a
        # batch with them reads each step's.
        penalised = any(seq.params.has_penalties for seq in seqs_drafted)
        tokens: list[list[int]] = [[] for _ in rows]  # read per step only where penalised
        probabilities: list[list[torch.Tensor]] = [[] for _ in rows]
        made = [0] * len(rows)
        drawn: list[tuple[list[int], torch.Tensor]] = []  # per forward: its rows and their tokens
        active = list(range(len(rows)))
        while True:
            step_seqs = [seqs_drafted[a] for a in active]
            step_tokens, probs = self._draw(logits, step_seqs, [len(seqs_drafted[a]) + made[a] for a in active],
                                            [tokens[a] for a in active] if penalised else None)
            drawn.append((active, step_tokens))
            for j, (a, seq) in enumerate(zip(active, step_seqs, strict=True)):
                made[a] += 1
                if probs is not None and not seq.params.greedy:
                    probabilities[a].append(probs[j])
            if penalised:
                for a, token in zip(active, step_tokens.tolist(), strict=True):
                    tokens[a].append(token)
            still = [j for j, a in enumerate(active) if made[a] < counts[a]]
            if not still:
                break
            if len(still) < len(active):
                step_tokens = step_tokens.index_select(0, to_device(torch.tensor(still), step_tokens.device))
                active = [active[j] for j in still]
            # The newest draft token of each sequence that drafts on, into its cache.
            positions = [len(cached[a].tokens) + made[a] - 1 for a in active]
            inputs = HostStepInputs.decode([0] * len(active), positions, [cached[a].blocks for a in active], block_size)
            logits = self.forward(inputs, step_tokens)
        drafted: list[list[int]] = [[] for _ in rows]
        read = iter(torch.cat([t for _, t in drawn]).tolist())
        for step_rows, _ in drawn:
            for a in step_rows:
                drafted[a].append(next(read))
        for a, i in enumerate(rows):
            cached[a].tokens.extend(drafted[a][:-1])  # every draft token but the last went through a forward
            drafts[i] = Draft(drafted[a], torch.stack(probabilities[a]) if probabilities[a] else None)
        return drafts

    def _catch_up(self, pending: list[list[int]], tables: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Each cache's missing tokens `pending[i]` (from position `starts[i]`) into it, in
        as few prefill-shaped forwards as the forward takes (`catch_up`); the logits of
        each sequence's last token [len(pending), V]."""

        def forward(parts: list[tuple[int, int, int]]) -> tuple[torch.Tensor]:
            return (self.forward(HostStepInputs.prefill([pending[s][o:o + n] for s, o, n in parts],
                                                        [tables[s] for s, _, _ in parts], self.cache.block_size,
                                                        [starts[s] + o for s, o, _ in parts])),)

        (logits,) = catch_up([len(p) for p in pending], self.forward.max_tokens, self.forward.max_seqs, forward)
        return logits

    def _draw(self, logits: torch.Tensor, seqs: list[DraftedSequence], positions: list[int],
              drafted: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's next draft token (on the device), drawn as the target draws the token at
        its position (`positions`; see the module docstring), and unless every row is greedy
        the rows' draft distributions (a sampled row's is its own); `drafted`, each row's
        draft tokens so far, where a row has penalties (they count them)."""
        tensors = draft_sampling_tensors(self.sampling_tensors, seqs, positions, drafted, self.vocab_size)
        tokens = self.sampler(logits, tensors)
        if tensors.all_greedy:
            return tokens, None
        return tokens, torch.softmax(Sampler.processed_logits(logits, tensors), dim=-1)

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)

    def kv_blocks(self) -> dict[str, int]:
        cache = self.cache
        return {"total": cache.num_blocks, "free": cache.num_free, "block_size": cache.block_size}


def catch_up(lengths: list[int], max_tokens: int | None, max_seqs: int | None,
             forward: Callable[[list[tuple[int, int, int]]], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """A drafter's catch-up over sequences of `lengths` new tokens: `forward` run on each of
    the prefill-shaped forwards that take them (`catch_up_parts`: its parts), and of each
    of its outputs (rows in the parts' order), each sequence's last row [len(lengths), ...]."""
    forwards = catch_up_parts(lengths, max_tokens, max_seqs)
    last: list[tuple[torch.Tensor, ...] | None] = [None] * len(lengths)
    for parts in forwards:
        outputs = forward(parts)
        if len(forwards) == 1:
            return outputs  # the usual case: one forward took every sequence whole
        for row, (s, o, n) in enumerate(parts):
            if o + n == lengths[s]:  # the next forward writes over these rows
                last[s] = tuple(output[row].clone() for output in outputs)
    return tuple(torch.stack(rows) for rows in zip(*last))  # type: ignore[misc]


def catch_up_parts(lengths: list[int], max_tokens: int | None,
                   max_seqs: int | None) -> list[list[tuple[int, int, int]]]:
    """The prefill-shaped forwards that take sequences of `lengths` new tokens each, in
    order, at most `max_tokens` tokens and `max_seqs` sequences to a forward (None: any):
    per forward, its (sequence, offset into its new tokens, tokens) parts. A sequence
    longer than a forward takes is split over several, each part after the last."""
    budget = max_tokens or sum(lengths)
    width = max_seqs or len(lengths)
    done = [0] * len(lengths)
    forwards = []
    first = 0
    while first < len(lengths):
        parts: list[tuple[int, int, int]] = []
        room, i = budget, first
        while i < len(lengths) and room > 0 and len(parts) < width:
            take = min(room, lengths[i] - done[i])
            parts.append((i, done[i], take))
            room -= take
            done[i] += take
            if done[i] < lengths[i]:
                break
            i += 1
        forwards.append(parts)
        first = i
    return forwards
