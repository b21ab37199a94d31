"""How per-request stage times add up (serving/http/timing.py: breakdown), for `flywheel bench serve` and the demo."""

import pytest

from serving.http.timing import breakdown


def test_stages_are_averaged_and_the_proxy_is_what_the_client_saw_beyond_the_ingress():
    timings = [{"hop": 2.0, "engine": 10.0, "total": 14.0}, {"hop": 4.0, "engine": 20.0, "total": 26.0}]
    out = breakdown(timings, [20.0, 30.0])
    assert list(out) == ["hop", "engine", "total", "proxy", "client"]  # the order requests go through
    assert out["hop"] == {"mean_ms": 3.0, "p50_ms": 3.0, "n": 2}
    assert out["proxy"]["mean_ms"] == pytest.approx(5.0)  # (20 - 14 + 30 - 26) / 2
    assert out["client"]["mean_ms"] == 25.0


def test_the_bare_side_has_no_proxy():
    out = breakdown([{"prompt": 1.0, "engine": 9.0}], [10.0])
    assert set(out) == {"prompt", "engine", "client"}
