"""Handing a step's target hidden states to the drafter that reads them
(`HiddenStateDrafter`, EAGLE-3): the rows of each sequence of the step, with the tokens
they were computed over and the position of the first.

A verify step's rows are a sequence's last token and its draft tokens; any other step's
are the ones `query_start_loc` delimits (one per decode row, a chunk per prompt). A
decode row whose input token was still on the device when the step was built is -1 in
the host inputs: by the time its step is collected the sequence has that token, so it
is read from the sequence. A sequence that finished before its rows are handed over (a
step scheduled one ahead of its end) is skipped: the drafter has let go of it.
"""

from __future__ import annotations

import torch

from hybridd.engine.scheduler import ScheduledBatch
from hybridd.engine.speculation.drafter import HiddenStateDrafter


def feed(drafter: HiddenStateDrafter, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
    """`hidden` [step tokens, ...]: the step's rows of the target's states in the drafter's layers."""
    inputs = batch.inputs
    if batch.drafts is not None:
        counts = [len(draft) + 1 for draft in batch.drafts]
    else:
        counts = (inputs.query_start_loc[1:] - inputs.query_start_loc[:-1]).tolist()
    first = 0
    for seq, count in zip(batch.seqs, counts, strict=True):
        rows = slice(first, first + count)
        start = int(inputs.positions[first])
        first += count
        if seq.is_finished:
            continue
        tokens = inputs.input_ids[rows].tolist()
        if -1 in tokens:
            known = seq.token_ids
            if start + count > len(known):
                continue
            tokens = [known[start + j] if token == -1 else token for j, token in enumerate(tokens)]
        drafter.observe(seq.request_id, start, tokens, hidden[rows])
    for row, fork in batch.forks:
        drafter.fork(batch.seqs[row].request_id, fork.request_id)
