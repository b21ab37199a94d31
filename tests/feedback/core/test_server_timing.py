"""Reading Server-Timing back and adding its stages up (feedback/core/server_timing.py), as
`flywheel bench serve` and the simulated editors do."""

import pytest

from feedback.core.server_timing import breakdown, parse_header


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


def test_the_header_parser_keeps_durations_and_skips_the_rest():
    assert parse_header("hop;dur=1.5, cache;desc=miss, total;dur=3, bad;dur=x") == {"hop": 1.5, "total": 3.0}
