"""Summary statistics of latency samples, as the daemon's status and the benchmarks report them."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def percentile(values: Collection[float], q: float) -> float | None:
    """Nearest-rank percentile `q` (0..100) of `values`; None when there are none."""
    return percentiles(values, q)[0]


def percentiles(values: Collection[float], *qs: float) -> list[float | None]:
    """Nearest-rank percentiles `qs` (0..100) of `values` from one sort (the status reply
    is built on the serving loop, and every sort of a 2,048-sample window is time the loop
    does not serve); None for each when there are none. A `q` outside 0..100 is refused."""
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"a percentile must be within 0..100, got {q}")
    if not values:
        return [None] * len(qs)
    ordered = sorted(values)
    last = len(ordered) - 1
    return [ordered[min(last, int(round(q / 100 * last)))] for q in qs]


def slowest(values: Sequence[float], n: int) -> list[int]:
    """The positions of the `n` largest of `values`, in order of position."""
    return sorted(sorted(range(len(values)), key=values.__getitem__)[-n:]) if n > 0 else []
