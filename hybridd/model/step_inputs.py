"""The per-step inputs of a forward pass: the one description of a step.

The scheduler builds it on the host (`prefill`, `decode`); the step buffers copy it
into their fixed-address device tensors, and hand the forward a bucket-shaped view
of those (another `StepInputs`). Everything that varies from step to step lives in
those device tensors, so a CUDA Graph captured over them stays valid when their
contents change.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from hybridd.model.kv_cache import slot


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
        table_width: int | None = None,
    ) -> StepInputs:
        """A prefill step of whole prompts (or of their tails from `start_positions`).

        Built in Python arrays and turned into tensors without a copy: a step of a few
        short prompts, the first token's, then costs a handful of tensor constructions
        instead of a dozen small tensor operations per prompt."""
        starts = start_positions or [0] * len(prompts)
        ids, positions, slots, seq_lens = array("q"), array("q"), array("q"), []
        for prompt, table, start in zip(prompts, block_tables, starts, strict=True):
            end = start + len(prompt)
            ids.extend(prompt)
            positions.extend(range(start, end))
            # One run of consecutive slots per block the tokens fall in: the whole block,
            # but for where the first starts and the last ends.
            first, stop = start // block_size, -(-end // block_size)
            lows = [int(block) * block_size for block in table[first:stop]]
            if lows:
                highs = [low + block_size for low in lows]
                highs[-1] -= stop * block_size - end
                lows[0] += start - first * block_size
                slots.extend(chain.from_iterable(map(range, lows, highs)))
            seq_lens.append(end)
        query_start_loc = list(accumulate((len(p) for p in prompts), initial=0))
        return cls(
            input_ids=_int64(ids),
            positions=_int64(positions),
            slot_mapping=_int64(slots),
            block_tables=_pad_tables(block_tables, table_width),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            logits_indices=torch.tensor([q - 1 for q in query_start_loc[1:]], dtype=torch.int64),
            is_prefill=True,
        ).to(device)

    @classmethod
    def decode(
        cls,
        tokens: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        table_width: int | None = None,
    ) -> StepInputs:
        """A decode step: one new token per sequence, at `positions` (a token of -1 is
        one the device still has to fill in, in the overlapped pipeline)."""
        n = len(tokens)
        slots = [slot(t, p, block_size) for t, p in zip(block_tables, positions, strict=True)]
        return cls(
            input_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=_pad_tables(block_tables, table_width),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            logits_indices=torch.arange(n, dtype=torch.int64),
            is_prefill=False,
        ).to(device)

    def to(self, device: torch.device | str) -> StepInputs:
        if torch.device(device) == self.input_ids.device:
            return self
        return StepInputs(
            **{name: getattr(self, name).to(device) for name in _TENSORS}, is_prefill=self.is_prefill
        )


_TENSORS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")


def _int64(values: array) -> torch.Tensor:
    """An int64 tensor over an array of int64 ("q") values, sharing its memory."""
    return torch.frombuffer(values, dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)


def _pad_tables(tables: list[list[int]], width: int | None) -> torch.Tensor:
    """Block tables as one [n, width] tensor, padded with block 0 (default width: the longest)."""
    width = width or max((len(t) for t in tables), default=1) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
