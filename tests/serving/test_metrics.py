"""Serving's Prometheus metrics: per version and pool, bounded, and the replicas' metrics outside Ray."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from feedback.pools import STABLE
from serving import metrics
from tests.serving.conftest import FakeEngine, make_client


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_completion_latency_and_first_token_by_version_and_pool(tok):
    client, _, _ = make_client(tok, engine=FakeEngine(tok, first_token_s=0.25))
    at = {"version": "3", "pool": STABLE}
    before = {
        n: _value(n, **at)
        for n in (
            "flywheel_completion_seconds_count",
            "flywheel_completion_first_token_seconds_count",
            "flywheel_completion_first_token_seconds_sum",
        )
    }
    assert client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4}).status_code == 200
    with client.stream("POST", "/v1/completions", json={"prompt": "y = ", "stream": True}) as r:
        assert r.status_code == 200 and "data: [DONE]" in list(r.iter_lines())
    assert _value("flywheel_completion_seconds_count", **at) == before["flywheel_completion_seconds_count"] + 2
    assert (
        _value("flywheel_completion_first_token_seconds_count", **at)
        == before["flywheel_completion_first_token_seconds_count"] + 2
    )
    # the engine's 0.25 s plus the replica's prompt building, which is not negative
    added = (
        _value("flywheel_completion_first_token_seconds_sum", **at)
        - before["flywheel_completion_first_token_seconds_sum"]
    )
    assert added >= 2 * 0.25


def test_no_first_token_when_the_engine_reports_none(tok):
    client, _, _ = make_client(tok)  # FakeEngine's first_token_s is None, as vLLM's with its stats off
    at = {"version": "3", "pool": STABLE}
    before = _value("flywheel_completion_first_token_seconds_count", **at)
    assert client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4}).status_code == 200
    assert _value("flywheel_completion_first_token_seconds_count", **at) == before


def test_failed_requests_count_as_errors_of_the_pools_version(tok):
    client, sink, _ = make_client(tok, engine=FakeEngine(tok, fail=True))
    labels = lambda reason: {"version": "3", "pool": STABLE, "reason": reason}  # noqa: E731
    before = {r: _value("flywheel_completion_errors_total", **labels(r)) for r in metrics.ERROR_REASONS}
    r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4})
    assert r.status_code == 503
    with client.stream("POST", "/v1/completions", json={"prompt": "y = ", "stream": True}) as s:
        assert any('"error"' in ln for ln in s.iter_lines())
    assert _value("flywheel_completion_errors_total", **labels("replica_failed")) == before["replica_failed"] + 1
    assert _value("flywheel_completion_errors_total", **labels("stream_failed")) == before["stream_failed"] + 1
    assert sink.sent == []


def test_only_the_most_recent_versions_keep_series():
    registry = CollectorRegistry()
    counter = Counter("probe_total", "a per-version counter", ["version", "pool"], registry=registry)
    labels = metrics._RecentVersions(keep=2).labels
    for v in ("1", "2"):
        labels(counter, v, "stable").inc()
    labels(counter, "1", "canary").inc()  # v1 observed last: v2 is now the oldest
    labels(counter, "3", "stable").inc()
    kept = {
        (s.labels["version"], s.labels["pool"])
        for m in registry.collect()
        for s in m.samples
        if s.name == "probe_total"
    }
    assert kept == {("1", "stable"), ("1", "canary"), ("3", "stable")}


def test_replica_metric_outside_ray_is_in_this_process_registry():
    import ray

    assert not ray.is_initialized()
    m = metrics.ReplicaMetric("histogram", "flywheel_test_probe_seconds", "a probe", ("pool",), buckets=(0.1, 1.0))
    m.observe(0.5, pool="canary")
    assert REGISTRY.get_sample_value("flywheel_test_probe_seconds_count", {"pool": "canary"}) == 1
    assert m.exported_names() == [
        "ray_flywheel_test_probe_seconds_bucket",
        "ray_flywheel_test_probe_seconds_sum",
        "ray_flywheel_test_probe_seconds_count",
    ]
    metrics.REPLICA_METRICS.remove(m)


@pytest.mark.parametrize("name", sorted(metrics.VLLM_METRICS))
def test_vllm_defines_the_metrics_we_list(name):
    """The installed vLLM declares each listed metric (read from its source: importing vLLM is slow)."""
    from importlib.util import find_spec
    from pathlib import Path

    source = (Path(find_spec("vllm").submodule_search_locations[0]) / "v1" / "metrics" / "loggers.py").read_text()
    assert f'"{name}"' in source
