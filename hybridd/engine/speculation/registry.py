"""The drafters a daemon can be configured with, by the name the `speculative_drafter`
setting gives (`none` is no speculation). A new drafter adds its name here."""

from __future__ import annotations

from hybridd.engine.speculation.drafter import Drafter
from hybridd.engine.speculation.ngram import NgramDrafter

DRAFTERS = ("none", "ngram", "draft_model")


def make_drafter(name: str, ngram_min: int = 1, ngram_max: int = 4, draft_model: str = "",
                 max_positions: int | None = None, draft_kv_tokens: int = 1 << 16) -> Drafter | None:
    """The drafter named `name`, or None for `none`; `draft_model` (a directory),
    `max_positions` and `draft_kv_tokens` are the draft model's (`draft_model`)."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(ngram_min, ngram_max)
    if name == "draft_model":
        from hybridd.engine.speculation.draft_model import load_draft_model_drafter

        return load_draft_model_drafter(draft_model, max_positions, draft_kv_tokens)
    raise ValueError(f"speculative_drafter: unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
