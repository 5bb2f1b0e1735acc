"""The per-step inputs of a forward pass: the one description of a step.

The scheduler builds it on the host as numpy arrays (`HostStepInputs.prefill`,
`decode`); the step buffers copy those into their fixed-address device tensors, and
hand the forward a bucket-shaped view of those (a `StepInputs`); a forward in the same
process takes `HostStepInputs.on(device)`. Everything that varies from step to step lives in
those device tensors, so a CUDA Graph captured over them stays valid when their
contents change.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Generic, TypeVar
from itertools import accumulate, chain

import numpy as np
import torch

from hybridd.model.kv_cache import slot


Array = TypeVar("Array")


@dataclass
class StepFields(Generic[Array]):
    """One forward step over `T` flattened tokens belonging to `B` sequences.

    - `input_ids`, `positions`, `slot_mapping`: [T]; a slot of -1 writes nothing.
    - `block_tables`: [B, W] KV block ids per sequence (padding entries are ignored).
    - `seq_lens`: [B] context length of each sequence including this step's tokens.
    - `query_start_loc`: [B + 1] start of each sequence's tokens in the flat step
      (prefill only; decode has one token per sequence).
    - `logits_indices`: [B] the flat index of each sequence's last token.
    - `is_prefill`: a Python bool, fixed per captured graph.
    """

    input_ids: Array
    positions: Array
    slot_mapping: Array
    block_tables: Array
    seq_lens: Array
    query_start_loc: Array
    logits_indices: Array
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class StepInputs(StepFields[torch.Tensor]):
    """A step as the forward reads it: tensors, on its device."""

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
        """A prefill step of whole prompts (or of their tails from `start_positions`)."""
        return HostStepInputs.prefill(prompts, block_tables, block_size, start_positions, table_width).on(device)

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
        return HostStepInputs.decode(tokens, positions, block_tables, block_size, table_width).on(device)

    def to(self, device: torch.device | str) -> StepInputs:
        if torch.device(device) == self.input_ids.device:
            return self
        return StepInputs(
            **{name: getattr(self, name).to(device) for name in _TENSORS}, is_prefill=self.is_prefill
        )


@dataclass
class HostStepInputs(StepFields[np.ndarray]):
    """A step as the scheduler builds it: numpy arrays on the host (int64 ids,
    positions, slots and logits indices; int32 block tables, lengths and starts). The
    context generator's step buffers copy these arrays into their pinned mirror as they
    are; `on(device)` makes the `StepInputs` a forward in this process reads. A step's
    first token waits for this work, and numpy arrays cost a fraction of torch tensors
    to make and to copy from."""

    @classmethod
    def prefill(
        cls,
        prompts: list[list[int]],
        block_tables: list[list[int]],
        block_size: int,
        start_positions: list[int] | None = None,
        table_width: int | None = None,
    ) -> HostStepInputs:
        """A prefill step of whole prompts (or of their tails from `start_positions`),
        built in Python arrays that numpy then wraps without a copy."""
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
        query_start_loc = np.fromiter(accumulate((len(p) for p in prompts), initial=0), np.int32, len(prompts) + 1)
        return cls(
            input_ids=_int64(ids),
            positions=_int64(positions),
            slot_mapping=_int64(slots),
            block_tables=_pad_tables(block_tables, table_width),
            seq_lens=np.array(seq_lens, dtype=np.int32),
            query_start_loc=query_start_loc,
            logits_indices=query_start_loc[1:].astype(np.int64) - 1,
            is_prefill=True,
        )

    @classmethod
    def decode(
        cls,
        tokens: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        table_width: int | None = None,
    ) -> HostStepInputs:
        """A decode step: one new token per sequence, at `positions` (a token of -1 is
        one the device still has to fill in, in the overlapped pipeline)."""
        n = len(tokens)
        positions_array = np.array(positions, dtype=np.int64)
        return cls(
            input_ids=np.array(tokens, dtype=np.int64),
            positions=positions_array,
            slot_mapping=np.array([slot(t, p, block_size) for t, p in zip(block_tables, positions, strict=True)],
                                  dtype=np.int64),
            block_tables=_pad_tables(block_tables, table_width),
            seq_lens=(positions_array + 1).astype(np.int32),
            query_start_loc=np.arange(n + 1, dtype=np.int32),
            logits_indices=np.arange(n, dtype=np.int64),
            is_prefill=False,
        )

    def on(self, device: torch.device | str = "cpu") -> StepInputs:
        """The same step as tensors on `device` (on the CPU they share these arrays' memory)."""
        return StepInputs(
            **{name: torch.from_numpy(getattr(self, name)) for name in _TENSORS}, is_prefill=self.is_prefill
        ).to(device)


_TENSORS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")


def _int64(values: array) -> np.ndarray:
    """An int64 array over an array of int64 ("q") values, sharing its memory."""
    return np.frombuffer(values, dtype=np.int64) if values else np.empty(0, dtype=np.int64)


def _pad_tables(tables: list[list[int]], width: int | None) -> np.ndarray:
    """Block tables as one [n, width] array, padded with block 0 (default width: the longest)."""
    width = width or max((len(t) for t in tables), default=1) or 1
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out
