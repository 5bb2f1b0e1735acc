"""The drafters a daemon can be configured with, by the name the `speculative_drafter`
setting gives (`none` is no speculation). A new drafter adds its name here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridd.engine.speculation.drafter import Drafter
from hybridd.engine.speculation.graph_drafter import GraphDrafter
from hybridd.engine.speculation.ngram import NgramDrafter
from hybridd.protocol import control

DRAFTERS = ("none", "ngram", "draft_model", "eagle3")


def make_drafter(name: str, ngram_min: int = 1, ngram_max: int = 4,
                 exchange: Callable[[control.Draft], control.Drafted] | None = None,
                 notify: Callable[[control.Draft], None] | None = None,
                 probabilities: torch.Tensor | None = None, eagle3_head: str = "", model: str = "",
                 max_positions: int | None = None, head_kv_tokens: int = 1 << 16) -> Drafter | None:
    """The drafter named `name`, or None for `none`. `draft_model` runs in the graph
    generator (`draft_runner`): `exchange` asks it for drafts, `notify` tells it what
    needs no answer, and `probabilities` is the shared region it writes the draft
    distributions into. `eagle3` runs here: `eagle3_head` (a directory) is the head for
    the model in directory `model`, its positions up to `max_positions`, its KV cache of
    `head_kv_tokens` tokens."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(ngram_min, ngram_max)
    if name == "draft_model":
        if exchange is None or notify is None or probabilities is None:
            raise ValueError("speculative_drafter draft_model: the graph generator serves no draft model")
        return GraphDrafter(exchange, notify, probabilities)
    if name == "eagle3":
        from hybridd.engine.speculation.eagle3 import load_eagle3_drafter

        return load_eagle3_drafter(eagle3_head, model, max_positions, head_kv_tokens)
    raise ValueError(f"speculative_drafter: unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
