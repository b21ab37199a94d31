"""Nearest-rank percentiles, as the SQL views compute them."""

import math

from feedback.core.stats import percentile


def test_percentile_is_nearest_rank():
    assert percentile([40, 10, 30, 20], 0.5) == 20
    assert percentile([40, 10, 30, 20], 0.9) == 40
    assert percentile([5], 0.99) == 5
    assert percentile(list(range(1, 101)), 0.99) == 99 and percentile(list(range(1, 11)), 0.99) == 10


def test_no_values():
    assert math.isnan(percentile([], 0.5)) and percentile([], 0.99, empty=0.0) == 0.0
