"""Where a request's time goes: the Server-Timing header and the stage histogram
(serving/http/timing.py), and the pool's queue limit answering 503 with Retry-After."""

import pytest
from prometheus_client import REGISTRY
from ray.serve.exceptions import BackPressureError

from feedback.core.server_timing import STAGES, parse_header
from tests.serving.conftest import FakeEngine, make_client


def _stage_count(route: str, stage: str) -> float:
    return REGISTRY.get_sample_value("flywheel_http_stage_seconds_count", {"route": route, "stage": stage}) or 0.0


def test_a_completion_says_where_its_time_went(tok):
    client, _, _ = make_client(tok, engine=FakeEngine(tok, first_token_s=0.004))
    before = _stage_count("/v1/completions", "engine")
    r = client.post("/v1/completions", json={"prompt": "def f():\n    ", "suffix": "\n", "max_tokens": 8})
    assert r.status_code == 200, r.text
    t = parse_header(r.headers["server-timing"])
    assert set(t) == {*STAGES, "total"}
    assert all(v >= 0 for v in t.values())
    assert t["ttft"] == pytest.approx(4.0, abs=0.01)  # the engine's own figure, passed through
    # The stages but ttft (which lies within engine) add up to no more than the total.
    assert sum(v for k, v in t.items() if k not in ("ttft", "total")) <= t["total"] + 0.05
    assert _stage_count("/v1/completions", "engine") == before + 1


def test_every_route_reports_its_total_and_errors_too(tok):
    client, _, _ = make_client(tok)
    r = client.get("/v1/health")
    assert r.status_code == 200 and set(parse_header(r.headers["server-timing"])) == {"total"}
    bad = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and "total" in parse_header(bad.headers["server-timing"])


class FullPool:
    """A pool whose queue is full: Ray Serve's handle raises BackPressureError."""

    async def complete(self, req):
        raise BackPressureError(num_queued_requests=65, max_queued_requests=64)

    async def served_version(self) -> int:
        return 3


def test_a_full_queue_is_503_with_retry_after_at_once(tok):
    from feedback.pools import STABLE

    client, sink, _ = make_client(tok)
    client.app.state.api.replicas[STABLE] = FullPool()
    before = (
        REGISTRY.get_sample_value(
            "flywheel_completion_errors_total", {"version": "3", "pool": STABLE, "reason": "busy"}
        )
        or 0.0
    )
    r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert "replicas are at capacity" in r.json()["error"]["message"] and sink.sent == []
    after = REGISTRY.get_sample_value(
        "flywheel_completion_errors_total", {"version": "3", "pool": STABLE, "reason": "busy"}
    )
    assert after == before + 1


def test_a_full_queue_in_front_of_a_pool_that_never_reported_says_it_may_be_starting(tok):
    from feedback.pools import STABLE

    client, _, _ = make_client(tok)
    client.app.state.api.replicas[STABLE] = FullPool()
    client.app.state.api.routing.serving[STABLE] = None  # no version reported yet
    r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert "not ready yet (starting" in r.json()["error"]["message"]
