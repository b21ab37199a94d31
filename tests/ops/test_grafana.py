"""ops/grafana/flywheel.json: it parses, it is a Grafana dashboard, and each of its queries
references only metrics Flywheel exports (the processes' registries, and Ray's exports of the
replicas' and vLLM's metrics: serving.metrics.exported_names)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).parents[2] / "ops" / "grafana" / "flywheel.json"
# Label lists of these clauses hold label names, not metrics.
_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (followed by
    '('), keywords, label names (in matchers and grouping clauses), strings or range durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(_GROUPING, "", expr)
    return {
        m.group()
        for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
        if m.group() not in _KEYWORDS and not expr[m.end() :].lstrip().startswith("(")
    }


def test_metric_names_of_an_expression():
    expr = (
        'histogram_quantile(0.99, sum by (le, pool) (rate(a_seconds_bucket{pool="canary", x=~"y|z"}[$__rate_interval])))'
        " / on (pool) group_left sum without (replica) (b_total offset 5m) > bool 0.5e3 and c"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def test_it_is_a_grafana_dashboard(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    (var,) = dashboard["templating"]["list"]
    assert (var["type"], var["name"], var["query"]) == ("datasource", "datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["targets"], p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


# Every module that declares metrics: importing one registers its metrics.
METRIC_MODULES = ("serving.metrics", "serving.hotswap", "feedback.producer", "feedback.sink.loop")


def test_every_query_reads_metrics_flywheel_exports(dashboard):
    import importlib

    import serving.metrics

    for module in METRIC_MODULES:
        importlib.import_module(module)
    exported = serving.metrics.exported_names()
    unknown = {(title, n) for title, expr in _queries(dashboard) for n in metric_names(expr) if n not in exported}
    assert unknown == set()
    # and it shows what operators asked for
    used = {n for _, expr in _queries(dashboard) for n in metric_names(expr)}
    assert {
        "flywheel_completion_seconds_bucket",
        "flywheel_completion_first_token_seconds_bucket",
        "flywheel_completion_errors_total",
        "ray_vllm_time_to_first_token_seconds_bucket",
        "ray_vllm_num_requests_waiting",
        "ray_flywheel_swap_pause_seconds_bucket",
        "ray_flywheel_swaps_total",
        "ray_flywheel_swap_restarts_total",
    } <= used


def test_a_metric_that_is_not_exported_is_caught(dashboard):
    import serving.metrics

    assert "flywheel_completion_latency_seconds_bucket" not in serving.metrics.exported_names()
    assert "ray_vllm_time_to_first_token_seconds_bucket" in serving.metrics.exported_names()
