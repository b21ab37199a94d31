"""Every refusal of the served API (serving's routes and the ops route groups), route by route:
401 / 403 for tokens, 413 for a body over the limit (before it is parsed or its token checked),
422 naming the field for crafted input (lone surrogates, non-finite numbers, ids beyond their
columns), 429 with Retry-After beyond a rate limit; never a 5xx, and nothing refused is recorded."""

import json

import pytest

from feedback import db
from ops.routes import ops_routers
from tests.serving.conftest import TOKEN, make_client

OPS = "ops-test-token"
BODY_LIMIT = 2048


@pytest.fixture
def api(tok, tmp_path):
    """The API as `flywheel serve` serves it, over a migrated SQLite database."""
    return served(tok, f"sqlite:///{tmp_path / 'flywheel.db'}")


def served(tok, url: str):
    client, sink, engine = make_client(
        tok,
        routers=[make() for make in ops_routers()],
        limits={"max_body_bytes": BODY_LIMIT, "completions": "5/minute", "events": "5/minute"},
        dashboard={"login_failures": "3 per 15 minutes"},
    )
    db.upgrade(db.make_engine(url))
    client.app.state.api.ops_tokens = {OPS}
    client.app.state.api.database_url = url
    client.headers.pop("Authorization")
    return client, sink


EDITOR_H = {"Authorization": f"Bearer {TOKEN}"}
OPS_H = {"Authorization": f"Bearer {OPS}"}
JSON_H = {"Content-Type": "application/json"}

# Every route of the served API: method, path, who may call it.
ROUTES = [
    ("POST", "/v1/completions", "editor"),
    ("POST", "/infill", "editor"),
    ("POST", "/api/generate", "editor"),
    ("GET", "/api/tags", "editor"),
    ("POST", "/api/show", "editor"),
    ("GET", "/api/version", "public"),
    ("POST", "/v1/events", "editor"),
    ("POST", "/v1/events/batch", "editor"),
    ("GET", "/v1/models", "editor"),
    ("GET", "/v1/health", "public"),
    ("GET", "/metrics", "public"),
    ("GET", "/ops/dashboard.json", "ops"),
    ("GET", "/ops/dashboard/app.js", "ops"),
    ("GET", "/ops/dashboard", "ops"),
    ("POST", "/ops/login", "public"),
    ("POST", "/ops/logout", "public"),
    ("GET", "/ops/rollouts", "ops"),
    ("POST", "/ops/rollouts", "ops"),
    ("POST", "/ops/rollouts/1/pause", "ops"),
    ("POST", "/ops/rollouts/1/resume", "ops"),
    ("POST", "/ops/rollouts/1/promote", "ops"),
    ("POST", "/ops/rollouts/1/abort", "ops"),
]


def test_the_table_covers_every_route(api):
    client, _ = api
    served = {
        (m, r.path.replace("{rollout_id}", "1"))
        for r in client.app.routes
        for m in getattr(r, "methods", ())
        if r.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc") and m != "HEAD"
    }
    assert served == {(m, p) for m, p, _ in ROUTES}


@pytest.mark.parametrize("method, path, who", [r for r in ROUTES if r[2] != "public"])
def test_tokens_401_and_403(api, method, path, who):
    client, sink = api
    r = client.request(method, path)
    assert r.status_code == 401, r.text
    assert client.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    if who == "ops":
        r = client.request(method, path, headers=EDITOR_H)
        assert r.status_code == 403 and "editor token" in r.text
    # a session cookie that is not valid, with characters a str comparison would choke on
    bad_cookie = {"Cookie": "flywheel_ops=caf\xe9.\xff".encode("latin-1")}
    assert client.request(method, path, headers=bad_cookie).status_code == 401
    assert sink.sent == []


@pytest.mark.parametrize("method, path, who", ROUTES)
def test_an_oversized_body_is_413_on_every_route_before_its_token(api, method, path, who):
    client, sink = api
    big = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    r = client.request(method, path, content=big, headers=JSON_H)  # no token at all
    assert r.status_code == 413, r.text
    assert (
        r.json()["error"]["message"]
        == f"request body exceeds the limit of {BODY_LIMIT} bytes (serve.limits.max_body_bytes)"
    )
    assert sink.sent == []


@pytest.mark.parametrize("method, path, who", [r for r in ROUTES if r[0] == "POST" and r[1] != "/ops/logout"])
def test_a_chunked_body_without_length_is_counted(api, method, path, who):
    client, sink = api
    chunks = (b"x" * 1024 for _ in range(4))  # no Content-Length: counted as it is read
    headers = {**JSON_H, **(OPS_H if who == "ops" else EDITOR_H)}
    r = client.request(method, path, content=chunks, headers=headers)
    assert r.status_code == 413, r.text
    assert sink.sent == []


LONE = "\ud800"

# (path, body, the field the 422 names) for every string a body carries into Kafka, SQL or the tokenizer
CRAFTED = [
    ("/v1/completions", {"prompt": f"x{LONE}"}, "prompt"),
    ("/v1/completions", {"prompt": [f"x{LONE}"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "suffix": LONE}, "suffix"),
    ("/v1/completions", {"prompt": "x", "user": LONE}, "user"),
    ("/v1/completions", {"prompt": "x", "model": f"flywheel{LONE}"}, "model"),
    ("/v1/completions", {"prompt": "x", "stop": [LONE]}, "stop"),
    ("/v1/completions", {"language": LONE, "segments": {"prefix": "x"}}, "language"),
    ("/v1/completions", {"segments": {"prefix": LONE}}, "segments.prefix"),
    ("/v1/completions", {"segments": {"prefix": "x", "suffix": LONE}}, "segments.suffix"),
    ("/v1/completions", {"segments": {"prefix": "x", "filepath": LONE}}, "segments.filepath"),
    ("/v1/completions", {"segments": {"prefix": "x", "git_url": LONE}}, "segments.git_url"),
    ("/v1/completions", {"segments": {"prefix": "x", "clipboard": LONE}}, "segments.clipboard"),
    (
        "/v1/completions",
        {"segments": {"prefix": "x", "declarations": [{"body": LONE}]}},
        "segments.declarations.0.body",
    ),
    ("/v1/completions", {"segments": {"prefix": "x"}, "user": LONE}, "user"),
    (
        "/v1/completions",
        {"segments": {"prefix": "x", "declarations": [{"filepath": LONE}]}},
        "segments.declarations.0.filepath",
    ),
    ("/infill", {"input_prefix": LONE}, "input_prefix"),
    ("/infill", {"input_suffix": LONE}, "input_suffix"),
    ("/infill", {"prompt": LONE}, "prompt"),
    ("/infill", {"input_extra": [{"filename": LONE}]}, "input_extra.0.filename"),
    ("/infill", {"input_extra": [{"text": LONE}]}, "input_extra.0.text"),
    ("/infill", {"stop": [LONE]}, "stop"),
    ("/api/generate", {"model": LONE}, "model"),
    ("/api/show", {"model": LONE}, "model"),
    ("/api/generate", {"model": "m", "prompt": LONE}, "prompt"),
    ("/api/generate", {"model": "m", "prompt": "x", "suffix": LONE}, "suffix"),
    ("/api/generate", {"model": "m", "options": {"stop": [LONE]}}, "options.stop"),
    ("/v1/events", {"type": "view", "completion_id": "c", "view_id": LONE}, "view_id"),
    ("/v1/events", {"type": "edit", "completion_id": "c", "kept_text": f"kept{LONE}"}, "kept_text"),
    ("/v1/events", {"type": "view", "completion_id": LONE}, "completion_id"),
    ("/ops/rollouts", {"version": 1, "mode": LONE}, "mode"),
    ("/ops/rollouts", {"version": 1, "thresholds": {LONE: 0.1}}, "thresholds"),
    ("/ops/rollouts/1/pause", {"reason": LONE}, "reason"),
    # numbers: beyond their SQL columns, negative, or not finite (Python's JSON parser takes NaN)
    ("/v1/completions", {"prompt": "x", "temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": float("inf")}, "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("/infill", {"temperature": float("nan")}, "temperature"),
    ("/infill", {"seed": 2**63}, "seed"),
    ("/infill", {"t_max_predict_ms": 2**40}, "t_max_predict_ms"),
    ("/api/generate", {"model": "m", "options": {"top_p": float("inf")}}, "options.top_p"),
    ("/api/generate", {"model": "m", "options": {"seed": 2**63}}, "options.seed"),
    ("/v1/events", {"type": "select", "completion_id": "c", "accepted_chars": 2**63}, "accepted_chars"),
    ("/ops/rollouts", {"version": 2**63}, "version"),
    ("/ops/rollouts", {"version": -1}, "version"),
    ("/ops/rollouts", {"version": 1, "stable": 2**31}, "stable"),
    ("/ops/rollouts", {"version": 1, "min_samples": 2**40}, "min_samples"),
    ("/ops/rollouts", {"version": 1, "weights": [float("nan")]}, "weights.0"),
    ("/ops/rollouts", {"version": 1, "thresholds": {"reward_drop": float("inf")}}, "thresholds.reward_drop"),
    ("/ops/rollouts", {"version": 1, "interval_s": 1e300}, "interval_s"),
    # Tabby's fields that Flywheel does not use are bounded in count and size
    ("/v1/completions", {"segments": {"prefix": "x", "clipboard": "c" * 10_001}}, "segments.clipboard"),
    ("/v1/completions", {"segments": {"prefix": "x", "declarations": [{}] * 17}}, "segments.declarations"),
    (
        "/v1/completions",
        {"segments": {"prefix": "x", "relevant_snippets_from_changed_files": [{"body": "s" * 10_001}]}},
        "segments.relevant_snippets_from_changed_files.0.body",
    ),
    (
        "/v1/completions",
        {"segments": {"prefix": "x", "relevant_snippets_from_recently_opened_files": [{}] * 17}},
        "segments.relevant_snippets_from_recently_opened_files",
    ),
    ("/infill", {"input_extra": [{}] * 65}, "input_extra"),
]


@pytest.mark.parametrize("path, body, field", CRAFTED)
def test_crafted_input_is_422_naming_the_field(api, path, body, field):
    client, sink = api
    client.app.state.api.cfg.limits.max_body_bytes = 1 << 20  # room for the large ones
    # json.dumps writes the lone surrogate as the escape a client sends, and NaN as Python's parser takes it
    raw = json.dumps(body).encode()
    r = client.post(path, content=raw, headers={**JSON_H, **(OPS_H if path.startswith("/ops") else EDITOR_H)})
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: "), message
    assert sink.sent == []


@pytest.mark.parametrize("body, field", [(b, f) for p, b, f in CRAFTED if p == "/v1/events"])
def test_crafted_events_in_a_batch_are_rejected_naming_the_field(api, body, field):
    client, sink = api
    raw = json.dumps({"events": [body, {"type": "view", "completion_id": "c"}]}).encode()
    r = client.post("/v1/events/batch", content=raw, headers={**JSON_H, **EDITOR_H})
    assert r.status_code == 200, r.text
    first, second = r.json()["results"]
    assert first["status"] == "rejected" and first["error"].startswith(f"{field}: "), first
    assert second["status"] == "accepted" and len(sink.sent) == 1


@pytest.mark.parametrize(
    "method, path, field",
    [
        ("POST", f"/ops/rollouts/{2**63}/pause", "path.rollout_id"),
        ("POST", "/ops/rollouts/-1/abort", "path.rollout_id"),
        ("POST", f"/ops/rollouts/{10**30}/promote", "path.rollout_id"),
        ("GET", f"/ops/rollouts?id={2**63}", "query.id"),
        ("GET", "/ops/rollouts?id=-5", "query.id"),
    ],
)
def test_ids_beyond_their_columns_are_422(api, method, path, field):
    client, _ = api
    r = client.request(method, path, headers=OPS_H)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(f"{field}: "), r.text
    # the largest id a column holds is a plain "not found"
    assert client.post(f"/ops/rollouts/{2**63 - 1}/pause", headers=OPS_H).status_code == 404


@pytest.mark.postgres
def test_ops_routes_refuse_crafted_input_on_postgres(tok, postgres_url):
    """Where PostgreSQL's columns are narrower than SQLite's (INTEGER versions, BIGINT ids), the
    bounds still answer first: 422, or 404 for an id the column holds."""
    client, _ = served(tok, postgres_url)
    for path, body, field in CRAFTED:
        if path.startswith("/ops"):
            r = client.post(path, content=json.dumps(body).encode(), headers={**JSON_H, **OPS_H})
            assert r.status_code == 422 and r.json()["error"]["message"].startswith(f"{field}: "), (body, r.text)
    for rollout_id in (2**31, 2**63 - 1):
        assert client.post(f"/ops/rollouts/{rollout_id}/pause", headers=OPS_H).status_code == 404
    assert client.get(f"/ops/rollouts?id={2**63}", headers=OPS_H).status_code == 422
    r = client.post("/ops/rollouts", json={"version": 2**31 - 1}, headers=OPS_H)
    assert r.status_code == 400 and "unknown version" in r.json()["error"]["message"]


def test_login_with_undecodable_form_bytes_is_401(api):
    client, _ = api
    r = client.post(
        "/ops/login",
        content=b"token=\xed\xa0\x80%ED%A0%80",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 401 and "wrong token" in r.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/infill", {"input_prefix": "x", "n_predict": 2}),
        ("/api/generate", {"model": "flywheel", "prompt": "x", "stream": False, "options": {"num_predict": 2}}),
        ("/v1/events", {"type": "view", "completion_id": "c"}),
    ],
)
def test_rate_limit_per_token_is_429_with_retry_after(api, path, body):
    client, sink = api
    for _ in range(5):
        assert client.post(path, json=body, headers=EDITOR_H).status_code == 200
    r = client.post(path, json=body, headers=EDITOR_H)
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
    assert r.json()["error"]["message"].startswith("too many ") and "5 per 1 minute" in r.json()["error"]["message"]
    assert len(sink.sent) == 5  # the refused one is not recorded
    # another token has its own count
    client.app.state.api.editor_tokens = {TOKEN, "second-token"}
    assert client.post(path, json=body, headers={"Authorization": "Bearer second-token"}).status_code == 200


def test_login_is_throttled_per_address_after_failures(api):
    client, _ = api
    for _ in range(3):
        assert client.post("/ops/login", data={"token": "guess"}).status_code == 401
    r = client.post("/ops/login", data={"token": "guess"})
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 900 and "Too many failed logins" in r.text
    r = client.post("/ops/login", data={"token": OPS}, follow_redirects=False)
    assert r.status_code == 429 and "set-cookie" not in r.headers  # a right token too: guessing cannot go on
    # the bearer-token ops routes and other addresses are not affected
    assert client.get("/ops/rollouts", headers=OPS_H).status_code == 200
    from fastapi.testclient import TestClient

    other = TestClient(client.app, client=("10.1.2.3", 5000), follow_redirects=False)
    assert other.post("/ops/login", data={"token": OPS}).status_code == 303


def test_refusals_are_in_the_openapi_schema(api):
    client, _ = api
    spec = client.get("/openapi.json").json()
    assert {"413", "422", "429"} <= set(spec["paths"]["/v1/completions"]["post"]["responses"])
    assert {"413", "422", "429"} <= set(spec["paths"]["/v1/events"]["post"]["responses"])
    assert {"413", "422", "429", "503"} <= set(spec["paths"]["/v1/events/batch"]["post"]["responses"])
    assert {"413", "429"} <= set(spec["paths"]["/ops/login"]["post"]["responses"])
