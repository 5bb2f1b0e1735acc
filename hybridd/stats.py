"""Summary statistics of latency samples, as the daemon's status and the benchmarks report them."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def percentile(values: Collection[float], q: float) -> float | None:
    """Nearest-rank percentile `q` (0..100) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def slowest(values: Sequence[float], n: int) -> list[int]:
    """The positions of the `n` largest of `values`, in order of position."""
    return sorted(sorted(range(len(values)), key=values.__getitem__)[-n:]) if n > 0 else []
