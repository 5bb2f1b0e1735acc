"""hybridd.stats: the summaries the daemon's status and the benchmarks report."""

from __future__ import annotations

import pytest

from hybridd.stats import percentile, percentiles, slowest


def test_slowest_gives_the_positions_of_the_largest_values_in_order():
    gaps = [3.0, 9.0, 1.0, 7.0, 9.5, 2.0]
    assert slowest(gaps, 3) == [1, 3, 4]
    assert slowest(gaps, 10) == [0, 1, 2, 3, 4, 5]
    assert slowest(gaps, 0) == [] and slowest([], 3) == []


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 50) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 99) == 5.0


def test_several_percentiles_from_one_sort_agree_with_each_alone():
    values = [7.0, 3.0, 9.0, 1.0, 4.0, 8.0, 2.0]
    assert percentiles(values, 0, 50, 90, 99, 100) == [percentile(values, q) for q in (0, 50, 90, 99, 100)]
    assert percentiles([], 50, 99) == [None, None]


def test_a_percentile_outside_0_to_100_is_refused_by_name():
    with pytest.raises(ValueError, match="within 0..100, got -1"):
        percentiles([1.0, 2.0], 50, -1)
    with pytest.raises(ValueError, match="got 101"):
        percentile([1.0], 101)
