"""Which kernel geometries have had every launch variant launched once, eagerly.

Graph buckets of other sizes pick other launch variants of one kernel (a projection's
config, an attention's split plan), each its own compiled kernel. The first eager call
for a geometry (the graph runner's warm-up) launches every variant its buckets can
pick, on empty inputs, so that a later capture finds them compiled and loaded instead
of compiling inside the capture (which would invalidate it). This set remembers the
geometries that call was made for, across the kernel modules.
"""

from __future__ import annotations

import contextlib

import torch

_launched: set[tuple] = set()


def first_eager_call(key: tuple, device: torch.device) -> bool:
    """True once per `key` (and never while a graph is being captured): the caller then
    launches every variant of its geometry."""
    if key in _launched or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return False
    _launched.add(key)
    return True


@contextlib.contextmanager
def forgotten():
    """Forget the geometries first called meanwhile: a dry run whose launches did not run
    (`hybridd.runtime.kernel_precompile`) leaves the next eager call to launch them."""
    before = set(_launched)
    try:
        yield
    finally:
        _launched.intersection_update(before)
