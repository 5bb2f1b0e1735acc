"""The drafters a daemon can be configured with, by the name the `speculative_drafter`
setting gives (`none` is no speculation). A new drafter adds its name here."""

from __future__ import annotations

from hybridd.engine.speculation.drafter import Drafter
from hybridd.engine.speculation.ngram import NgramDrafter

DRAFTERS = ("none", "ngram")


def make_drafter(name: str, ngram_min: int = 1, ngram_max: int = 4) -> Drafter | None:
    """The drafter named `name`, or None for `none`."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(ngram_min, ngram_max)
    raise ValueError(f"speculative_drafter: unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
