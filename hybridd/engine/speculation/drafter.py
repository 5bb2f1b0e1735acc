"""What a drafter is: the one interface the engine asks for draft tokens.

A drafter looks at sequences whose every token is on the host and proposes, for
each, up to the number of tokens it is asked for: the continuation it guesses the
target will produce. It never changes a sequence. `Draft.probabilities` is how likely
the drafter found each token (a draft model's distribution at each position); a
drafter that proposes tokens deterministically (prompt lookup), or whose sampled tokens
are to be kept only where the target drew them (an EAGLE-3 head), leaves it None, which
verification treats as a point mass on the proposed token. Either way verification
keeps the target's distribution exactly (`verification`), so a drafter can be wrong
as often as it likes and costs only speed.

How a verify step keeps draft tokens (`verification`): a sampled row scores a draft
token with a distribution by the rejection rule (kept with probability min(1, p/q), else
a token from norm(max(p - q, 0))); a token without one (a point mass), and any greedy
row, by the target's own draw there (kept iff the target drew it, which is that rule for
a point mass, and keeps the output the target's own, token for token). A drafter that
samples its tokens returns each one's distribution in `probabilities`, the one it drew
it from; the rule needs the tokens to be draws from it, whatever noise drew them.

A drafter with state per sequence (an index of its tokens, a draft model's KV cache)
keys it by `Sequence.request_id` and lets go of it in `release`; the scheduler calls
`release` when a sequence finishes. Preemption keeps a sequence's tokens, so state
derived from the tokens alone stays valid across it; what a verify step kept, the
drafter reads from the sequence's tokens at its next `propose` (a draft model rewinds
its own KV to them).

A drafter that reads the target's hidden states (EAGLE-3) is a `HiddenStateDrafter`: the
runner of every step hands it, per sequence, the residual stream of the layers it names
for the step's rows (`observe`), and the forks of a prompt the record of their parent
(`fork`). What the rows' tokens were is part of what it is handed, so a record of rows
a verify step then rejected is told apart from the sequence's tokens at the next
`propose`, as a draft model's cache is.

Drafters are named by the `speculative_drafter` setting and made by `make_drafter`
(`hybridd.engine.speculation.registry`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from hybridd.engine.sampler import SamplingTensorCache, SamplingTensors
from hybridd.engine.sequence import Sequence


@dataclass(frozen=True)
class Draft:
    """Proposed tokens for one sequence, in order (empty: no proposal), and, for a
    drafter that samples them, each one's draft distribution [len(tokens), V]."""

    tokens: list[int]
    probabilities: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = Draft([])


def draft_sampling_tensors(cache: SamplingTensorCache, seqs: Seq[Sequence], positions: Seq[int],
                           drafted: Seq[list[int]] | None, vocab_size: int) -> SamplingTensors:
    """Sampling tensors for each sequence's next draft token, at `positions[i]`: the
    request's own parameters, seed and penalties, so that a drafter that samples draws each
    token as the target draws the token at that position. `drafted`, each sequence's draft
    tokens so far, counted as its output, where a row has penalties (None: no row has).
    Built on the host and copied to the cache's device without a wait, or the cache's set
    where every row is greedy without penalties (`SamplingTensorCache`)."""
    def build() -> SamplingTensors:
        outputs = None if drafted is None else [seq.output_token_ids + d for seq, d in zip(seqs, drafted, strict=True)]
        return SamplingTensors.build([seq.params for seq in seqs], [seq.seed for seq in seqs], positions, vocab_size,
                                     "cpu", [seq.prompt_token_ids for seq in seqs], outputs)

    return cache.get([seq.params for seq in seqs], len(seqs), build)


class Drafter(Protocol):
    """Proposes draft tokens for sequences (see the module docstring)."""

    name: str

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[Draft]:
        """One draft per sequence, at most `max_tokens[i]` tokens for `seqs[i]` (0: none
        wanted). Every token of each sequence is on the host (`Sequence.token_ids`)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget what the drafter keeps for a sequence that has finished."""
        ...


@runtime_checkable
class HiddenStateDrafter(Drafter, Protocol):
    """A drafter fed the target's hidden states (see the module docstring)."""

    aux_layers: tuple[int, ...]
    max_pending: int  # the most states it keeps per sequence: only a sequence's last this-many rows matter

    def observe(self, request_id: str, start: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """The target's hidden states [len(tokens), len(aux_layers) x hidden] at positions
        `start`, `start + 1`, ... of a sequence, whose tokens there were `tokens`."""
        ...

    def fork(self, parent: str, child: str) -> None:
        """`child` shares `parent`'s tokens so far (a fork of its prompt)."""
        ...
