"""Keeping Python's cyclic garbage collector out of the serving loops' way.

A worker starts up with hundreds of thousands of long-lived objects (torch, the model,
the tokenizer): a full collection of them is a pause far longer than a decode step, and
every token in flight would wait for it (docs/lab/design_choices.md, "The cyclic garbage
collector"). Once a worker has started, `freeze_start_up()` moves them out
of the collector's reach for good (they stay alive either way), so a collection scans
only what serving made. A graph capture runs with the collector off
(`no_collection()`), and afterwards leaves the collector and the freeze as they were.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_start_up() -> int:
    """Freeze every object alive now; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No automatic cyclic collection in any thread while the block runs; afterwards the
    collector is as it was, and a start-up freeze is kept.

    Nothing here may walk the collector's lists: it would hold the GIL the whole time,
    and every serving thread of the process would wait. `gc.get_freeze_count()` is such
    a walk over every frozen object, and a capture in the background that counted a
    worker's frozen start-up objects stalled its decode streams for several steps
    (docs/lab/design_choices.md, "The cyclic garbage collector")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
