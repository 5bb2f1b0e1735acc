"""Continuous batching: which sequences run in the next step, and the step's inputs.

Each step is either a prefill of whole prompts (first come, first served, within a
token budget, admitted only when their KV blocks fit above the block manager's
watermark) or a decode of every running sequence. Prefill wins when there is
waiting work and room, as in vLLM V0 and nano-vllm. When decode runs out of KV
blocks, the most recently admitted sequence is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue, keeping its output
so that its next prefill covers prompt + output so far. A sequence is admitted with
the blocks of its prefix that the block manager's prefix cache holds (a recomputed
one usually finds its own), and its prefill row starts after them.

A request for n sequences is queued as one sequence carrying n − 1 forks: its prefill
runs once, and the forks join the running batch right there, each sampling its own
first token from the prompt's logits and sharing the prompt's KV blocks (the step
lists the partly filled blocks to copy). After that they are ordinary sequences.

The scheduler may run one step ahead of `postprocess` (the overlapped pipeline):
a decode row whose input token is still on the device carries the (step, row) that
sampled it in `input_src_step` / `input_src_row` instead of a host token id.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from hybridd.engine.block_manager import BlockManager
from hybridd.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from hybridd.engine.sequence import Sequence, SequenceStatus
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


@dataclass
class ScheduledBatch:
    """One step: its sequences (row i is `seqs[i]`), its inputs, and where the input
    tokens that are still on the device come from."""

    kind: BatchKind
    step_id: int
    seqs: list[Sequence]
    inputs: HostStepInputs  # unpadded; input_ids are -1 where the token is still on the device
    # Decode only (None for a prefill, whose tokens are all the prompt's, on the host):
    input_src_step: torch.Tensor | None  # [T] int64; step that sampled the input token, -1 when on host
    input_src_row: torch.Tensor | None  # [T] int64; its row in that step's sampled tokens
    # Forks sampled from a row's logits in this step: (row, forked sequence), and the KV
    # blocks to copy (source, destination) before the next step reads them.
    forks: list[tuple[int, Sequence]] = field(default_factory=list)
    kv_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return self.kind is BatchKind.PREFILL

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return self.inputs.num_tokens

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """The sequences that get a token from this step: the rows, then the forks."""
        return self.seqs + [seq for _, seq in self.forks]

    @property
    def sample_rows(self) -> list[int]:
        """For each sampled sequence, the row of the step's logits it samples from."""
        return list(range(len(self.seqs))) + [row for row, _ in self.forks]

    @property
    def inputs_on_device(self) -> bool:
        """True when some input tokens must be gathered from earlier steps' device output
        (a prefill's never are: its tokens are the prompt's, and output the host has)."""
        return self.kind is BatchKind.DECODE and bool((self.input_src_step >= 0).any())


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
    ) -> None:
        self.block_manager = block_manager
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        # Prefill steps with more rows than the graph runner's prefill graphs hold run eagerly.
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
        self._next_step_id = 0
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; raise AdmissionError when it can never run."""
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already scheduled")
        if len(seq) >= self.max_model_len:
            raise AdmissionError(
                f"{len(seq)} tokens; max_model_len is {self.max_model_len} and at least one token must be generated",
                "prompt",
            )
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
        (a preempted sequence waits for its in-flight token) or no work is left."""
        if self.waiting and len(self.running) < self.max_batch:
            batch = self._schedule_prefill()
            if batch is not None:
                return batch
        if self.running:
            return self._schedule_decode()
        return None

    def postprocess(self, batch: ScheduledBatch, next_token_ids: list[int]) -> list[Sequence]:
        """Append each row's sampled token; return the sequences that finished."""
        finished = []
        for seq, token_id in zip(batch.sampled_seqs, next_token_ids, strict=True):
            seq.num_inflight_tokens -= 1
            seq.new_text = ""
            if seq.is_finished:
                continue  # sampled one step past its end, or aborted meanwhile
            seq.append_token(token_id)
            new_text = seq.detokenizer.add(seq.output_token_ids) if seq.detokenizer is not None else ""
            result = seq.stop_criteria.check(token_id, new_text, seq.num_output_tokens, len(seq))
            seq.new_text = result.text
            seq.output_text += result.text
            if result.finish_reason is not None:
                self._finish(seq, result.finish_reason, result.stop_reason)
                finished.append(seq)
        return finished

    def _ends_when_landed(self, seq: Sequence) -> bool:
        """The token in flight takes the sequence to max_tokens or max_model_len. Stop
        tokens and strings can only be seen a step late; lengths are known now."""
        if not seq.num_inflight_tokens:
            return False
        return (seq.num_output_tokens + seq.num_inflight_tokens >= seq.params.max_tokens
                or len(seq) + seq.num_inflight_tokens >= self.max_model_len)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        bm = self.block_manager
        seqs: list[Sequence] = []
        num_tokens = 0
        forks: list[tuple[int, Sequence]] = []
        kv_copies: list[tuple[int, int]] = []
        while self.waiting and len(self.running) < self.max_batch and len(seqs) < self.max_prefill_seqs:
            seq = self.waiting[0]
            if seq.num_inflight_tokens:
                break  # preempted while its last token was in flight: wait for it
            # A lone sequence longer than the budget still runs, alone, or it would starve.
            new_tokens = len(seq) - len(bm.cached_prefix(seq)) * bm.block_size
            if seqs and num_tokens + new_tokens > self.max_prefill_tokens:
                break
            if len(self.running) + 1 + len(seq.forks) > self.max_batch:
                break  # a request's sequences start together
            if not bm.can_admit(seq):
                break
            # Its cached prefix is KV already written: its row starts after it.
            seq.num_computed_tokens = bm.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            for fork in seq.forks:
                copy = bm.fork(seq, fork)
                if copy is not None:
                    kv_copies.append(copy)
                del self._fork_parent[fork.request_id]
                fork.status = SequenceStatus.RUNNING
                self.running.append(fork)
                forks.append((len(seqs), fork))
            seq.forks = []
            seqs.append(seq)
            num_tokens += len(seq) - seq.num_computed_tokens
        if not seqs:
            return None

        starts = [seq.num_computed_tokens for seq in seqs]
        inputs = HostStepInputs.prefill(
            [seq.token_ids[start:] for seq, start in zip(seqs, starts)], [seq.block_table for seq in seqs],
            bm.block_size, start_positions=starts, table_width=self.block_table_width,
        )
        step_id = self._take_step_id()
        for sample_row, (row, fork) in enumerate(forks, start=len(seqs)):
            self._mark_scheduled(fork, step_id, sample_row, num_computed=len(seqs[row]))
        for row, seq in enumerate(seqs):
            self._mark_scheduled(seq, step_id, row, num_computed=len(seq))
        # No tensors of source steps: a prefill's first token waits for this work.
        return ScheduledBatch(BatchKind.PREFILL, step_id, seqs, inputs, None, None, forks=forks, kv_copies=kv_copies)

    def _schedule_decode(self) -> ScheduledBatch | None:
        bm = self.block_manager
        seqs: list[Sequence] = []
        row = 0
        while row < len(self.running):
            seq = self.running[row]
            if seq.num_inflight_tokens > 1:
                raise RuntimeError("schedule() ran more than one step ahead of postprocess()")
            if self._ends_when_landed(seq):
                row += 1  # its in-flight token is its last: a step now would be thrown away
                continue
            if bm.can_append(seq):
                bm.append_slot(seq)
                seqs.append(seq)
                row += 1
            else:
                # The victim is never an already scheduled row: those precede `row`.
                self._preempt(self.running[-1])
        if not seqs:
            return None

        step_id = self._take_step_id()
        input_ids, src_step, src_row, positions = [], [], [], []
        for row, seq in enumerate(seqs):
            if seq.num_inflight_tokens:
                step, src = seq.inflight_source
                input_ids.append(-1)
                src_step.append(step)
                src_row.append(src)
            else:
                input_ids.append(seq.last_token)
                src_step.append(-1)
                src_row.append(-1)
            positions.append(seq.last_position)
            self._mark_scheduled(seq, step_id, row, num_computed=seq.last_position + 1)
        inputs = HostStepInputs.decode(
            input_ids, positions, [seq.block_table for seq in seqs], bm.block_size, table_width=self.block_table_width
        )
        return ScheduledBatch(
            BatchKind.DECODE, step_id, seqs, inputs,
            torch.tensor(src_step, dtype=torch.int64), torch.tensor(src_row, dtype=torch.int64),
        )

    def _mark_scheduled(self, seq: Sequence, step_id: int, row: int, num_computed: int) -> None:
        seq.num_computed_tokens = num_computed
        seq.num_inflight_tokens += 1
        seq.inflight_source = (step_id, row)
        self.block_manager.cache_blocks(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
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

    def _take_step_id(self) -> int:
        step_id = self._next_step_id
        self._next_step_id += 1
        return step_id
