"""The EAGLE-3 drafter: a draft head (`hybridd.model.eagle3`) that reads the target's own
hidden states proposes each sequence's next k tokens.

What it is fed: every step's runner hands it the target's residual stream in the head's
three layers for each row (`observe`), with the row's token; a verify step's rows
include the draft tokens it then rejected. Per sequence (`_Track`, keyed by request id)
it keeps the tokens the target has processed, the hidden states it has not yet consumed
(from `hidden_start` on), and the head's own paged KV: one entry per position i whose
pair (target state at i, token i + 1) it has run, valid while the sequence's tokens
0..i+1 are the ones it ran them with.

A proposal for a batch of sequences, each with tokens x_0..x_{n-1} of which the target
has processed all but the last: one prefill-shaped forward of the head over the pairs
its KV lacks (positions c..n-2: state at i, token x_{i+1}), whose last row gives draft
token 1; then k - 1 batched decode forwards, each over the head's previous output and
the token it drafted, one position on. The drafted tokens stay on the device from one
forward to the next; the host reads them once, after the last (with penalties, which
count them, after each). Those speculative positions' KV is written over
by the next proposal, which reruns position n - 1 onwards from the target's states; the
states consumed are dropped. Like the draft model's cache, the record follows tokens,
not steps: verification, preemption (the target recomputes: its new states replace the
old) and plain decode steps need no hook beyond `observe` and `release`. Where the
states do not reach back to what the head's KV lacks (a sequence admitted with a prefix
from the prefix cache, whose prefix the target never ran for it, or whose head KV was
taken for another sequence), the head starts its context over at the first state it has
(`origin`): it attends to the pairs from there on, at their true positions. A sequence
keeps at most `max_pending` states not yet consumed (a long prompt, steps while the
policy does not speculate), its oldest dropped first: each costs 3 x the model's hidden
size in the head's dtype. They are kept in a buffer per sequence with room for a step's
rows after them (`STATE_ROOM`), written in place: a step costs a copy of its own rows,
not of the sequence's states.

Tokens are drawn from the head's logits, scattered into the target's vocabulary, by the
request's own sampler with the target's noise at each position (as the draft model's
are, `draft_model`): a greedy request's draft is the head's argmax, and a sampled
request's is the target's own draw wherever the two distributions agree. Its drafts
carry no distribution: a verify step keeps a draft token iff the target drew it
(`verification`), so the output is the one without speculation, seeded sampling too,
token for token.

Where its forwards run is the `HeadForward` it is given. In the daemon the drafter lives
in the graph generator, on the model's device and in its dtype (`eagle3_runner`: the
head's KV arena, step buffers and CUDA graphs per bucket), fed the rows of the model's
hidden states each `Step` names, straight from the step buffers; the context generator
asks it for drafts as it asks a draft model (`graph_drafter`). A decode row whose token
the context generator did not have yet arrives as -1: the sequence's own token there,
which its drafts bring. In this process (`EagerHeadForward`, the default) it is the
in-process engine's drafter, on the CPU in float32, and the reference the daemon's is
tested against: the same code, forwards run eagerly on a KV cache of its own.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from hybridd.engine.device_copy import to_device
from hybridd.engine.sampler import Sampler, SamplingTensorCache
from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.draft_model import catch_up
from hybridd.engine.speculation.drafter import NO_DRAFT, Draft, draft_sampling_tensors
from hybridd.log import get_logger
from hybridd.model.config import ModelConfig
from hybridd.model.eagle3 import Eagle3Head, load_eagle3_head
from hybridd.model.kv_cache import KVCache, blocks_for
from hybridd.model.step_inputs import HostStepInputs

log = get_logger(__name__)

# The most target states a sequence keeps not yet consumed (see the module docstring).
MAX_PENDING_STATES = 256


class HeadForward(Protocol):
    """One forward of the head over a step's inputs, on its KV cache. `rope` [T] holds the
    rows' positions in their sequences; `hidden` is, for a prefill-shaped step, the
    target's states [T, 3 x target hidden] (mixed down inside), for a decode step the
    head's previous outputs [T, hidden]. `tokens` [T] (on the head's device), where given,
    are the step's input tokens in place of `inputs`' own: a draft step's tokens, which
    the host has not read. Returns, for the step's logits rows, the head's logits
    [R, draft vocab] in float32 and its output before the final norm [R, hidden], valid
    until the next forward."""

    max_tokens: int | None  # the most tokens one forward takes (None: any)
    max_seqs: int | None  # the most sequences one forward takes (None: any)

    def __call__(self, inputs: HostStepInputs, rope: np.ndarray, hidden: torch.Tensor,
                 tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


class EagerHeadForward:
    """The head's forwards in this process, eagerly, on a KV cache of its own."""

    max_tokens = None
    max_seqs = None

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int) -> None:
        self.head = head
        self.kv: KVCache = head.allocate_kv(num_blocks, block_size)

    def __call__(self, inputs: HostStepInputs, rope: np.ndarray, hidden: torch.Tensor,
                 tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.head
        step = inputs.on(head.device)
        if tokens is not None:
            step = dataclasses.replace(step, input_ids=tokens.to(step.input_ids.dtype))
        if step.is_prefill:
            hidden = head.combine(hidden)
        normed, out = head(step, self.kv, hidden, torch.from_numpy(np.asarray(rope, dtype=np.int64)).to(head.device))
        if step.is_prefill:  # a row per sequence: its last
            normed, out = normed.index_select(0, step.logits_indices), out.index_select(0, step.logits_indices)
        return head.compute_logits(normed), out


# Rows a sequence's state buffer has room for past its states when it is (re)made: a
# step's rows are written in place, and the buffer is remade only when they reach its end.
STATE_ROOM = 64


@dataclass
class _Track:
    """One sequence as the drafter knows it (see the module docstring)."""

    tokens: list[int] = field(default_factory=list)  # as the target processed them, from position 0
    # Target states of positions hidden_start .. len(tokens) - 1: rows lo..hi of `states`.
    states: torch.Tensor | None = None
    lo: int = 0
    hi: int = 0
    hidden_start: int = 0
    blocks: list[int] = field(default_factory=list)  # the head's KV
    paired: list[int] = field(default_factory=list)  # x_0..x_c: the head's KV holds positions origin..c-1
    origin: int = 0  # the first position whose pair the head's KV holds (at its slot 0)

    @property
    def hidden(self) -> torch.Tensor | None:
        return None if self.states is None else self.states[self.lo:self.hi]

    def keep_states(self, rows: torch.Tensor, start: int) -> None:
        """The states from position `start` on are `rows` (the ones before it are kept)."""
        kept = start - self.hidden_start if self.states is not None else 0
        if self.states is None or not 0 <= kept <= self.hi - self.lo:  # not contiguous: start over
            kept, self.hidden_start = 0, start
        n = len(rows)
        if self.states is None or self.lo + kept + n > len(self.states):
            fresh = rows.new_empty((kept + n + max(n, STATE_ROOM), rows.shape[1]))
            if kept:
                fresh[:kept].copy_(self.states[self.lo:self.lo + kept])
            self.states, self.lo = fresh, 0
        self.hi = self.lo + kept + n
        self.states[self.lo + kept:self.hi].copy_(rows)

    def drop_states(self, count: int) -> None:
        """Forget the oldest `count` states."""
        self.lo += count
        self.hidden_start += count


def _agrees(known: list[int], tokens: list[int], lo: int, hi: int) -> bool:
    """Whether `known[lo:hi]` are `tokens[lo:hi]`, a -1 standing for the token of `tokens`
    there (filled in)."""
    for i in range(lo, hi):
        if known[i] != tokens[i]:
            if known[i] != -1:
                return False
            known[i] = tokens[i]
    return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Eagle3Drafter:
    name = "eagle3"

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int = 16,
                 sampler: Sampler | None = None, max_pending: int = MAX_PENDING_STATES,
                 forward: HeadForward | None = None) -> None:
        """`forward` runs the head's steps on its KV cache of `num_blocks` blocks (default:
        eagerly in this process, `EagerHeadForward`)."""
        self.head = head
        self.max_pending = max_pending
        self.aux_layers: tuple[int, ...] = head.spec.aux_layers
        self.forward = forward if forward is not None else EagerHeadForward(head, num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sampler = sampler or Sampler(compile=False)
        self.sampling_tensors = SamplingTensorCache(head.device)
        self.vocab_size = head.spec.vocab_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tracks: OrderedDict[str, _Track] = OrderedDict()  # least recently drafted for first

    def observe(self, request_id: str, start: int, tokens: list[int], hidden: torch.Tensor) -> None:
        track = self.tracks.get(request_id)
        if track is None:
            track = self.tracks[request_id] = _Track()
        hidden = hidden.to(self.head.device, self.head.dtype)
        if start > len(track.tokens):  # positions never seen here (a prefix from the cache): unknown
            track.tokens.extend([-1] * (start - len(track.tokens)))
        del track.tokens[start:]
        track.tokens.extend(tokens)
        track.keep_states(hidden, start)
        if track.hi - track.lo > self.max_pending:
            track.drop_states(track.hi - track.lo - self.max_pending)

    def fork(self, parent: str, child: str) -> None:
        track = self.tracks.get(parent)
        if track is not None:
            child_track = self.tracks[child] = _Track(list(track.tokens))
            if track.states is not None:
                child_track.keep_states(track.hidden, track.hidden_start)

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[Draft]:
        drafts: list[Draft] = [NO_DRAFT] * len(seqs)
        rows, counts, starts = [], [], []
        keep = {seq.request_id for seq, n in zip(seqs, max_tokens, strict=True) if n > 0}
        for i, (seq, count) in enumerate(zip(seqs, max_tokens, strict=True)):
            tokens = seq.token_ids
            n = len(tokens)
            count = min(count, self.head.max_positions - n + 1)
            track = self.tracks.get(seq.request_id)
            if count <= 0 or n < 2 or track is None or track.hidden is None:
                continue
            self.tracks.move_to_end(seq.request_id)
            # The target's states of positions hidden_start..n-2 must be of these tokens.
            if len(track.tokens) < n - 1 or not _agrees(track.tokens, tokens, track.hidden_start, n - 1):
                continue
            # The head's KV holds pairs origin..c-1; it needs the target's states for c..n-2.
            c = min(max(_common_prefix(track.paired, tokens) - 1, track.origin), n - 2)
            if c < track.hidden_start:  # states gone: the head's context starts over at the first one kept
                if track.hidden_start > n - 2:
                    continue
                track.origin = c = track.hidden_start
                track.paired = []
            # KV for positions up to n - 2 (the pairs) and n - 1 .. n + count - 3 (draft steps).
            if not self._reserve(track, max(n - 1, n + count - 2) - track.origin, keep):
                continue
            rows.append(i)
            counts.append(count)
            starts.append(c)
        if not rows:
            return drafts
        drafted = [seqs[i] for i in rows]
        tracks = [self.tracks[seq.request_id] for seq in drafted]
        logits, hidden = self._catch_up(drafted, tracks, starts)
        for track, seq in zip(tracks, drafted, strict=True):
            n = len(seq)
            track.paired = list(seq.token_ids)  # its own list: a served sequence's tokens grow in place
            # States consumed but the last pair's, which a proposal over the same tokens reruns.
            track.drop_states(n - 2 - track.hidden_start)
        # Each draft step's tokens stay on the device and feed the next forward there; the
        # host reads them once, at the end (a read per step would leave the GPU idle while
        # the host prepares the next one). Penalties count the tokens drafted so far, so a
        # batch with them reads each step's (`_draw`).
        penalised = any(seq.params.has_penalties for seq in drafted)
        tokens: list[list[int]] = [[] for _ in rows]  # read per step only where penalised
        made = [0] * len(rows)
        drawn: list[tuple[list[int], torch.Tensor]] = []  # per forward: its rows and their tokens
        active = list(range(len(rows)))
        while True:
            step_tokens = self._draw(logits, [drafted[a] for a in active], [len(drafted[a]) + made[a] for a in active],
                                     [tokens[a] for a in active] if penalised else None)
            drawn.append((active, step_tokens))
            if penalised:
                for a, token in zip(active, step_tokens.tolist(), strict=True):
                    tokens[a].append(token)
            for a in active:
                made[a] += 1
            still = [j for j, a in enumerate(active) if made[a] < counts[a]]
            if not still:
                break
            if len(still) < len(active):
                # Its own list of rows: the next forward writes over the last one's outputs.
                index = to_device(torch.tensor(still, dtype=torch.int64), hidden.device)
                hidden, step_tokens = hidden.index_select(0, index), step_tokens.index_select(0, index)
                active = [active[j] for j in still]
            positions = [len(drafted[a]) - 2 + made[a] for a in active]
            inputs = HostStepInputs.decode([0] * len(active),
                                           [p - tracks[a].origin for p, a in zip(positions, active, strict=True)],
                                           [tracks[a].blocks for a in active], self.block_size)
            logits, hidden = self.forward(inputs, np.asarray(positions, dtype=np.int64), hidden, step_tokens)
        drafted_tokens: list[list[int]] = [[] for _ in rows]
        read = iter(torch.cat([t for _, t in drawn]).tolist())
        for step_rows, _ in drawn:
            for a in step_rows:
                drafted_tokens[a].append(next(read))
        for a, i in enumerate(rows):
            drafts[i] = Draft(drafted_tokens[a])
        return drafts

    def _catch_up(self, drafted: list[Sequence], tracks: list[_Track],
                  starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs each head KV lacks (positions starts[i]..n-2: the target's state there
        and the next token) into it, in as few prefill-shaped forwards as the forward
        takes; each sequence's last row's (logits, output)."""
        pending = [seq.token_ids[c + 1:] for seq, c in zip(drafted, starts, strict=True)]
        states = [t.hidden[c - t.hidden_start:len(seq) - 1 - t.hidden_start]
                  for t, seq, c in zip(tracks, drafted, starts, strict=True)]

        def forward(parts: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
            # Positions in the head's KV count from each track's origin; RoPE reads the true ones.
            inputs = HostStepInputs.prefill([pending[s][o:o + n] for s, o, n in parts],
                                            [tracks[s].blocks for s, _, _ in parts], self.block_size,
                                            [starts[s] + o - tracks[s].origin for s, o, _ in parts])
            rope = inputs.positions.astype(np.int64) + np.repeat([tracks[s].origin for s, _, _ in parts],
                                                                 [n for _, _, n in parts])
            return self.forward(inputs, rope, torch.cat([states[s][o:o + n] for s, o, n in parts]))

        logits, hidden = catch_up([len(p) for p in pending], self.forward.max_tokens, self.forward.max_seqs, forward)
        return logits, hidden

    def _draw(self, draft_logits: torch.Tensor, seqs: list[Sequence], positions: list[int],
              drafted: list[list[int]] | None) -> torch.Tensor:
        """Each row's next draft token (a target id, on the device), drawn as the target
        draws the token at its position (`positions`); `drafted`, each row's draft tokens
        so far, where a row has penalties (they count them)."""
        logits = draft_logits.new_full((draft_logits.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.head.draft_to_target] = draft_logits
        tensors = draft_sampling_tensors(self.sampling_tensors, seqs, positions, drafted, self.vocab_size)
        return self.sampler(logits, tensors)

    def _reserve(self, track: _Track, num_tokens: int, keep: set[str]) -> bool:
        """Blocks of the head's KV for `num_tokens` positions of `track`, taken from sequences
        not in `keep` (least recently drafted first) when none are free."""
        need = blocks_for(num_tokens, self.block_size) - len(track.blocks)
        victims = (rid for rid in list(self.tracks) if rid not in keep)
        while len(self._free) < need:
            victim = next(victims, None)
            if victim is None:
                return False
            self._drop_kv(self.tracks[victim])
        track.blocks.extend(self._free.pop() for _ in range(max(0, need)))
        return True

    def _drop_kv(self, track: _Track) -> None:
        self._free.extend(reversed(track.blocks))
        track.blocks, track.paired, track.origin = [], [], 0

    def release(self, request_id: str) -> None:
        track = self.tracks.pop(request_id, None)
        if track is not None:
            self._drop_kv(track)

    def kv_blocks(self) -> dict[str, int]:
        return {"total": self.num_blocks, "free": len(self._free), "block_size": self.block_size}


def load_eagle3_drafter(head_dir: str, model_dir: str, max_positions: int | None = None, kv_tokens: int = 1 << 16,
                        block_size: int = 16, embed_tokens: torch.nn.Embedding | None = None) -> Eagle3Drafter:
    """The drafter over the head in `head_dir` for the model in `model_dir` (whose embedding
    it reads, where the head has none: `embed_tokens`, else the model's checkpoint), on the
    CPU in float32 (where it runs, see the module docstring), its KV holding `kv_tokens` tokens."""
    head = load_eagle3_head(head_dir, ModelConfig.from_dir(model_dir), model_dir, embed_tokens, max_positions)
    log.info("eagle3_head_loaded", path=str(head_dir), aux_layers=list(head.spec.aux_layers),
             draft_vocab=head.spec.draft_vocab_size, kv_tokens=kv_tokens)
    return Eagle3Drafter(head, blocks_for(kv_tokens, block_size), block_size)
