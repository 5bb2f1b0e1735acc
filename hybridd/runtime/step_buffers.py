"""The static step buffers: fixed-address input and output tensors that every graph reads
and writes, sized for the largest bucket.

A step is staged by writing its rows and padding the rest of the bucket (slot -1,
so padded rows write nothing to the KV cache); graphs then see the new contents at
the same addresses. In the two-process runtime these tensors live in a shared arena.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridd.model.step_inputs import StepInputs


def buffer_layout(
    max_tokens: int, max_seqs: int, max_blocks_per_seq: int, vocab_size: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every static buffer; the one definition of their geometry."""
    return {
        "input_ids": ((max_tokens,), torch.int64),
        "positions": ((max_tokens,), torch.int64),
        "slot_mapping": ((max_tokens,), torch.int64),
        "block_tables": ((max_seqs, max_blocks_per_seq), torch.int32),
        "seq_lens": ((max_seqs,), torch.int32),
        "query_start_loc": ((max_seqs + 1,), torch.int32),
        "logits_indices": ((max_seqs,), torch.int64),
        "logits": ((max_seqs, vocab_size), torch.float32),
    }


@dataclass
class HostStep:
    """A step as the scheduler describes it, on the host, before padding."""

    is_prefill: bool
    input_ids: list[int] | None  # None: the tokens are already in the device buffer
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]  # [n_seqs + 1]
    logits_indices: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class StepBuffers:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        for name, tensor in tensors.items():
            setattr(self, name, tensor)
        self.max_tokens = self.input_ids.shape[0]
        self.max_seqs = self.seq_lens.shape[0]
        self.max_blocks_per_seq = self.block_tables.shape[1]

    @classmethod
    def allocate(
        cls, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device | str
    ) -> StepBuffers:
        layout = buffer_layout(max_tokens, max_seqs, max_blocks_per_seq, vocab_size)
        return cls({n: torch.zeros(shape, dtype=dt, device=device) for n, (shape, dt) in layout.items()})

    def view(self, is_prefill: bool, num_tokens: int, num_seqs: int) -> StepInputs:
        """The bucket-shaped window of the buffers that a graph of this shape reads."""
        return StepInputs(
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            logits_indices=self.logits_indices[:num_seqs],
            is_prefill=is_prefill,
        )

    def stage(self, step: HostStep, num_tokens: int, num_seqs: int) -> None:
        """Write a step padded to (num_tokens, num_seqs) rows, with one copy per buffer.

        Padded token rows get slot -1 (no KV write) and position 0; padded sequences get
        length 1 over block 0 (a harmless read) and no tokens of their own.
        """
        t, s = step.num_tokens, step.num_seqs
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            raise ValueError(
                f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the step buffers "
                f"({self.max_tokens} tokens / {self.max_seqs} seqs): the scheduler's limits must not exceed them"
            )
        if t > num_tokens or s > num_seqs:
            raise ValueError(f"step of {t} tokens / {s} seqs does not fit bucket {num_tokens}/{num_seqs}")
        if any(len(row) > self.max_blocks_per_seq for row in step.block_tables):
            raise ValueError(f"a block table exceeds {self.max_blocks_per_seq} blocks")
        pad_t, pad_s = num_tokens - t, num_seqs - s
        device = self.input_ids.device
        if step.input_ids is not None:
            self._copy(self.input_ids, step.input_ids + [0] * pad_t, device)
        self._copy(self.positions, step.positions + [0] * pad_t, device)
        self._copy(self.slot_mapping, step.slot_mapping + [-1] * pad_t, device)
        self._copy(self.seq_lens, step.seq_lens + [1] * pad_s, device)
        last = step.query_start_loc[-1] if step.query_start_loc else 0
        self._copy(self.query_start_loc, step.query_start_loc + [last] * pad_s, device)
        self._copy(self.logits_indices, step.logits_indices + [0] * pad_s, device)
        width = self.max_blocks_per_seq
        table = torch.zeros((num_seqs, width), dtype=torch.int32)
        for i, row in enumerate(step.block_tables):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        self.block_tables[:num_seqs].copy_(table, non_blocking=True)

    @staticmethod
    def _copy(dest: torch.Tensor, values: list[int], device: torch.device) -> None:
        src = torch.tensor(values, dtype=dest.dtype)
        if device.type == "cuda":
            src = src.pin_memory()
        dest[: len(values)].copy_(src, non_blocking=True)
