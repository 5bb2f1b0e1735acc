"""What speculation did, for status and metrics (vLLM's spec_decode counters): the
drafts verified, the draft tokens proposed, those accepted, and accepted tokens per
draft position (position i counts drafts whose first i + 1 tokens were all kept)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    max_tokens: int = 0  # the most draft tokens per sequence
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.max_tokens

    def count(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified sequence gains per step: accepted drafts plus the target's own."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def to_dict(self) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
        }
