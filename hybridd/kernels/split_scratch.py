"""Scratch memory for kernels whose splits meet in global memory: the skinny GEMM's
split-K partials and tile counters, decode attention's split-merge tickets.

Launches on one stream run in order, so one set per stream suffices. Graphs are all
replayed in order on the serving stream, so they share one set of their own, made
outside capture. An eager launch on another stream (a capture's warm-up, a reference
run beside the graphs) therefore never races a replay for the same counters. Counters
are zeroed once; every kernel that takes a ticket gives it back (resets it to zero).

A buffer a graph has captured must outlive that graph, so a set that has to grow keeps
its old buffers alive instead of freeing them.
"""

from __future__ import annotations

import torch

_sets: dict[tuple, torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def scratch(device: torch.device, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A zeroed buffer `name` of at least `numel` elements for launches on the current
    stream, or, while a graph is being captured, the buffer every graph shares. None while
    capturing when the graphs' buffer was not made large enough beforehand (it cannot be
    made inside one capture and kept for the others): the caller then does without."""
    capturing = _capturing(device)
    stream = None if capturing or device.type != "cuda" else torch.cuda.current_stream(device).cuda_stream
    key = (device, stream, name, dtype)
    have = _sets.get(key)
    if have is not None and have.numel() >= numel:
        return have
    if capturing:
        return None
    # An eager launch also prepares the graphs' set, so a later capture finds it.
    for k in {key, (device, None, name, dtype)}:
        old = _sets.get(k)
        if old is None or old.numel() < numel:
            if old is not None:
                _retired.append(old)
            _sets[k] = torch.zeros(numel, dtype=dtype, device=device)
    return _sets[key]
