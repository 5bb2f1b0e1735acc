"""The logprobs of a prompt's tokens, from the logits rows of its prefill chunks.

A request with `prompt_logprobs` has its prompt chunks' every token listed as a logits
row (`ScheduledBatch.logit_rows`): the row at position p gives the logprob of the prompt
token at p + 1, under the raw log-softmax of the model's logits (no sampling parameter
applies to a prompt), with its rank and the most likely alternatives. The runner
computes them beside the step's sampling (`compute`, while the step's logits are in the
buffer the next step overwrites) and brings them to the host; the core records them in
the sequence, position by position (a recomputed chunk adds nothing twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridd.engine.scheduler import ScheduledBatch
from hybridd.engine.sequence import Sequence


@dataclass
class PromptLogprobRows:
    """One chunk's prompt logprobs, on the host: tokens `first_position` onwards."""

    seq: Sequence
    first_position: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_values: list[list[float]]
    top_ids: list[list[int]]


def compute(logits: torch.Tensor, batch: ScheduledBatch) -> list[PromptLogprobRows]:
    """The prompt logprobs of `batch`'s chunks that asked for them, from its logits rows
    (`logits`: the step's rows in order). Copies to the host: the caller's step waits for them."""
    out = []
    for row, start in batch.prompt_rows:
        seq = batch.seqs[row]
        rows = batch.logit_rows[row]
        targets = seq.prompt_token_ids[start + 1: start + rows + 1]
        if not targets:
            continue
        first = batch.last_logit_row(row) - rows + 1
        logprobs = logits[first: first + len(targets)].float().log_softmax(dim=-1)
        ids = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
        chosen = logprobs.gather(1, ids[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        top_values, top_ids = logprobs.topk(seq.params.prompt_logprobs, dim=-1)
        out.append(PromptLogprobRows(seq, start + 1, targets, chosen.tolist(), ranks.tolist(), top_values.tolist(),
                                     top_ids.tolist()))
    return out
