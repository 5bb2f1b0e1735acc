"""The forced-capture phase's budget (`python -m hybridd.bench.capture --replan`, the
figures at ready as JSON on stdin): after the captures at ready, the budget must let Y
in once X is evicted, and never hold X and Y together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def replanned_budget_mb(status: dict, x_bucket: dict, need_y: int, budget_mb: int) -> int | None:
    """The budget the tool prints for these figures at ready (None: the budget in force stands)."""
    at_ready = {"status": status, "x_bucket": x_bucket, "need_y_bytes": need_y, "budget_mb": budget_mb}
    done = subprocess.run([sys.executable, "-m", "hybridd.bench.capture", "--replan"], input=json.dumps(at_ready),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


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
def test_a_budget_that_is_already_the_least_is_kept(x_bucket):
    status = {"graph_bytes": DECODE + SMALL + x_bucket["bytes"]}
    least = -(-(DECODE + SMALL + NEED_Y) // MiB)
    assert replanned_budget_mb(status, x_bucket, NEED_Y, least) is None


def test_a_looser_budget_is_tightened_so_that_x_and_y_never_fit_together():
    """Graphs that cost less than the plan's estimates: at ready the decode graphs were
    charged 2 MiB, the 16-token graph nothing and X 62 MiB; Y will cost 68 MiB against
    its 122 MiB estimate. Under the 134 MiB planned from the estimates both would fit
    once Y's real cost is known, so the phase would force one capture only; under the
    least budget that admits Y they do not."""
    decode, x_real, y_real = 2 * MiB, 65_011_712, 71_303_168
    status = {"graph_bytes": decode + x_real}
    assert decode + x_real + y_real <= 134 * MiB  # the loose budget: both would fit
    budget = replanned_budget_mb(status, {"captured": True, "bytes": x_real}, NEED_Y, 134)
    assert budget == -(-(decode + NEED_Y) // MiB)
    assert decode + NEED_Y <= budget * MiB  # Y fits by its estimate once X is evicted
    assert decode + x_real + y_real > budget * MiB  # and X never fits beside the real Y


def test_figures_that_are_not_the_phases_are_refused_by_name():
    done = subprocess.run([sys.executable, "-m", "hybridd.bench.capture", "--replan"], input='{"status": {}}',
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "a JSON object with status, x_bucket, need_y_bytes and budget_mb" in done.stderr, done.stderr
