"""The per-step inputs of a forward pass, all device tensors.

Everything that varies from step to step lives here, in device memory, so a CUDA
Graph captured over these tensors stays valid when their contents change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """One forward step over `T` flattened tokens belonging to `B` sequences.

    - `input_ids`, `positions`, `slot_mapping`: [T]; a slot of -1 writes nothing.
    - `block_tables`: [B, W] KV block ids per sequence (padding entries are ignored).
    - `seq_lens`: [B] context length of each sequence including this step's tokens.
    - `query_start_loc`: [B + 1] start of each sequence's tokens in the flat step
      (prefill only; decode has one token per sequence).
    - `logits_indices`: [B] the flat index of each sequence's last token.
    - `is_prefill`: a Python bool, fixed per captured graph.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def prefill(
        cls,
        prompts: list[list[int]],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        start_positions: list[int] | None = None,
    ) -> StepInputs:
        """Host-side construction of a prefill step (tests, eager callers)."""
        starts = start_positions or [0] * len(prompts)
        ids, pos, slots, qsl = [], [], [], [0]
        for prompt, table, start in zip(prompts, block_tables, starts, strict=True):
            for i, tok in enumerate(prompt):
                p = start + i
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + len(prompt))
        seq_lens = [s + len(p) for s, p in zip(starts, prompts, strict=True)]
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=_pad_tables(block_tables, device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            logits_indices=torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=device),
            is_prefill=True,
        )

    @classmethod
    def decode(
        cls,
        tokens: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> StepInputs:
        """Host-side construction of a decode step: one new token per sequence."""
        slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(block_tables, positions, strict=True)]
        n = len(tokens)
        return cls(
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=_pad_tables(block_tables, device),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            logits_indices=torch.arange(n, dtype=torch.int64, device=device),
            is_prefill=False,
        )


def _pad_tables(tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(t) for t in tables), default=1) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
