"""`flywheel bench serve`'s sides (ops/bench/serving.py): the stage breakdown travels with each."""

from ops.bench.serving import Side


def test_a_side_carries_its_breakdown_and_leaves_it_out_when_requests_failed():
    timings = [{"engine": 5.0, "total": 8.0}, {"engine": 7.0, "total": 9.0}]
    side = Side.measured("Flywheel", 2, 0.5, 10, [10.0, 20.0], 0, timings)
    assert side.rps == 4.0 and side.p50_ms == 15.0
    assert side.stages["engine"]["mean_ms"] == 6.0 and side.stages["proxy"]["mean_ms"] == 6.5
    # one of three requests failed: its stages are unknown, so no breakdown rather than a wrong one
    assert Side.measured("Flywheel", 3, 0.5, 10, [10.0, 20.0, 30.0], 1, timings).stages == {}
