"""The /ops/rollouts endpoints on the real API app: ops tokens only, the same answers as the CLI."""

import hashlib

import pytest
from fastapi.testclient import TestClient

from feedback import pools
from feedback.core.auth import Tokens
from tests.ops.rollout.traffic import CANDIDATE, GATE_FAILED, STABLE


@pytest.fixture
def api(sqlite_engine):
    """The API app with what the rollout routes read from its state: the tokens and the database."""
    from ops.rollout.routes import router
    from serving.http.app import build_app

    app = build_app(routers=[router()])
    app.state.tokens = Tokens(editor=frozenset({"ed"}), ops=frozenset({"ops"}))
    app.state.database_url = sqlite_engine.url.render_as_string(hide_password=False)
    pools.set_stable(sqlite_engine, STABLE)
    return TestClient(app), app


@pytest.mark.parametrize(
    "method, path",
    [
        ("get", "/ops/rollouts"),
        ("post", "/ops/rollouts"),
        ("post", "/ops/rollouts/1/pause"),
        ("post", "/ops/rollouts/1/abort"),
    ],
)
def test_http_needs_an_ops_token(api, method, path):
    client, _ = api
    body = {"json": {"version": CANDIDATE}} if method == "post" else {}
    assert getattr(client, method)(path, **body).status_code == 401
    assert getattr(client, method)(path, headers={"Authorization": "Bearer nope"}, **body).status_code == 401
    r = getattr(client, method)(path, headers={"Authorization": "Bearer ed"}, **body)
    assert r.status_code == 403 and "editor token" in r.json()["error"]["message"]


def test_http_rollout_lifecycle(api, sqlite_engine):
    client, _ = api
    ops = {"Authorization": "Bearer ops"}
    r = client.get("/ops/rollouts", headers=ops)
    assert r.status_code == 200 and r.json()["rollout"] is None and r.json()["pools"]["stable"] == STABLE

    r = client.post(
        "/ops/rollouts",
        headers=ops,
        json={"version": CANDIDATE, "weights": [10, 100], "min_samples": 50, "thresholds": {"accept_rate_drop": 0.05}},
    )
    assert r.status_code == 201, r.text
    ro = r.json()
    assert ro["state"] == "running" and ro["weights"] == [10, 100] and ro["thresholds"]["accept_rate_drop"] == 0.05
    assert ro["thresholds"]["promote_rule"] == "non_inferior"  # the default, kept with the rollout
    assert ro["reason"] == "started by " + "api:ops-token:" + hashlib.sha256(b"ops").hexdigest()[:8]
    assert client.post("/ops/rollouts", headers=ops, json={"version": GATE_FAILED}).status_code == 409
    assert client.post("/ops/rollouts", headers=ops, json={"version": 99}).status_code == 400
    assert (
        client.post("/ops/rollouts", headers=ops, json={"version": CANDIDATE, "weights": [50, 10]}).status_code == 422
    )
    r = client.post("/ops/rollouts", headers=ops, json={"version": CANDIDATE, "promote_rule": "hope"})
    assert r.status_code == 422 and "promote_rule" in r.json()["error"]["message"]

    rid = ro["id"]
    assert client.post(f"/ops/rollouts/{rid}/pause", headers=ops, json={"reason": "a look"}).json()["state"] == "paused"
    assert client.post(f"/ops/rollouts/{rid}/resume", headers=ops).json()["state"] == "running"
    status = client.get("/ops/rollouts", headers=ops).json()
    assert status["rollout"]["id"] == rid and [s["decision"] for s in status["steps"]] == ["pause", "resume"]
    assert status["pools"] == {"stable": STABLE, "canary": CANDIDATE, "canary_percent": 10.0}
    assert client.post(f"/ops/rollouts/{rid}/promote", headers=ops).json()["state"] == "promoted"
    r = client.post(f"/ops/rollouts/{rid}/abort", headers=ops)
    assert r.status_code == 409 and "is promoted" in r.json()["error"]["message"]
    assert client.post("/ops/rollouts/999/abort", headers=ops).status_code == 404
    assert pools.read(sqlite_engine).stable == CANDIDATE


def test_http_without_a_database_says_so(api):
    client, app = api
    app.state.database_url = None
    r = client.get("/ops/rollouts", headers={"Authorization": "Bearer ops"})
    assert r.status_code == 503 and "database" in r.json()["error"]["message"]
