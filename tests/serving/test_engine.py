"""serving/engine.py's pure parts: how CPU model workers share a replica's cores."""

from __future__ import annotations

import pytest

from serving.engine import cpu_binding


@pytest.mark.parametrize(
    ("cpus", "workers", "bind"),
    [
        ([0, 1], 2, "0|1"),
        ([0, 1, 2, 3], 2, "0,1|2,3"),
        ([4, 5, 6, 7, 8], 2, "4,5|6,7,8"),
        ([0, 1, 2], 1, "0,1,2"),
    ],
)
def test_each_cpu_worker_gets_its_own_contiguous_share_of_the_cores(cpus, workers, bind):
    assert cpu_binding(cpus, workers) == bind


def test_more_cpu_workers_than_cores_is_refused():
    with pytest.raises(ValueError, match="2 CPU model workers need at least as many cores"):
        cpu_binding([3], 2)
