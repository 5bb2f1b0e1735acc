"""scripts/bench_capture.py's budget for the forced-capture phase: after the captures at
ready, the budget must let Y in once X is evicted, and never hold X and Y together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
try:
    from bench_capture import MiB, replanned_budget_mb
finally:
    sys.path.pop(0)

DECODE, SMALL, X, NEED_Y = 8 * MiB, 73_400_320, 90_177_536, 128_425_984  # as measured on an H200 (Llama-2-7B)


def test_y_that_cannot_fit_beside_the_small_graphs_raises_the_budget():
    """The 16-token graph was charged 70 MiB, so 134 MiB could not take Y even with X gone."""
    status = {"graph_bytes": DECODE + SMALL + X}
    budget = replanned_budget_mb(status, {"captured": True, "bytes": X}, NEED_Y, 134)
    assert budget == -(-(DECODE + SMALL + NEED_Y) // MiB)
    assert DECODE + SMALL + NEED_Y <= budget * MiB  # Y fits once X is evicted
    assert DECODE + SMALL + X + NEED_Y > budget * MiB  # but not beside X: the eviction is forced


def test_neither_captured_counts_only_what_is_held():
    status = {"graph_bytes": DECODE + SMALL}
    assert replanned_budget_mb(status, {"captured": False, "bytes": 0}, NEED_Y, 134) == -(-(DECODE + SMALL + NEED_Y) // MiB)


@pytest.mark.parametrize("x_bucket", [{"captured": True, "bytes": X}, {"captured": False, "bytes": 0}])
def test_a_budget_that_already_fits_y_is_kept(x_bucket):
    status = {"graph_bytes": DECODE + SMALL + x_bucket["bytes"]}
    assert replanned_budget_mb(status, x_bucket, NEED_Y, 400) is None
