"""Continuous batching: which sequences run in the next step, and the step's inputs.

Decode first, prompts in chunks (vLLM V1's unified step): every step carries a token
for each running sequence past its prompt, and fills the rest of a token budget
(`chunk_tokens`; `max_prefill_tokens` in a step where nothing decodes, so a prompt
that finds no stream running is prefilled whole) with chunks of prompts, shared out
evenly among them, so a long prompt is prefilled over several steps while the streams
keep ticking, and a short one behind it waits a chunk per step. Prompts are admitted first come, first served when
their KV blocks fit above the block manager's watermark, with blocks for the whole
prompt; a chunk's rows start where the prompt's KV written so far ends. A step with
chunks is a prefill step whose first rows are the decode rows; one without is a
decode step (the decode graphs' fast path). When decode runs out of KV
blocks, the most recently admitted sequence is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue, keeping its output
so that its next prefill covers prompt + output so far. A sequence is admitted with
the blocks of its prefix that the block manager's prefix cache holds (a recomputed
one usually finds its own), and its prefill row starts after them.

A request for n sequences is queued as one sequence carrying n − 1 forks: its prefill
runs once, and the forks join the running batch at its final chunk, each sampling its own
first token from the prompt's logits and sharing the prompt's KV blocks (the step
lists the partly filled blocks to copy). After that they are ordinary sequences.

With a speculator, a step of decode rows only may be a verify step: each sequence's
last token and the tokens its drafter proposed are decode rows at consecutive
positions, every row with logits; `postprocess_verify` keeps, per sequence, the draft's
prefix that its rows kept (`verification`) and the next row's token, rewinds past the
rest (their KV slots are written over later, their reserved blocks let go) and offers
the cache only blocks of kept tokens. A draft follows every token, so a speculating step is scheduled
only once the tokens of the steps before it are on the host (the policy chooses
speculation per batch size where that has measured cheaper per token).

The scheduler may run one step ahead of `postprocess` (the overlapped pipeline):
a decode row whose input token is still on the device carries the (step, row) that
sampled it in `input_src_step` / `input_src_row` instead of a host token id.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Collection
from functools import cached_property
from dataclasses import dataclass, field

import torch

from hybridd.engine.block_manager import BlockManager
from hybridd.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from hybridd.engine.prompt import prompt_length_refusal
from hybridd.engine.sampler import SamplingTensors
from hybridd.engine.sequence import Sequence, SequenceStatus
from hybridd.engine.speculation.speculator import Speculator
from hybridd.engine.speculation.verification import DraftDistribution, verify_sampling_tensors
from hybridd.engine.stop_criteria import StopCriteria
from hybridd.log import get_logger
from hybridd.model.step_inputs import HostStepInputs

log = get_logger("scheduler")


class AdmissionError(ValueError):
    """A request that can never run; `field` names the request field to change."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class BatchKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"  # decode rows for a sequence's last token and each of its draft tokens


@dataclass
class ScheduledBatch:
    """One step: its sequences (row i is `seqs[i]`), its inputs, and where the input
    tokens that are still on the device come from."""

    kind: BatchKind
    step_id: int
    seqs: list[Sequence]
    inputs: HostStepInputs  # unpadded; input_ids are -1 where the token is still on the device
    # Decode only (None for a prefill, whose tokens are all the prompt's, on the host):
    # None when every input token is on the host (a prefill step without such decode rows):
    input_src_step: torch.Tensor | None  # [T] int64; step that sampled the input token, -1 when on host
    input_src_row: torch.Tensor | None  # [T] int64; its row in that step's sampled tokens
    # Forks sampled from a row's logits in this step: (row, forked sequence), and the KV
    # blocks to copy (source, destination) before the next step reads them.
    forks: list[tuple[int, Sequence]] = field(default_factory=list)
    kv_copies: list[tuple[int, int]] = field(default_factory=list)
    # Rows of prompt chunks that do not end their prompt: their logits are not sampled.
    partial_rows: frozenset[int] = frozenset()
    # The first rows are decode rows, one token each (all of a decode step's rows).
    num_decode_rows: int = 0
    # Logits rows of each row's sequence: its last this-many tokens (None: one each, its
    # last). A prefill sequence that asks for its prompt's logprobs lists its chunk's.
    logit_rows: list[int] | None = None
    # (row, first position) of the prompt chunks whose rows give their prompt's logprobs.
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    # A verify step: each sequence's draft tokens (its rows are its last token and these,
    # in order, each with logits); None for other steps.
    drafts: list[list[int]] | None = None
    # A verify step of a drafter with distributions: per sequence, the draft tokens its rows
    # score by the rejection rule (`verification.DraftDistribution`); None for other drafters.
    draft_distributions: list[DraftDistribution | None] | None = None
    # Scheduled while speculation was chosen for its batch size (a verify step, or a
    # decode step of it that found no drafts): its time is measured for that choice.
    speculating: bool = False

    @property
    def is_verify(self) -> bool:
        return self.kind is BatchKind.VERIFY

    @property
    def is_prefill(self) -> bool:
        return self.kind is BatchKind.PREFILL

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return self.inputs.num_tokens

    @cached_property
    def sampled_seqs(self) -> list[Sequence]:
        """The sequences that get a token from this step: the rows that end a prompt or
        decode, then the forks. Known once the batch is built (its rows, partial rows and
        forks are not changed after), it is listed once: a step reads it several times
        between its scheduling and its retirement."""
        return [seq for row, seq in enumerate(self.seqs) if row not in self.partial_rows] + [
            seq for _, seq in self.forks]

    @property
    def num_logit_rows(self) -> int:
        """Rows of the step's logits: each sequence's `logit_rows`, else one per row of the
        inputs (one per sequence; a verify step's one per token)."""
        return self.inputs.num_seqs if self.logit_rows is None else sum(self.logit_rows)

    @property
    def num_rows(self) -> int:
        """Rows the forward runs: its sequences, or its logits rows where there are more."""
        return max(len(self.seqs), self.num_logit_rows)

    def last_logit_row(self, row: int) -> int:
        """The logits row of sequence row `row`'s last token."""
        if self.logit_rows is None:
            return row
        return sum(self.logit_rows[:row + 1]) - 1

    @property
    def sample_rows(self) -> list[int]:
        """For each sampled sequence, the row of the step's logits it samples from."""
        return [self.last_logit_row(row) for row in range(len(self.seqs)) if row not in self.partial_rows] + [
            self.last_logit_row(row) for row, _ in self.forks]

    @property
    def selects_rows(self) -> bool:
        """Whether the sampled rows are other than the step's logits rows in order (forks,
        chunks that sample nothing, sequences with several rows): the logits are then
        gathered by `sample_rows`."""
        if self.is_verify:  # every row is sampled, in order
            return False
        return bool(self.forks or self.partial_rows) or self.num_logit_rows != len(self.seqs)

    def sampling_tensors(self, vocab_size: int, device: torch.device | str = "cpu") -> SamplingTensors:
        """The sampling tensors of the rows the step samples: a verify step's every row, at
        its draft token's position (`verify_sampling_tensors`); else each sampled
        sequence's next token."""
        if self.drafts is not None:
            return verify_sampling_tensors(self.sampled_seqs, self.drafts, vocab_size, device)
        return SamplingTensors.from_sequences(self.sampled_seqs, vocab_size, device)

    @property
    def inputs_on_device(self) -> bool:
        """True when some input tokens must be gathered from earlier steps' device output
        (only decode rows' can be: a prompt's tokens, and output the host has, are on it)."""
        return self.input_src_step is not None and bool((self.input_src_step >= 0).any())


def fair_shares(needs: list[int], budget: int) -> list[int]:
    """Tokens for each of the prompts that `needs` tokens, within `budget`: the budget
    split evenly, a prompt needing less than its share leaving the rest to the others
    (water-filling); what integer division leaves goes to the first in order. Every
    prompt gets at least one token while there are no more prompts than tokens."""
    if sum(needs) <= budget:
        return list(needs)  # each gets all it needs (the usual step: one prompt)
    shares = [0] * len(needs)
    left = budget
    order = sorted(range(len(needs)), key=needs.__getitem__)
    while order and needs[order[0]] <= left // len(order):
        index = order.pop(0)
        shares[index] = needs[index]
        left -= needs[index]
    for index in sorted(order):  # each needs more than an even share: it gets one
        shares[index] = min(needs[index], left // len(order))
    for index in sorted(order):
        extra = min(needs[index] - shares[index], left - sum(shares[i] for i in order))
        shares[index] += extra
    return shares


@dataclass
class StepStats:
    """What the scheduled steps carried, for status and metrics: steps, the tokens in
    them, steps with prompt chunks, and of those the chunked ones (a prompt's chunk
    that does not end it, or that starts after its first token) and the mixed ones
    (with decode rows)."""

    steps: int = 0
    tokens: int = 0
    prefill_steps: int = 0
    chunked_prefill_steps: int = 0
    mixed_steps: int = 0

    def count(self, batch: ScheduledBatch, chunks: list[tuple[Sequence, int, int]]) -> None:
        self.steps += 1
        self.tokens += batch.num_tokens
        if chunks:
            self.prefill_steps += 1
            self.chunked_prefill_steps += any(start > 0 or start + n < len(seq) for seq, start, n in chunks)
            self.mixed_steps += batch.num_decode_rows > 0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch: int,
        max_prefill_tokens: int,
        max_model_len: int,
        block_table_width: int | None = None,
        max_prefill_seqs: int | None = None,
        eos_token_ids: Collection[int] = (),
        tokenizer: Tokenizer | None = None,
        chunk_tokens: int | None = None,
        speculator: Speculator | None = None,
        max_verify_rows: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.speculator = speculator
        # The most rows a verify step has (the largest decode graph's rows in the daemon).
        self.max_verify_rows = max_verify_rows if max_verify_rows is not None else max_batch
        self._verifying: set[str] = set()  # sequences whose verify step is in flight
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        # The budget of a step beside running streams (None: the same as without).
        self.chunk_tokens = min(chunk_tokens or max_prefill_tokens, max_prefill_tokens)
        self.max_model_len = max_model_len
        # The most prompts one step carries chunks of.
        self.max_prefill_seqs = min(max_batch, max_prefill_seqs or max_batch)
        min_width = block_manager.blocks_for(max_model_len)
        self.block_table_width = block_table_width if block_table_width is not None else min_width
        if self.block_table_width < min_width:
            raise ValueError(
                f"block_table_width {self.block_table_width} cannot hold max_model_len {max_model_len} "
                f"tokens in blocks of {block_manager.block_size}; need >= {min_width}"
            )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.requests: dict[str, Sequence] = {}
        self._fork_parent: dict[str, Sequence] = {}  # a fork not yet forked -> the sequence it waits on
        self._prefill_left: set[str] = set()  # admitted sequences whose final chunk is not scheduled yet
        self._next_step_id = 0
        self.num_preemptions = 0
        self.stats = StepStats()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raise AdmissionError when it can never run."""
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already scheduled")
        if (refusal := prompt_length_refusal(len(seq), self.max_model_len)) is not None:
            raise AdmissionError(refusal, "prompt")
        # A request must fit the KV cache alone even at its longest, or preemption
        # could never make room for it.
        longest = min(len(seq) + seq.params.max_tokens, self.max_model_len)
        bm = self.block_manager
        if bm.blocks_for(longest) > bm.num_admissible_blocks:
            prompt_fits = bm.blocks_for(len(seq) + 1) <= bm.num_admissible_blocks
            raise AdmissionError(
                f"request may reach {longest} tokens (prompt {len(seq)} + max_tokens {seq.params.max_tokens}, "
                f"max_model_len {self.max_model_len}), needing {bm.blocks_for(longest)} KV blocks; "
                f"the KV cache has num_blocks {bm.num_blocks} ({bm.num_admissible_blocks} admissible)",
                "sampling.max_tokens" if prompt_fits else "prompt",
            )
        if 1 + len(seq.forks) > self.max_batch:
            raise AdmissionError(f"{1 + len(seq.forks)}; the daemon runs at most max_batch {self.max_batch} "
                                 f"sequences at once", "sampling.n")
        at_prefill = bm.blocks_for(len(seq)) + len(seq.forks) * bm.fork_blocks(len(seq))
        if seq.forks and at_prefill > bm.num_admissible_blocks:
            raise AdmissionError(f"{1 + len(seq.forks)} sequences need {at_prefill} KV blocks at their "
                                 f"prefill; the KV cache has {bm.num_admissible_blocks} admissible", "sampling.n")
        for fork in seq.forks:
            if fork.request_id in self.requests or fork.prompt_token_ids != seq.prompt_token_ids:
                raise ValueError(f"fork {fork.request_id!r} is already scheduled or has another prompt")
        for member in (seq, *seq.forks):
            member.stop_criteria = StopCriteria(member.params, self.eos_token_ids, self.max_model_len)
            if self.tokenizer is not None:
                member.detokenizer = IncrementalDetokenizer(self.tokenizer, member.prompt_token_ids)
            member.status = SequenceStatus.WAITING
            self.requests[member.request_id] = member
        for fork in seq.forks:
            self._fork_parent[fork.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str, reason: str = "cancelled") -> Sequence | None:
        """End a waiting or running request for `reason` (cancelled, timeout); returns it,
        or None when it is unknown or already finished. A token still in flight for it
        is discarded."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, reason)
        log.info("request aborted", request_id=request_id, reason=reason, output_tokens=seq.num_output_tokens)
        return seq

    def schedule(self) -> ScheduledBatch | None:
        """The next step, or None when nothing can run until `postprocess` lands
        (a preempted sequence waits for its in-flight token) or no work is left.

        Decode first: every running sequence past its prompt gets its next token. The
        rest of the step's token budget (`chunk_tokens` less those rows; with none,
        `max_prefill_tokens`) goes to
        prompt chunks, shared out among the prompts being prefilled and those admitted
        now (`fair_shares`), so a short prompt behind long ones waits a chunk per step,
        not their whole prefills. A step with chunks is a prefill step whose first rows
        are the decode rows (one token each); a step without is a decode step."""
        if self._verifying:
            return None  # a verify step's tokens decide where its sequences go on
        speculating = self._speculates()
        if speculating is None:
            return None  # drafts are made from every token: the ones in flight land first
        decodes = self._decode_rows()
        budget = self.chunk_tokens if decodes else self.max_prefill_tokens
        chunks = self._within_rows(self._prefill_chunks(budget - len(decodes)), len(decodes))
        if not decodes and not chunks:
            return None
        step_id = self._take_step_id()
        if self.speculator is not None and decodes:
            self.speculator.policy.scheduled(len(decodes))
        if chunks:
            batch = self._mixed_batch(step_id, decodes, chunks)
        else:
            drafts, distributions = self._drafts(decodes) if speculating else ([], [])
            # A draft token its grammar refused is still scored by the rule (`verification`).
            if any(drafts) or any(d is not None and d.tokens for d in distributions):
                batch = self._verify_batch(step_id, decodes, drafts, distributions)
            else:
                batch = self._decode_batch(step_id, decodes)
            batch.speculating = speculating
        self.stats.count(batch, chunks)
        return batch

    def postprocess(self, batch: ScheduledBatch, next_token_ids: list[int]) -> list[Sequence]:
        """Append each row's sampled token; return the sequences that finished."""
        finished = []
        for seq, token_id in zip(batch.sampled_seqs, next_token_ids, strict=True):
            seq.num_inflight_tokens -= 1
            seq.new_text = ""
            if seq.is_finished:
                continue  # sampled one step past its end, or aborted meanwhile
            if self._append(seq, token_id):
                finished.append(seq)
            elif seq.grammar_ended:  # its structured output is complete (an ignored EOS included)
                self._finish(seq, "stop", token_id)
                finished.append(seq)
        return finished

    def postprocess_verify(self, batch: ScheduledBatch, row_tokens: list[int]) -> tuple[
            list[Sequence], list[list[tuple[int, str, int]]]]:
        """A verify step's tokens (one per row): each sequence keeps the longest prefix of
        its draft that its rows kept, and the row's token after it (`Speculator`).
        Returns the sequences that finished, and for each sequence the (token, text, row)
        it appended, in order (a stop ends it early: the rest are dropped)."""
        assert batch.drafts is not None and self.speculator is not None
        finished, appended = [], []
        row = 0
        for seq, draft in zip(batch.seqs, batch.drafts, strict=True):
            rows = row_tokens[row:row + len(draft) + 1]
            first_row, row = row, row + len(draft) + 1
            self._verifying.discard(seq.request_id)
            seq.num_inflight_tokens -= 1
            seq.new_text = ""
            entries: list[tuple[int, str, int]] = []
            appended.append(entries)
            if seq.is_finished:
                continue
            kept = self.speculator.verified(seq, draft, rows)
            # The KV of the kept draft tokens is written; the rows after them are not
            # this sequence's tokens, and their slots are written over later.
            seq.num_computed_tokens += len(kept) - 1
            for j, token in enumerate(kept):
                done = self._append(seq, token)
                entries.append((token, seq.new_text, first_row + j))
                if not done and seq.grammar_ended:  # its structured output is complete
                    self._finish(seq, "stop", token)
                    done = True
                if done:
                    finished.append(seq)
                    break
            if not seq.is_finished:
                self.block_manager.trim(seq)
                self.block_manager.cache_blocks(seq)
        if self.speculator is not None:
            self.speculator.stats.verify_steps += 1
        return finished, appended

    def observe_step(self, batch: ScheduledBatch, seconds: float, tokens: int) -> None:
        """A decode or verify step's measured time and the tokens it gave (the policy's costs)."""
        if self.speculator is not None and not batch.is_prefill:
            self.speculator.policy.observe_step(len(batch.seqs), batch.speculating, seconds, tokens)

    def _append(self, seq: Sequence, token_id: int) -> bool:
        """Append one token, its text and the stop criteria's verdict; True when it ended the sequence."""
        seq.append_token(token_id)
        new_text = seq.detokenizer.add(seq.output_token_ids) if seq.detokenizer is not None else ""
        result = seq.stop_criteria.check(token_id, new_text, seq.num_output_tokens, len(seq))
        seq.new_text = result.text
        seq.output_text += result.text
        if result.finish_reason is not None:
            self._finish(seq, result.finish_reason, result.stop_reason)
            return True
        return False

    # ------------------------------------------------------------ speculation
    def _speculates(self) -> bool | None:
        """Whether this step is scheduled speculating (the policy's choice for the
        batch size), or None when it would, but a decoding sequence's token is still in
        flight (a draft follows every token: the step waits for it to land)."""
        if self.speculator is None:
            return False
        decoding = [seq for seq in self.running if not self._prefilling(seq)]
        if not any(seq.speculative for seq in decoding) or 2 * len(decoding) > self.max_verify_rows:
            return False  # nothing to draft for, or no room for a draft token per sequence
        if not self.speculator.policy.speculates(len(decoding)):
            return False
        if any(seq.num_inflight_tokens for seq in decoding):
            return None
        return True

    def _drafts(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[DraftDistribution | None]]:
        """Each decode row's draft tokens: within its max_tokens and max_model_len (a kept
        draft never passes them), the verify step's rows, its grammar, and the KV blocks
        free now; and what its rows score by the rejection rule, for a drafter with distributions."""
        assert self.speculator is not None
        spare_rows = max(0, self.max_verify_rows - len(seqs))
        per_seq = spare_rows // max(1, len(seqs))
        room = []
        for seq in seqs:
            left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1
            room.append(max(0, min(left, per_seq, self.speculator.max_tokens)))
        proposed = self.speculator.drafts(seqs, room)
        drafts = [draft for draft, _ in proposed]
        distributions = [distribution for _, distribution in proposed]
        bm = self.block_manager
        for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            if draft:
                fits = bm.reserve(seq, seq.last_position + len(draft))
                if fits < len(draft):
                    drafts[i] = draft[:fits]
                    if distributions[i] is not None:
                        distributions[i] = distributions[i].shortened(fits)
        return drafts, distributions

    def _verify_batch(self, step_id: int, seqs: list[Sequence], drafts: list[list[int]],
                      distributions: list[DraftDistribution | None]) -> ScheduledBatch:
        """A verify step: a decode row for each sequence's last token and one for each of
        its draft tokens, at the positions after it, each with logits. Every input is on
        the host (speculation waits for tokens in flight)."""
        bm = self.block_manager
        tokens, positions, tables = [], [], []
        for seq, draft in zip(seqs, drafts, strict=True):
            first = seq.last_position
            for j, token in enumerate([seq.last_token, *draft]):
                tokens.append(token)
                positions.append(first + j)
                tables.append(seq.block_table)
            self._mark_scheduled(seq, step_id, len(tokens) - 1 - len(draft), num_computed=first + 1)
            self._verifying.add(seq.request_id)
        inputs = HostStepInputs.decode(tokens, positions, tables, bm.block_size, table_width=self.block_table_width)
        return ScheduledBatch(BatchKind.VERIFY, step_id, seqs, inputs, None, None,
                              num_decode_rows=len(tokens), drafts=drafts,
                              draft_distributions=distributions if any(distributions) else None)

    def _ends_when_landed(self, seq: Sequence) -> bool:
        """The token in flight takes the sequence to max_tokens or max_model_len. Stop
        tokens and strings can only be seen a step late; lengths are known now."""
        if not seq.num_inflight_tokens:
            return False
        return (seq.num_output_tokens + seq.num_inflight_tokens >= seq.params.max_tokens
                or len(seq) + seq.num_inflight_tokens >= self.max_model_len)

    def _prefilling(self, seq: Sequence) -> bool:
        """Admitted, with prompt chunks left to schedule (its final chunk not yet scheduled)."""
        return seq.request_id in self._prefill_left

    def _decode_rows(self) -> list[Sequence]:
        """The running sequences past their prompt that take a token this step, each with
        a slot for it; when KV blocks run out, the latest admitted sequence is preempted."""
        bm = self.block_manager
        seqs: list[Sequence] = []
        row = 0
        while row < len(self.running):
            seq = self.running[row]
            if seq.num_inflight_tokens > 1:
                raise RuntimeError("schedule() ran more than one step ahead of postprocess()")
            if self._prefilling(seq) or self._ends_when_landed(seq):
                row += 1  # a prompt still in chunks, or its in-flight token is its last
                continue
            if bm.can_append(seq):
                bm.append_slot(seq)
                seqs.append(seq)
                row += 1
            else:
                # The victim is never an already scheduled row: those precede `row`.
                self._preempt(self.running[-1])
        return seqs

    def _prefill_chunks(self, budget: int) -> list[tuple[Sequence, int, int]]:
        """(sequence, first position, tokens) of the prompt chunks of this step, within
        `budget` tokens: the prompts being prefilled, then waiting ones admitted in order
        (each with blocks for its whole prompt, its cached prefix counted computed)."""
        if budget <= 0 or not (self.waiting or self._prefill_left):
            return []
        bm = self.block_manager
        prompts = [seq for seq in self.running if self._prefilling(seq)]
        # A request's forks join the running batch at its final chunk: their places are kept.
        places = len(self.running) + sum(len(seq.forks) for seq in prompts)
        while self.waiting and len(prompts) < min(budget, self.max_prefill_seqs):
            seq = self.waiting[0]
            if seq.num_inflight_tokens:
                break  # preempted while its last token was in flight: wait for it
            if places + 1 + len(seq.forks) > self.max_batch:
                break  # a request's sequences start together
            hits = bm.cached_prefix(seq)
            if not bm.can_admit(seq, hits):
                break
            # Its cached prefix is KV already written: its chunks start after it.
            seq.num_computed_tokens = bm.allocate(seq, hits=hits)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._prefill_left.add(seq.request_id)
            places += 1 + len(seq.forks)
            prompts.append(seq)
        shares = fair_shares([len(seq) - seq.num_computed_tokens for seq in prompts], budget)
        chunks = []
        for seq, n in zip(prompts, shares, strict=True):
            start = seq.num_computed_tokens
            if seq.forks and start + n == len(seq) and len(seq.forks) * bm.fork_blocks(len(seq)) > bm.num_free:
                n -= 1  # no blocks yet for its forks' copies: the final chunk waits for them
            if n > 0:
                chunks.append((seq, start, n))
        return chunks

    def _within_rows(self, chunks: list[tuple[Sequence, int, int]],
                     decode_rows: int) -> list[tuple[Sequence, int, int]]:
        """The chunks, those of prompts that want their logprobs (a logits row a token)
        shortened so that the step's logits rows fit the buffer's (max_batch of them)."""
        left = self.max_batch - decode_rows - len(chunks)  # rows beyond one a sequence
        fitted = []
        for seq, start, n in chunks:
            if seq.wants_prompt_logprobs and start + n <= seq.num_prompt_tokens:
                n = min(n, 1 + max(left, 0))
                left -= n - 1
            fitted.append((seq, start, n))
        return fitted

    def _decode_batch(self, step_id: int, seqs: list[Sequence]) -> ScheduledBatch:
        bm = self.block_manager
        input_ids, src_step, src_row, positions = [], [], [], []
        for row, seq in enumerate(seqs):
            token, step, src = self._decode_input(seq)
            input_ids.append(token)
            src_step.append(step)
            src_row.append(src)
            positions.append(seq.last_position)
            self._mark_scheduled(seq, step_id, row, num_computed=seq.last_position + 1)
        inputs = HostStepInputs.decode(
            input_ids, positions, [seq.block_table for seq in seqs], bm.block_size, table_width=self.block_table_width
        )
        return ScheduledBatch(
            BatchKind.DECODE, step_id, seqs, inputs,
            torch.tensor(src_step, dtype=torch.int64), torch.tensor(src_row, dtype=torch.int64),
            num_decode_rows=len(seqs),
        )

    def _mixed_batch(
        self, step_id: int, decodes: list[Sequence], chunks: list[tuple[Sequence, int, int]]
    ) -> ScheduledBatch:
        """A prefill step: the decode rows first (one token each, which may still be on the
        device), then the prompt chunks. A chunk that does not end its prompt samples
        nothing; a final one samples its sequence's first token, and its forks join there."""
        bm = self.block_manager
        tokens, starts, src_step, src_row = [], [], [], []
        for seq in decodes:
            token, step, src = self._decode_input(seq)
            tokens.append([token])
            starts.append(seq.last_position)
            src_step.append(step)
            src_row.append(src)
        on_device = any(step >= 0 for step in src_step)
        for seq, start, n in chunks:
            # A prompt's chunk is a slice of the prompt (`token_ids` would copy it whole first).
            prompt = seq.prompt_token_ids
            tokens.append(prompt[start:start + n] if start + n <= len(prompt) else seq.token_ids[start:start + n])
            starts.append(start)
        seqs = decodes + [seq for seq, _, _ in chunks]
        # A prompt that wants its logprobs has a logits row for every token of its chunk.
        prompt_rows = [(row, start) for row, (seq, start, n) in enumerate(chunks, start=len(decodes))
                       if seq.wants_prompt_logprobs and start + n <= seq.num_prompt_tokens]
        logit_rows = None
        if prompt_rows:
            logit_rows = [1] * len(seqs)
            for row, _ in prompt_rows:
                logit_rows[row] = len(tokens[row])
        inputs = HostStepInputs.prefill(tokens, [seq.block_table for seq in seqs], bm.block_size,
                                        start_positions=starts, table_width=self.block_table_width,
                                        logit_rows=logit_rows)
        partial: set[int] = set()
        forks: list[tuple[int, Sequence]] = []
        kv_copies: list[tuple[int, int]] = []
        for row, (seq, start, n) in enumerate(chunks, start=len(decodes)):
            if start + n < len(seq):
                partial.add(row)
                seq.num_computed_tokens = start + n
                bm.defer_cache_blocks(seq)
                continue
            self._prefill_left.discard(seq.request_id)
            for fork in seq.forks:
                copy = bm.fork(seq, fork)
                if copy is not None:
                    kv_copies.append(copy)
                del self._fork_parent[fork.request_id]
                fork.status = SequenceStatus.RUNNING
                self.running.append(fork)
                forks.append((row, fork))
            seq.forks = []
        # Each sampled sequence's in-flight token is at its index among the step's sampled rows.
        sampled = [row for row in range(len(seqs)) if row not in partial] if partial else range(len(seqs))
        for index, (row, fork) in enumerate(forks, start=len(sampled)):
            self._mark_scheduled(fork, step_id, index, num_computed=len(seqs[row]))
        for index, row in enumerate(sampled):
            # A row's KV reaches its last token's position (the step's seq_lens).
            self._mark_scheduled(seqs[row], step_id, index, num_computed=starts[row] + len(tokens[row]))
        src_steps = src_rows = None
        if on_device:
            pad = [-1] * (inputs.num_tokens - len(decodes))
            src_steps = torch.tensor(src_step + pad, dtype=torch.int64)
            src_rows = torch.tensor(src_row + pad, dtype=torch.int64)
        return ScheduledBatch(
            BatchKind.PREFILL, step_id, seqs, inputs, src_steps, src_rows,
            forks=forks, kv_copies=kv_copies, partial_rows=frozenset(partial), num_decode_rows=len(decodes),
            logit_rows=logit_rows, prompt_rows=prompt_rows,
        )

    @staticmethod
    def _decode_input(seq: Sequence) -> tuple[int, int, int]:
        """(token id, source step, source row) of a decode row's input: a token still on
        the device is -1 here, gathered from the step that sampled it."""
        if seq.num_inflight_tokens:
            step, src = seq.inflight_source
            return -1, step, src
        return seq.last_token, -1, -1

    def _mark_scheduled(self, seq: Sequence, step_id: int, row: int, num_computed: int) -> None:
        seq.num_computed_tokens = num_computed
        seq.num_inflight_tokens += 1
        seq.inflight_source = (step_id, row)
        self.block_manager.defer_cache_blocks(seq)  # keyed after the step's send

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self._prefill_left.discard(seq.request_id)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        log.info(
            "request preempted by recompute",
            request_id=seq.request_id,
            tokens=len(seq),
            free_blocks=self.block_manager.num_free,
        )

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if self._prefilling(seq):
                self._prefill_left.discard(seq.request_id)
                # Its forks no longer have a prefill to share: each is prefilled on its own.
                for fork in reversed(seq.forks):
                    del self._fork_parent[fork.request_id]
                    self.waiting.appendleft(fork)
                seq.forks = []
        elif seq.request_id in self._fork_parent:  # a fork still waiting for its prefill
            self._fork_parent.pop(seq.request_id).forks.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            index = self.waiting.index(seq)
            self.waiting.remove(seq)
            # Its forks no longer have a prefill to share: each is prefilled on its own.
            for fork in reversed(seq.forks):
                del self._fork_parent[fork.request_id]
                self.waiting.insert(index, fork)
            seq.forks = []
        self.block_manager.free(seq)
        seq.finish(reason, stop_reason)
        del self.requests[seq.request_id]
        if self.speculator is not None:
            self.speculator.release(seq.request_id)

    def _take_step_id(self) -> int:
        step_id = self._next_step_id
        self._next_step_id += 1
        return step_id
