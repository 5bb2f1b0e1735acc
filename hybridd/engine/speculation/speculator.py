"""The speculator: a drafter, the policy that says when and how far to draft, and the
counters, as the scheduler uses them. It turns the sequences of a step into drafts
(`drafts`: within each sequence's room and, for structured output, its grammar) and a
verify step's rows into each sequence's kept tokens (`verified`)."""

from __future__ import annotations

from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.drafter import Draft, Drafter
from hybridd.engine.speculation.policy import SpeculationPolicy
from hybridd.engine.speculation.stats import SpeculationStats
from hybridd.engine.speculation.verification import DraftDistribution, accepted_tokens


class Speculator:
    def __init__(self, drafter: Drafter, max_tokens: int, policy: SpeculationPolicy | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {max_tokens}")
        self.drafter = drafter
        self.max_tokens = max_tokens
        self.policy = policy if policy is not None else SpeculationPolicy(max_tokens)
        self.stats = SpeculationStats(max_tokens)

    def drafts(self, seqs: list[Sequence], room: list[int]) -> list[tuple[list[int], DraftDistribution | None]]:
        """Each sequence's draft tokens, at most `room[i]` for `seqs[i]` and as many as its
        measured acceptance makes worth scoring (none for a sequence whose request turned
        speculation off), and, for a drafter with distributions, the tokens its rows score
        by the rejection rule (`verification`)."""
        wanted = [min(r, self.policy.draft_length(seq.request_id)) if seq.speculative else 0
                  for seq, r in zip(seqs, room, strict=True)]
        return [_within_grammar(seq, draft, n)
                for seq, draft, n in zip(seqs, self.drafter.propose(seqs, wanted), wanted, strict=True)]

    def verified(self, seq: Sequence, draft: list[int], target: list[int]) -> list[int]:
        """The tokens `seq` keeps from its verify rows' tokens `target`; counts them."""
        kept = accepted_tokens(draft, target)
        if draft:
            self.stats.count(len(draft), len(kept) - 1)
            self.policy.observe_draft(seq.request_id, len(draft), len(kept) - 1)
        return kept

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
        self.policy.release(request_id)


def _within_grammar(seq: Sequence, draft: Draft, wanted: int) -> tuple[list[int], DraftDistribution | None]:
    """The first `wanted` tokens of `draft`, cut before the first one the sequence's grammar
    refuses. A draft with distributions keeps that refused token for its distribution: the
    row before it scores it (and rejects it), so the cut depends on no drawn token."""
    tokens = draft.tokens[:wanted]
    valid = len(tokens) if seq.grammar is None else seq.grammar.validate_tokens(tokens)
    if draft.probabilities is None:
        return tokens[:valid], None
    return tokens[:valid], DraftDistribution(tokens[:valid + 1], draft.probabilities[:valid + 1])
