"""The per-step inputs of a forward pass: the one description of a step.

The scheduler builds it on the host as numpy arrays (`HostStepInputs.prefill`,
`decode`); the step buffers copy those into their fixed-address device tensors, and
hand the forward a bucket-shaped view of those (a `StepInputs`); a forward in the same
process takes `HostStepInputs.on(device)`. Everything that varies from step to step lives in
those device tensors, so a CUDA Graph captured over them stays valid when their
contents change.
"""

from __future__ import annotations

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
    - `logits_indices`: [R] the flat index of each token whose logits the step computes:
      each sequence's last token, and in a prefill step any earlier ones the scheduler
      lists (a sequence's rows are its last `logit_rows[i]` tokens, in order; R >= B).
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

    @property
    def num_logit_rows(self) -> int:
        return self.logits_indices.shape[0]


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
        logit_rows: list[int] | None = None,
    ) -> StepInputs:
        """A prefill step of whole prompts (or of their tails from `start_positions`)."""
        return HostStepInputs.prefill(prompts, block_tables, block_size, start_positions, table_width,
                                      logit_rows).on(device)

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
        logit_rows: list[int] | None = None,
    ) -> HostStepInputs:
        """A prefill step of whole prompts (or of their tails from `start_positions`);
        the logits of each sequence's last `logit_rows[i]` tokens (default: its last).
        A first token waits for this work, so it is a few numpy calls over all the tokens
        at once (docs/lab/experiments.md, "bench_step_inputs", timed it), not a loop over them."""
        n = len(prompts)
        starts = start_positions or [0] * n
        lengths = [len(prompt) for prompt in prompts]
        ends = [start + length for start, length in zip(starts, lengths, strict=True)]
        for row, (table, end) in enumerate(zip(block_tables, ends, strict=True)):
            if len(table) * block_size < end:
                raise ValueError(f"block_tables[{row}] holds {len(table)} blocks of {block_size} tokens, too few for "
                                 f"its tokens up to position {end - 1}")
        tables = _pad_tables(block_tables, table_width)
        starts_in_step = list(accumulate(lengths, initial=0))
        if n == 1:
            # The usual prefill: one prompt, whose slots need no per-token gather (the
            # general form below is slower than a Python loop for a 10-token prompt).
            input_ids = np.array(prompts[0], dtype=np.int64)
            positions = np.arange(starts[0], ends[0], dtype=np.int64)
            # Every slot of the sequence's blocks in order; its tokens' are a run of them.
            slots = (tables[0, : -(-ends[0] // block_size), None].astype(np.int64) * block_size
                     + np.arange(block_size)).ravel()[starts[0]:ends[0]]
        else:
            input_ids = np.fromiter(chain.from_iterable(prompts), np.int64, starts_in_step[-1])
            rows = np.repeat(np.arange(n), lengths)
            offsets = np.array([s - i for s, i in zip(starts, starts_in_step)], dtype=np.int64)  # position - flat index
            positions = np.arange(input_ids.shape[0], dtype=np.int64) + offsets[rows]
            slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return cls(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=np.array(ends, dtype=np.int32),
            query_start_loc=np.array(starts_in_step, dtype=np.int32),
            logits_indices=_logits_indices(starts_in_step, logit_rows),
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


def _logits_indices(starts_in_step: list[int], logit_rows: list[int] | None) -> np.ndarray:
    """The flat indices of each sequence's last `logit_rows[i]` tokens (one each by default)."""
    ends = np.array(starts_in_step[1:], dtype=np.int64)
    if logit_rows is None or all(k == 1 for k in logit_rows):
        return ends - 1
    counts = np.array(logit_rows, dtype=np.int64)
    if (counts < 1).any() or (counts > ends - np.array(starts_in_step[:-1])).any():
        raise ValueError(f"logit_rows {logit_rows}: each sequence has 1 to its token count of rows")
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # 0.. within each seq
    return np.repeat(ends - counts, counts) + offsets


def _pad_tables(tables: list[list[int]], width: int | None) -> np.ndarray:
    """Block tables as one [n, width] array, padded with block 0 (default width: the longest)."""
    width = width or max((len(t) for t in tables), default=1) or 1
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out
