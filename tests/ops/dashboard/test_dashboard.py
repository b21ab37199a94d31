"""The ops dashboard: its SQL on SQLite and PostgreSQL, its auth, and the page in headless Chromium."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from feedback import db
from ops.dashboard import write_static
from ops.dashboard.data import dashboard_data, pick_bucket
from ops.dashboard.page import render_html
from ops.dashboard.routes import router, session_token, signer
from serving.http.app import build_app
from serving.http.deps import ApiState
from serving.settings import ServeSettings
from tests.helpers import flywheel, scaled, uvicorn_server

OPS = "ops-secret-token"
EDITOR = "editor-secret-token"
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
# version: (first minute served, last minute, accept probability, reward when accepted)
SERVED = {1: (0, 50, 0.20, 0.6), 2: (40, 120, 0.35, 0.8), 3: (90, 120, 0.50, 0.9)}
SIZES = {1: (250_000_000, 250_000_000), 2: (31_000_000, 250_000_000), 3: (28_500_000, 250_000_000)}


def fill(engine) -> dict:
    """Two hours of real-looking traffic over 3 versions, a rollout of v3 in progress, swaps.
    Returns the numbers the dashboard must show."""
    rng = random.Random(7)
    aborts = random.Random(11)  # its own generator: the other numbers stay as they were
    implicit = random.Random(13)  # the same
    comps, choices, events, rewards = [], [], [], []
    expect = {
        v: {"completions": 0, "shown": 0, "accepted": 0, "rewards": [], "served": [], "inferred": Counter()}
        for v in SERVED
    }
    for v, (start, end, p_accept, r_accept) in SERVED.items():
        for i in range(start * 2, end * 2):  # one completion every 30 s per version
            cid = f"cmpl-v{v}-{i:04d}"
            at = T0 + timedelta(seconds=30 * i + v)
            latency_ms = rng.uniform(40, 120)
            finish = "abort" if aborts.random() < 0.1 * v else "stop"  # v3 fails most
            expect[v]["served"].append((at, latency_ms, finish == "abort"))
            comps.append(
                dict(
                    completion_id=cid,
                    model_version=v,
                    user_hash=f"u{rng.randrange(20)}",
                    session_id=None,
                    language="python",
                    filepath="app/models.py",
                    prompt_token_ids=[1, 2, 3],
                    prompt_text="def f(",
                    summary_ids=[],
                    n_choices=1,
                    latency_ms=latency_ms,
                    created_at=at,
                )
            )
            choices.append(
                dict(
                    completion_id=cid,
                    choice_index=0,
                    token_ids=[5, 6],
                    logprobs=[-0.1, -0.2],
                    text="x):",
                    n_chars=3,
                    finish_reason=finish,
                )
            )
            expect[v]["completions"] += 1
            if rng.random() < 0.1:  # never shown, or by a client that sends no events
                rewards.append(
                    dict(
                        completion_id=cid, choice_index=0, model_version=v, reward=0.0, components={}, outcome="unseen"
                    )
                )
                expect[v]["rewards"].append(0.0)
                if implicit.random() < 0.7:  # the sink read from the next request what became of it
                    kind = "select" if implicit.random() < 0.4 else "dismiss"
                    events.append(_event(cid, kind, at + timedelta(seconds=20), source=db.INFERRED))
                    expect[v]["inferred"][kind] += 1
                continue
            expect[v]["shown"] += 1
            events.append(_event(cid, "view", at + timedelta(seconds=1)))
            if rng.random() < p_accept:
                expect[v]["accepted"] += 1
                events.append(_event(cid, "select", at + timedelta(seconds=2), select_kind="full", accepted_chars=3))
                reward, outcome = r_accept, "select"
            else:
                events.append(_event(cid, "dismiss", at + timedelta(seconds=2)))
                reward, outcome = -0.2, "dismiss"
            rewards.append(
                dict(
                    completion_id=cid,
                    choice_index=0,
                    model_version=v,
                    reward=reward,
                    components={"accepted": reward},
                    outcome=outcome,
                )
            )
            expect[v]["rewards"].append(reward)
    versions = [
        dict(
            version=v,
            parent=v - 1 if v > 1 else None,
            kind="full" if v == 1 else "delta",
            uri=f"file:///store/v{v}",
            sha256="0" * 64,
            size_bytes=SIZES[v][0],
            full_size_bytes=SIZES[v][1],
            gate_passed=True,
            gate_reason=None,
            metrics={"heldout_loss": 2.1 - 0.1 * v},
            created_at=T0 + timedelta(minutes=SERVED[v][0] - 5),
        )
        for v in SERVED
    ]
    steps = [
        dict(
            step_index=0,
            weight=5.0,
            decision="advance",
            decided_at=T0 + timedelta(minutes=100),
            evidence={
                "canary": {"accept_rate": 0.48, "n": 40},
                "stable": {"accept_rate": 0.34, "n": 760},
                "p_value": 0.03,
            },
        ),
        dict(
            step_index=1,
            weight=25.0,
            decision="hold",
            decided_at=T0 + timedelta(minutes=110),
            evidence={"canary": {"accept_rate": 0.51, "n": 55}, "reason": "below min_samples"},
        ),
    ]
    swaps = [
        dict(
            pool="stable",
            replica="stable-0",
            from_version=1,
            to_version=2,
            ok=True,
            pause_s=0.120,
            prepare_s=2.5,
            tensors_reloaded=96,
            fetched_bytes=31_000_000,
            at=T0 + timedelta(minutes=40),
        ),
        dict(
            pool="stable",
            replica="stable-1",
            from_version=1,
            to_version=2,
            ok=True,
            pause_s=0.080,
            prepare_s=2.4,
            tensors_reloaded=96,
            fetched_bytes=31_000_000,
            at=T0 + timedelta(minutes=41),
        ),
        dict(
            pool="canary",
            replica="canary-0",
            from_version=2,
            to_version=3,
            ok=False,
            pause_s=0.0,
            prepare_s=1.0,
            tensors_reloaded=0,
            fetched_bytes=0,
            error="sha256 mismatch",
            at=T0 + timedelta(minutes=89),
        ),
        dict(
            pool="canary",
            replica="canary-0",
            from_version=2,
            to_version=3,
            ok=True,
            pause_s=0.045,
            prepare_s=2.2,
            tensors_reloaded=90,
            fetched_bytes=28_500_000,
            at=T0 + timedelta(minutes=90),
        ),
    ]
    with engine.begin() as conn:
        conn.execute(db.model_versions.insert(), versions)
        conn.execute(db.completions.insert(), comps)
        conn.execute(db.completion_choices.insert(), choices)
        conn.execute(db.events.insert(), events)
        conn.execute(db.rewards.insert(), rewards)
        old = conn.execute(
            db.rollouts.insert().values(
                candidate_version=2,
                stable_version=1,
                state="promoted",
                step_index=3,
                weights=[5, 25, 50, 100],
                interval_s=300,
                thresholds={},
                min_samples=50,
                reason="all steps passed",
                started_at=T0 + timedelta(minutes=35),
                updated_at=T0 + timedelta(minutes=60),
                finished_at=T0 + timedelta(minutes=60),
            )
        ).inserted_primary_key[0]
        rid = conn.execute(
            db.rollouts.insert().values(
                candidate_version=3,
                stable_version=2,
                state="running",
                step_index=1,
                weights=[5, 25, 50, 100],
                interval_s=600,
                thresholds={"min_accept_ratio": 0.95, "max_p99_latency_ms": 250},
                min_samples=50,
                reason=None,
                started_at=T0 + timedelta(minutes=90),
                updated_at=T0 + timedelta(minutes=110),
            )
        ).inserted_primary_key[0]
        conn.execute(db.rollout_steps.insert(), [s | {"rollout_id": rid} for s in steps])
        conn.execute(
            db.rollout_steps.insert(),
            [
                dict(
                    rollout_id=old,
                    step_index=3,
                    weight=100.0,
                    decision="promote",
                    evidence={},
                    decided_at=T0 + timedelta(minutes=60),
                )
            ],
        )
        conn.execute(db.swap_events.insert(), swaps)
        pools_at = T0 + timedelta(minutes=100)
        conn.execute(
            db.serving_pools.insert(),
            [
                dict(pool="stable", version=2, traffic_percent=75.0, rollout_id=rid, updated_at=pools_at),
                dict(pool="canary", version=3, traffic_percent=25.0, rollout_id=rid, updated_at=pools_at),
            ],
        )
    return expect


def _event(cid: str, kind: str, at: datetime, source: str = db.EXPLICIT, **kw) -> dict:
    event_id = f"{cid}-{kind}-{source[0]}"[-36:]
    return dict(event_id=event_id, completion_id=cid, choice_index=0, type=kind, created_at=at, source=source) | kw


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'flywheel.db'}"


@pytest.fixture
def filled(sqlite_url):
    engine = db.make_engine(sqlite_url)
    db.upgrade(engine)
    expect = fill(engine)
    yield engine, expect
    engine.dispose()


def make_app(database_url: str | None):
    app = build_app(routers=[router()])
    app.state.api = ApiState(
        cfg=ServeSettings(),
        replicas={},
        producer=None,
        editor_tokens={EDITOR},
        decode=None,
        ops_tokens={OPS},
        database_url=database_url,
    )
    return app


# --- data ------------------------------------------------------------------------------------------


def check_data(data: dict, expect: dict) -> None:
    versions = {v["version"]: v for v in data["versions"]}
    assert sorted(versions) == [1, 2, 3]
    for v, e in expect.items():
        row = versions[v]
        assert (row["completions"], row["shown"], row["accepted"]) == (e["completions"], e["shown"], e["accepted"])
        assert row["accept_rate"] == pytest.approx(e["accepted"] / e["shown"])
        assert row["mean_reward"] == pytest.approx(sum(e["rewards"]) / len(e["rewards"]))
        assert (row["size_bytes"], row["full_size_bytes"]) == SIZES[v]
        # the time series add up to the totals
        assert sum(a["shown"] for a in data["acceptance"] if a["version"] == v) == e["shown"]
        assert sum(r["rewarded"] for r in data["reward"] if r["version"] == v) == len(e["rewards"])
        check_latency(data, v, e["served"])
    n_completions = sum(e["completions"] for e in expect.values())
    assert data["totals"]["completions"] == n_completions == sum(c["n"] for c in data["volume"]["completions"])
    assert data["totals"]["events"] == sum(e["n"] for e in data["volume"]["events"])
    # inferred events apart from the editors' own, by type
    by_source: dict[str, Counter] = {db.EXPLICIT: Counter(), db.INFERRED: Counter()}
    for e in data["volume"]["events"]:
        by_source[e["source"]][e["type"]] += e["n"]
    inferred = sum((e["inferred"] for e in expect.values()), Counter())
    assert by_source[db.INFERRED] == inferred and set(inferred) == {"select", "dismiss"}
    assert data["totals"]["inferred_events"] == inferred.total() > 0
    assert set(by_source[db.EXPLICIT]) == {"view", "select", "dismiss"}
    shown = sum(e["shown"] for e in expect.values())
    accepted = sum(e["accepted"] for e in expect.values())
    assert by_source[db.EXPLICIT] == Counter(view=shown, select=accepted, dismiss=shown - accepted)
    assert data["bucket_s"] == 300  # two hours of data: 5-minute buckets
    assert data["acceptance"][0]["t"] == "2026-12-01T09:00:00+00:00"
    ro = data["rollout"]
    assert (ro["candidate_version"], ro["stable_version"], ro["state"], ro["step_index"], ro["active"]) == (
        3,
        2,
        "running",
        1,
        True,
    )
    assert [s["decision"] for s in ro["steps"]] == ["advance", "hold"]
    assert ro["steps"][0]["evidence"]["canary"]["n"] == 40
    assert [r["state"] for r in data["rollouts"]] == ["running", "promoted"]
    assert [(s["to_version"], s["swaps"], s["failed"]) for s in data["swap_summary"]] == [(2, 2, 0), (3, 2, 1)]
    assert data["swap_summary"][0]["p50_pause_s"] == pytest.approx(0.080)
    assert data["swap_summary"][0]["max_pause_s"] == pytest.approx(0.120)
    assert {p["pool"]: p["version"] for p in data["pools"]} == {"stable": 2, "canary": 3}


def check_latency(data: dict, version: int, served: list[tuple[datetime, float, bool]]) -> None:
    """p50 and p99 per bucket by nearest rank (the ceil(q*n)-th smallest), errors counted by hand."""
    buckets: dict[str, list] = {}
    for at, ms, failed in served:
        start = datetime.fromtimestamp(int(at.timestamp()) // data["bucket_s"] * data["bucket_s"], UTC)
        buckets.setdefault(start.isoformat(), []).append((ms, failed))
    got = {r["t"]: r for r in data["latency"] if r["version"] == version}
    assert got.keys() == buckets.keys()
    for t, rows in buckets.items():
        ms = sorted(m for m, _ in rows)
        errors = sum(f for _, f in rows)
        row = got[t]
        assert (row["completions"], row["choices"], row["errors"]) == (len(ms), len(ms), errors)
        assert row["p50_ms"] == pytest.approx(ms[math.ceil(0.50 * len(ms)) - 1])
        assert row["p99_ms"] == pytest.approx(ms[math.ceil(0.99 * len(ms)) - 1])
        assert row["error_rate"] == pytest.approx(errors / len(ms))


def test_dashboard_data_sqlite(filled):
    engine, expect = filled
    check_data(dashboard_data(engine), expect)


@pytest.mark.postgres
def test_dashboard_data_postgres_matches_sqlite(postgres_url, filled):
    engine, expect = filled
    pg = db.make_engine(postgres_url)
    try:
        db.upgrade(pg)
        fill(pg)
        got = dashboard_data(pg)
        check_data(got, expect)
        assert _comparable(got) == _comparable(dashboard_data(engine))
    finally:
        pg.dispose()


def _comparable(data: dict):
    """The data with floats rounded (AVG differs in the last bits) and the clock dropped."""

    def walk(v):
        if isinstance(v, float):
            return round(v, 9)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items() if k != "generated_at"}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(data)


def test_empty_database_renders(sqlite_url):
    engine = db.make_engine(sqlite_url)
    db.upgrade(engine)
    data = dashboard_data(engine)
    assert data["versions"] == [] and data["rollout"] is None and data["totals"]["completions"] == 0
    page = render_html(data, script_src="dashboard/app.js")
    assert "no data yet" in page and "no rollout yet" in page


def test_pick_bucket():
    t = datetime(2026, 1, 1, tzinfo=UTC)
    assert pick_bucket(None, None) == 60
    assert pick_bucket(t, t + timedelta(minutes=30)) == 60
    assert pick_bucket(t, t + timedelta(hours=2)) == 300
    assert pick_bucket(t, t + timedelta(days=3)) == 3600
    assert pick_bucket(t, t + timedelta(days=400)) == 7 * 86400


def test_render_escapes_database_text(filled):
    engine, _ = filled
    data = dashboard_data(engine)
    data["rollout"]["reason"] = "<script>alert(1)</script>"
    data["rollout"]["steps"][0]["evidence"] = {"note": "</script><b>x</b>"}
    page = render_html(data, script_src="dashboard/app.js")
    assert "<script>alert(1)" not in page and "</script><b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_inferred_events_are_drawn_apart(filled):
    """Each event type keeps its colour; its inferred events are a hatched bar of their own."""
    engine, _ = filled
    page = render_html(dashboard_data(engine), script_src="dashboard/app.js")
    figures = json.loads(re.search(r'<script type="application/json" id="figures">(.*?)</script>', page, re.S).group(1))
    (volume,) = [f["figure"] for f in figures if f["id"] == "chart-volume"]
    bars = {t["name"]: t for t in volume["data"] if t["type"] == "bar"}
    assert set(bars) == {f"{k} events" for k in ("view", "select", "dismiss")} | {
        f"{k} events (inferred)" for k in ("select", "dismiss")
    }
    for kind in ("select", "dismiss"):
        mine, inferred = bars[f"{kind} events"]["marker"], bars[f"{kind} events (inferred)"]["marker"]
        assert mine["color"] == inferred["color"]
        assert mine["pattern"]["shape"] == "" and inferred["pattern"]["shape"] == "/"


def test_write_static_is_self_contained(filled, tmp_path):
    engine, _ = filled
    out = write_static(engine, tmp_path / "out" / "dashboard.html")
    page = out.read_text()
    assert "<script src=" not in page and "http://" not in page.split("<script>", 1)[0]
    assert "Plotly" in page and len(page) > 1_000_000  # plotly.js is inlined
    assert 'id="chart-accept"' in page and "Rollout #2" in page


def test_cli_writes_static_copy(filled, sqlite_url, tmp_path):
    out = tmp_path / "site" / "dashboard.html"
    r = flywheel("dashboard", "--out", str(out), "--set", f"database.url={sqlite_url}", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "step 2 of 4" in out.read_text()


def test_cli_one_line_errors(tmp_path):
    r = flywheel(
        "dashboard",
        "--out",
        str(tmp_path / "d.html"),
        "--set",
        f"database.url=sqlite:///{tmp_path / 'none.db'}",
        tmp_path=tmp_path,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "does not exist; run `flywheel up`" in r.stderr
    engine = db.make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    db.upgrade(engine, "0002")
    r = flywheel(
        "dashboard",
        "--out",
        str(tmp_path / "d.html"),
        "--set",
        f"database.url=sqlite:///{tmp_path / 'old.db'}",
        tmp_path=tmp_path,
    )
    assert r.returncode == 1 and "is at revision 0002" in r.stderr and "flywheel db upgrade" in r.stderr
    r = flywheel("dashboard", tmp_path=tmp_path)
    assert r.returncode == 2 and "--out" in r.stderr


# --- HTTP ------------------------------------------------------------------------------------------


def test_dashboard_requires_ops_token(filled, sqlite_url):
    client = TestClient(make_app(sqlite_url))
    for path in ("/ops/dashboard", "/ops/dashboard.json", "/ops/dashboard/app.js"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": f"Bearer {EDITOR}"}).status_code == 403, path
        assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401, path
        assert client.get(path, headers={"Authorization": f"Bearer {OPS}"}).status_code == 200, path
    # no way to pass the token in the URL
    assert client.get(f"/ops/dashboard.json?token={OPS}").status_code == 401
    # the HTML page answers 401 with the login form
    r = client.get("/ops/dashboard")
    assert r.headers["content-type"].startswith("text/html") and '<form method="post" action="login">' in r.text


def test_dashboard_json_and_page(filled, sqlite_url):
    _, expect = filled
    client = TestClient(make_app(sqlite_url), headers={"Authorization": f"Bearer {OPS}"})
    check_data(client.get("/ops/dashboard.json").json(), expect)
    r = client.get("/ops/dashboard")
    assert "script-src 'self'" in r.headers["content-security-policy"] and r.headers["cache-control"] == "no-store"
    assert '<script src="dashboard/app.js"></script>' in r.text and "step 2 of 4" in r.text
    js = client.get("/ops/dashboard/app.js")
    assert js.headers["content-type"].startswith("text/javascript") and "Plotly.newPlot" in js.text


def test_login_cookie(filled, sqlite_url):
    # Plain http from a loopback address: the one place `auto` leaves the cookie without Secure.
    client = TestClient(make_app(sqlite_url), base_url="http://127.0.0.1:8000", follow_redirects=False)
    r = client.post("/ops/login", data={"token": "wrong"})
    assert r.status_code == 401 and "wrong token" in r.text and "set-cookie" not in r.headers
    r = client.post("/ops/login", data={"token": EDITOR})
    assert r.status_code == 403 and "editor token" in r.text and "set-cookie" not in r.headers
    r = client.post("/ops/login", data={"token": OPS})
    assert r.status_code == 303 and r.headers["location"] == "dashboard"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ops" in cookie
    assert "Max-Age=43200" in cookie and "Secure" not in cookie
    assert OPS not in cookie  # the cookie is the login time signed with the token, not the token
    assert client.get("/ops/dashboard").status_code == 200
    assert client.get("/ops/dashboard.json").status_code == 200
    value = re.search(r"flywheel_ops=([^;]+)", cookie).group(1)
    assert session_token(value, {OPS}, max_age_s=60) == OPS and session_token(value, {"other"}, 60) is None
    # revoking the ops token ends the session
    client.app.state.api.ops_tokens = {"another-ops-token"}
    assert client.get("/ops/dashboard.json").status_code == 401
    client.app.state.api.ops_tokens = {OPS}
    assert client.post("/ops/logout").status_code == 303
    assert client.get("/ops/dashboard.json").status_code == 401


def test_the_session_expires_on_the_server(filled, sqlite_url):
    app = make_app(sqlite_url)
    app.state.api.cfg = ServeSettings(dashboard={"session_max_age_s": "1h"})
    client = TestClient(app)

    def cookie(age_s: int) -> dict:
        """A session cookie of a login `age_s` seconds ago (a browser may keep one for as long as it likes)."""
        s = signer(OPS)
        s.get_timestamp = lambda: int(time.time()) - age_s
        return {"Cookie": f"flywheel_ops={s.sign(b'ops').decode()}"}

    assert client.get("/ops/dashboard.json", headers=cookie(3500)).status_code == 200
    r = client.get("/ops/dashboard.json", headers=cookie(3700))
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    r = client.get("/ops/dashboard", headers=cookie(3700))
    assert r.status_code == 401 and '<form method="post" action="login">' in r.text
    tampered = cookie(3700)["Cookie"].replace("flywheel_ops=ops.", "flywheel_ops=ops.A")
    assert client.get("/ops/dashboard.json", headers={"Cookie": tampered}).status_code == 401


@pytest.mark.parametrize(
    "base_url, setting, secure",
    [
        ("http://127.0.0.1:8000", "auto", False),
        ("http://localhost:8000", "auto", False),
        ("http://dash.example.com", "auto", True),  # plain http to a public name: still Secure
        ("https://dash.example.com", "auto", True),
        ("http://127.0.0.1:8000", "always", True),
        ("http://10.0.0.5:8000", "never", False),
    ],
)
def test_cookie_secure_follows_the_setting(base_url, setting, secure):
    app = make_app(None)
    app.state.api.cfg = ServeSettings(dashboard={"cookie_secure": setting})
    r = TestClient(app, base_url=base_url, follow_redirects=False).post("/ops/login", data={"token": OPS})
    assert r.status_code == 303 and ("; secure" in r.headers["set-cookie"].lower()) == secure


def test_dashboard_without_database():
    client = TestClient(make_app(None), headers={"Authorization": f"Bearer {OPS}"})
    r = client.get("/ops/dashboard.json")
    assert r.status_code == 503 and "database" in r.json()["error"]["message"]


# --- the page in a browser -------------------------------------------------------------------------


@pytest.fixture
def server(filled, sqlite_url):
    with uvicorn_server(make_app(sqlite_url)) as port:
        yield f"http://127.0.0.1:{port}", filled[1]


@pytest.fixture
def browser(monkeypatch):
    webdriver = pytest.importorskip("selenium.webdriver")
    monkeypatch.setenv(
        "SE_AVOID_STATS", "true"
    )  # Selenium Manager must not phone home (it is not needed: paths are given)
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if os.environ.get("CI"):
            pytest.fail("chromium or chromedriver is missing; .ci/run must install chromium and chromium-driver")
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,2400",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service

    driver = webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))
    driver.set_page_load_timeout(scaled(60))
    yield driver
    driver.quit()


@pytest.mark.slow
def test_dashboard_in_chromium(server, browser, filled):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, expect = server
    browser.get(f"{base}/ops/dashboard")
    assert "Log in with an ops token" in browser.find_element(By.ID, "message").text
    # a wrong token: the login page again, as a 401
    browser.find_element(By.NAME, "token").send_keys("not-a-token")
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(browser, 10).until(lambda d: "wrong token" in d.page_source)
    browser.get_log("browser")  # drop the two 401s so far: only the dashboard's own messages count below
    # the ops token: a session cookie, then the dashboard
    browser.find_element(By.NAME, "token").send_keys(OPS)
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(browser, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".main-svg")) >= 16)
    assert browser.current_url == f"{base}/ops/dashboard"
    assert browser.get_cookie("flywheel_ops")["httpOnly"] is True
    assert browser.execute_script("return document.cookie") == ""  # HttpOnly: invisible to scripts

    traces = browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('.js-plotly-plot')].map(e => [e.id, e.data.length]))"
    )
    # one trace per version (p50 and p99 for latency); event kinds stacked per source (3 explicit,
    # 2 inferred) plus the completions line; delta and full; one per pool
    assert traces == {
        "chart-accept": 3,
        "chart-latency": 6,
        "chart-errors": 3,
        "chart-reward": 3,
        "chart-rollout": 2,
        "chart-sizes": 2,
        "chart-swaps": 2,
        "chart-volume": 6,
    }
    volume_legend = browser.execute_script(
        "return [...document.querySelectorAll('#chart-volume .legendtext')].map(e => e.textContent)"
    )
    assert sorted(volume_legend) == [
        "completions",
        "dismiss events",
        "dismiss events (inferred)",
        "select events",
        "select events (inferred)",
        "view events",
    ]
    legend = browser.execute_script(
        "return [...document.querySelectorAll('#chart-accept .legendtext')].map(e => e.textContent)"
    )
    assert legend == ["v1", "v2", "v3"]
    latency_legend = browser.execute_script(
        "return [...document.querySelectorAll('#chart-latency .legendtext')].map(e => e.textContent)"
    )
    assert latency_legend == ["v1 p50", "v1 p99", "v2 p50", "v2 p99", "v3 p50", "v3 p99"]
    # the points drawn are the data's, version by version
    p99_v3 = browser.execute_script("return document.getElementById('chart-latency').data[5].y")
    assert p99_v3 == [r["p99_ms"] for r in dashboard_data(filled[0])["latency"] if r["version"] == 3]
    points = browser.execute_script("return document.querySelectorAll('#chart-accept .scatterlayer .point').length")
    assert points == len(
        browser.execute_script("return document.getElementById('chart-accept').data.flatMap(t => t.x)")
    )

    summary = browser.find_element(By.ID, "rollout-summary").text
    assert (
        "Rollout #2" in summary
        and "v3" in summary
        and "v2" in summary
        and "running" in summary
        and "step 2 of 4" in summary
    )
    steps = browser.find_element(By.ID, "rollout-steps").text
    assert (
        "advance" in steps and "hold" in steps and "canary.accept_rate = 0.48" in steps and "below min_samples" in steps
    )

    versions = browser.find_element(By.ID, "versions").text
    for v, e in expect.items():
        assert f"v{v}" in versions
        assert f"{e['accepted'] / e['shown']:.1%}" in versions
    assert "31.00 MB" in versions and "250.00 MB" in versions and "12.4%" in versions and "11.4%" in versions
    swaps = browser.find_element(By.ID, "swaps").text
    assert "80.0 ms" in swaps and "120.0 ms" in swaps and "45.0 ms" in swaps
    overview = browser.find_element(By.ID, "overview").text
    assert (
        f"completions\n{sum(e['completions'] for e in expect.values())}" in overview
        and "canary pool\nv3 · 25%" in overview
    )
    inferred = sum(e["inferred"].total() for e in expect.values())
    assert f"inferred events\n{inferred}" in overview
    explicit = sum(2 * e["shown"] for e in expect.values())  # a view, then a select or a dismiss
    assert f"\nevents\n{explicit}\n" in overview

    # the page's CSP held: no script error, no refused resource
    errors = [m["message"] for m in browser.get_log("browser") if m["level"] == "SEVERE"]
    assert errors == []
    assert not math.isnan(browser.execute_script("return document.getElementById('chart-accept').data[2].y[0]"))


@pytest.mark.slow
def test_static_copy_in_chromium(filled, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    path = write_static(filled[0], tmp_path / "dashboard.html")
    browser.get(path.as_uri())  # file://, no server and no network: plotly.js is in the page
    WebDriverWait(browser, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .main-svg")) >= 16)
    assert "step 2 of 4" in browser.find_element(By.ID, "rollout-summary").text
    assert [m["message"] for m in browser.get_log("browser") if m["level"] == "SEVERE"] == []
