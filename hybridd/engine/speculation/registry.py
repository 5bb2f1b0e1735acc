"""The drafters a daemon can be configured with, by the name the `speculative_drafter`
setting gives (`none` is no speculation). A new drafter adds its name here."""

from __future__ import annotations

from hybridd.engine.speculation.drafter import Drafter
from hybridd.engine.speculation.ngram import NgramDrafter

DRAFTERS = ("none", "ngram", "draft_model", "eagle3")


def make_drafter(name: str, ngram_min: int = 1, ngram_max: int = 4, draft_model: str = "",
                 max_positions: int | None = None, draft_kv_tokens: int = 1 << 16, eagle3_head: str = "",
                 model: str = "") -> Drafter | None:
    """The drafter named `name`, or None for `none`; `draft_model` (a directory),
    `max_positions` and `draft_kv_tokens` are the draft model's (`draft_model`), and
    `eagle3_head` (a directory), `max_positions` and `draft_kv_tokens` the EAGLE-3 head's
    for the model in directory `model`."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(ngram_min, ngram_max)
    if name == "draft_model":
        from hybridd.engine.speculation.draft_model import load_draft_model_drafter

        return load_draft_model_drafter(draft_model, max_positions, draft_kv_tokens)
    if name == "eagle3":
        from hybridd.engine.speculation.eagle3 import load_eagle3_drafter

        return load_eagle3_drafter(eagle3_head, model, max_positions, draft_kv_tokens)
    raise ValueError(f"speculative_drafter: unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
