"""Percentiles as the SQL views compute them (nearest rank), so a number printed by a client, a
benchmark or the rollout evidence means the same thing."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float, *, empty: float = float("nan")) -> float:
    """The nearest-rank `q` quantile (`q` in [0, 1]): the smallest value with at least a share `q`
    of the values at or below it. `empty` for no values."""
    if not xs:
        return empty
    ordered = sorted(xs)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]
