"""The residual stream between two projections of the decoder: the sum each layer adds its
attention and MLP outputs to, carried with the last projection's output not yet added
(the next norm adds it, as the torch reference does) or already added by that projection,
which then also leaves the per-row sums of squares the next norm needs."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ResidualStream(NamedTuple):
    """The stream's value is `base` + `update` (rounded to the activation dtype), or `base`
    alone when `update` is None. `sum_squares` [T, parts] float32: the parts of each row's
    sum of squares of that value, where the projection that formed it computed them."""

    base: torch.Tensor
    update: torch.Tensor | None = None
    sum_squares: torch.Tensor | None = None
