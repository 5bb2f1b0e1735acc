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
    input_ids: list[int] | torch.Tensor | None  # None: the tokens are already in the device buffer
    positions: list[int] | torch.Tensor
    slot_mapping: list[int] | torch.Tensor
    block_tables: list[list[int]] | torch.Tensor
    seq_lens: list[int] | torch.Tensor
    query_start_loc: list[int] | torch.Tensor  # [n_seqs + 1]
    logits_indices: list[int] | torch.Tensor

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
        """Write a step's rows and pad it to (num_tokens, num_seqs)."""
        t, s = step.num_tokens, step.num_seqs
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            raise ValueError(
                f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the step buffers "
                f"({self.max_tokens} tokens / {self.max_seqs} seqs): the scheduler's limits must not exceed them"
            )
        if t > num_tokens or s > num_seqs:
            raise ValueError(f"step of {t} tokens / {s} seqs does not fit bucket {num_tokens}/{num_seqs}")
        self.write(step)
        self.pad(t, s, num_tokens, num_seqs)

    def write(self, step: HostStep) -> None:
        """The step's real rows, one host-to-device copy per buffer."""
        if step.num_tokens > self.max_tokens or step.num_seqs > self.max_seqs:
            raise ValueError(
                f"step of {step.num_tokens} tokens / {step.num_seqs} seqs exceeds the step buffers "
                f"({self.max_tokens} tokens / {self.max_seqs} seqs)"
            )
        device = self.input_ids.device
        if step.input_ids is not None:
            self._copy(self.input_ids, step.input_ids, device)
        self._copy(self.positions, step.positions, device)
        self._copy(self.slot_mapping, step.slot_mapping, device)
        self._copy(self.seq_lens, step.seq_lens, device)
        self._copy(self.query_start_loc, step.query_start_loc, device)
        self._copy(self.logits_indices, step.logits_indices, device)
        table = torch.zeros((step.num_seqs, self.max_blocks_per_seq), dtype=torch.int32)
        if isinstance(step.block_tables, torch.Tensor):
            width = step.block_tables.shape[1] if step.block_tables.dim() == 2 else 0
            if width > self.max_blocks_per_seq:
                raise ValueError(f"block tables are {width} wide; the buffer holds {self.max_blocks_per_seq}")
            table[:, :width] = step.block_tables
        else:
            for i, row in enumerate(step.block_tables):
                if len(row) > self.max_blocks_per_seq:
                    raise ValueError(f"a block table exceeds {self.max_blocks_per_seq} blocks")
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        self._copy_tensor(self.block_tables, table, device)

    def pad(self, num_tokens: int, num_seqs: int, to_tokens: int, to_seqs: int) -> None:
        """Fill rows [num_tokens, to_tokens) and sequences [num_seqs, to_seqs) as padding:
        slot -1 (no KV write) at position 0; padded sequences have length 1 over block 0
        (a harmless read) and no tokens of their own."""
        if to_tokens > num_tokens:
            self.input_ids[num_tokens:to_tokens].zero_()
            self.positions[num_tokens:to_tokens].zero_()
            self.slot_mapping[num_tokens:to_tokens].fill_(-1)
        if to_seqs > num_seqs:
            self.seq_lens[num_seqs:to_seqs].fill_(1)
            self.query_start_loc[num_seqs + 1 : to_seqs + 1].fill_(num_tokens)
            self.logits_indices[num_seqs:to_seqs].zero_()
            self.block_tables[num_seqs:to_seqs].zero_()

    @classmethod
    def _copy(cls, dest: torch.Tensor, values: list[int] | torch.Tensor, device: torch.device) -> None:
        src = values.to(dest.dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dest.dtype)
        cls._copy_tensor(dest, src, device)

    @staticmethod
    def _copy_tensor(dest: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
        if device.type == "cuda":
            src = src.pin_memory()
        dest[: src.shape[0]].copy_(src, non_blocking=True)
