"""The drafters a daemon can be configured with, by the name the `speculative_drafter`
setting gives (`none` is no speculation). A new drafter adds its name here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridd.engine.speculation.drafter import Drafter
from hybridd.engine.speculation.eagle3 import MAX_PENDING_STATES
from hybridd.engine.speculation.graph_drafter import GraphDrafter
from hybridd.engine.speculation.ngram import NgramDrafter
from hybridd.protocol import control

DRAFTERS = ("none", "ngram", "draft_model", "eagle3")


def make_drafter(name: str, ngram_min: int = 1, ngram_max: int = 4,
                 exchange: Callable[[control.Draft], control.Drafted] | None = None,
                 notify: Callable[[control.Draft], None] | None = None,
                 probabilities: torch.Tensor | None = None) -> Drafter | None:
    """The drafter named `name`, or None for `none`. `draft_model` and `eagle3` run in the
    graph generator (`draft_runner`, `eagle3_runner`): `exchange` asks it for drafts,
    `notify` tells it what needs no answer, and `probabilities` is the shared region a
    draft model writes its draft distributions into."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(ngram_min, ngram_max)
    if name in ("draft_model", "eagle3"):
        if exchange is None or notify is None or (name == "draft_model" and probabilities is None):
            raise ValueError(f"speculative_drafter {name}: the graph generator serves no such drafter")
        if name == "draft_model":
            return GraphDrafter(exchange, notify, probabilities)
        return GraphDrafter(exchange, notify, None, name, hidden_states_kept=MAX_PENDING_STATES)
    raise ValueError(f"speculative_drafter: unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
