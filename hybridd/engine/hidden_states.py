"""Handing a step's target hidden states to the drafter that reads them
(`HiddenStateDrafter`, EAGLE-3): the rows of each sequence of the step, with the tokens
they were computed over and the position of the first. In this process (`feed`, the
in-process engine) the states themselves are handed over; in the daemon the head runs in
the graph generator, beside the states, and the context generator names each step's
rows (`step_rows`, sent with the `Step`), which the graph generator hands to the head
from its own `aux_hidden` (`DraftRunner.observe`).

A verify step's rows are a sequence's last token and its draft tokens; any other step's
are the ones `query_start_loc` delimits (one per decode row, a chunk per prompt). Of a
sequence's rows only its last `keep` matter to a drafter that keeps that many states
(`wanted_rows`): a prompt chunk's others need not travel. A decode row whose input token
was still on the device when the step was built is -1 in the host inputs: by the time
its step is collected the sequence has that token, so it is read from the sequence. A
sequence that finished before its rows are handed over (a step scheduled one ahead of
its end) is skipped: the drafter has let go of it.
"""

from __future__ import annotations

import torch

from hybridd.engine.scheduler import ScheduledBatch
from hybridd.engine.speculation.drafter import HiddenStateDrafter
from hybridd.protocol import control


def _segments(batch: ScheduledBatch) -> list[tuple[int, int]]:
    """(first row, rows) of each sequence of the step, in order."""
    inputs = batch.inputs
    if batch.drafts is not None:
        counts = [len(draft) + 1 for draft in batch.drafts]
    else:
        counts = (inputs.query_start_loc[1:] - inputs.query_start_loc[:-1]).tolist()
    firsts = [0]
    for count in counts[:-1]:
        firsts.append(firsts[-1] + count)
    return list(zip(firsts, counts))


def wanted_rows(batch: ScheduledBatch, keep: int) -> list[int] | None:
    """The step's rows, each sequence's last `keep`, in order; None when that is all of them."""
    segments = _segments(batch)
    if all(count <= keep for _, count in segments):
        return None
    return [row for first, count in segments for row in range(first + max(0, count - keep), first + count)]


def feed(drafter: HiddenStateDrafter, batch: ScheduledBatch, hidden: torch.Tensor, keep: int | None = None) -> None:
    """`hidden`: the step's rows of the target's states in the drafter's layers, all of
    them, or (with `keep`) those `wanted_rows(batch, keep)` lists."""
    inputs = batch.inputs
    at = 0  # the row of `hidden` of the next row handed over
    for seq, (first, count) in zip(batch.seqs, _segments(batch), strict=True):
        skip = 0 if keep is None else max(0, count - keep)
        rows, start = slice(first + skip, first + count), int(inputs.positions[first]) + skip
        count -= skip
        states = hidden[at:at + count] if keep is not None else hidden[rows]
        at += count
        if seq.is_finished:
            continue
        tokens = inputs.input_ids[rows].tolist()
        if -1 in tokens:
            known = seq.token_ids
            if start + count > len(known):
                continue
            tokens = [known[start + j] if token == -1 else token for j, token in enumerate(tokens)]
        drafter.observe(seq.request_id, start, tokens, states)
    for row, fork in batch.forks:
        drafter.fork(batch.seqs[row].request_id, fork.request_id)


def step_rows(batch: ScheduledBatch, keep: int) -> tuple[list[control.HiddenRows], list[control.Fork]]:
    """The rows of the step's hidden states a head keeping `keep` states per sequence reads
    (each sequence's last `keep`), as `control.Step` names them, and the step's forks. A
    decode row's token still on the device is -1: the graph generator learns it with the
    sequence's tokens."""
    inputs = batch.inputs
    rows = []
    for seq, (first, count) in zip(batch.seqs, _segments(batch), strict=True):
        if seq.is_finished:
            continue
        skip = max(0, count - keep)
        rows.append(control.HiddenRows(request_id=seq.request_id, start=int(inputs.positions[first]) + skip,
                                       row=first + skip, tokens=inputs.input_ids[first + skip:first + count].tolist()))
    forks = [control.Fork(parent=batch.seqs[row].request_id, child=fork.request_id) for row, fork in batch.forks]
    return rows, forks

