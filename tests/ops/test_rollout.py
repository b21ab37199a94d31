"""The canary rollout controller on a real database fed with synthetic traffic of two versions.

Every test writes rows where the sink would (completions, completion_choices, events, rewards)
and drives the controller's stateless `tick()` with an explicit clock, so that each step's window
is exact. The HTTP endpoints run on the real API app; the CLI runs as a user would.
"""

import hashlib
import json
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select, text

from feedback import db, pools
from feedback.schemas import ModelVersion
from ops import rollout
from ops.rollout import RolloutError, RolloutSection, RolloutSettings
from tests.helpers import REPO, flywheel, scaled

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
STABLE, CANDIDATE, GATE_FAILED = 1, 2, 3
SECTION = RolloutSection(weights=[5, 25, 50, 100], interval_s=60, min_samples=100, max_holds=2)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    e = db.make_engine(url)
    db.upgrade(e)
    if request.param == "postgres":
        # An autovacuum worker (a superuser backend) in the test database would make the fixture's
        # DROP DATABASE ... WITH (FORCE) fail: these tables get thousands of rows at once.
        with e.begin() as conn:
            for table in (
                "completions",
                "completion_choices",
                "events",
                "rewards",
                "rollouts",
                "rollout_steps",
                "serving_pools",
            ):
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
    _versions(e)
    yield e
    e.dispose()


@pytest.fixture
def sqlite_engine(tmp_path):
    e = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(e)
    _versions(e)
    yield e
    e.dispose()


def _versions(engine, *extra: tuple[int, bool]):
    rows = [(STABLE, True), (CANDIDATE, True), (GATE_FAILED, False), *extra]
    with engine.begin() as conn:
        for v, passed in rows:
            conn.execute(
                insert(db.model_versions).values(
                    version=v,
                    parent=None,
                    kind="full",
                    uri=f"file:///w/v{v}",
                    sha256=hashlib.sha256(str(v).encode()).hexdigest(),
                    size_bytes=1,
                    full_size_bytes=1,
                    gate_passed=passed,
                    gate_reason=None if passed else "reward hacking suspected",
                    metrics={},
                    created_at=T0 - timedelta(days=1),
                )
            )


_serial = iter(range(10**9))


def serve(engine, version, n, *, start, span_s=50.0, accept=0.4, errors=0.0, latency_ms=50.0):
    """`n` served single-choice completions of `version` in [start, start + span_s): each shown (a
    `view`), the first `accept` share of every 100 also selected, `errors` share aborted; each
    with the reward the sink would give it (0.75 accepted, -0.25 ignored)."""
    comps, choices, events, rewards = [], [], [], []
    for i in range(n):
        cid = f"c{version}-{next(_serial)}"
        at = start + timedelta(seconds=span_s * i / n)
        accepted = (i % 100) < accept * 100
        comps.append(
            dict(
                completion_id=cid,
                model_version=version,
                user_hash="u",
                prompt_token_ids=[1],
                summary_ids=[],
                n_choices=1,
                latency_ms=latency_ms + i % 10,
                created_at=at,
            )
        )
        choices.append(
            dict(
                completion_id=cid,
                choice_index=0,
                token_ids=[5],
                logprobs=[-0.1],
                n_chars=4,
                text="x = 1",
                finish_reason="abort" if (i % 100) < errors * 100 else "stop",
            )
        )
        events.append(dict(event_id=f"{cid}-v", completion_id=cid, choice_index=0, type="view", created_at=at))
        if accepted:
            events.append(
                dict(
                    event_id=f"{cid}-s",
                    completion_id=cid,
                    choice_index=0,
                    type="select",
                    select_kind="full",
                    created_at=at,
                )
            )
        rewards.append(
            dict(
                completion_id=cid,
                choice_index=0,
                model_version=version,
                reward=0.75 if accepted else -0.25,
                components={},
                outcome="select" if accepted else "ignored",
            )
        )
    with engine.begin() as conn:
        conn.execute(insert(db.completions), comps)
        conn.execute(insert(db.completion_choices), choices)
        conn.execute(insert(db.events), events)
        conn.execute(insert(db.rewards), rewards)


def both_arms(engine, start, weight, *, total=4000, canary_accept=0.4, stable_accept=0.4, **canary_kw):
    n_canary = max(int(total * weight / 100), 0)
    serve(engine, CANDIDATE, n_canary, start=start, accept=canary_accept, **canary_kw)
    serve(engine, STABLE, total - n_canary, start=start, accept=stable_accept)


def steps_of(engine, rollout_id):
    with engine.connect() as conn:
        return rollout.steps(conn, rollout_id)


def start(engine, section=SECTION, **kw):
    pools.set_stable(engine, STABLE)  # what serving runs before the rollout
    return rollout.start_rollout(engine, CANDIDATE, section=section, now=T0, **kw)


# --- the controller -------------------------------------------------------------------------------


def test_a_good_candidate_advances_through_every_step_and_is_promoted(engine):
    r = start(engine)
    assert (r.state, r.step_index, r.stable_version) == ("running", 0, STABLE)
    assert pools.read(engine) == pools.Routes(stable=STABLE, canary=CANDIDATE, canary_percent=5.0)

    window = T0
    for i, weight in enumerate([5, 25, 50]):
        both_arms(engine, window, weight, total=4000 if weight > 5 else 6000, canary_accept=0.42)
        assert rollout.tick(engine, now=window + timedelta(seconds=30)) is None  # the step is not due yet
        now = window + timedelta(seconds=61)
        out = rollout.tick(engine, now=now)
        assert out.decision.action == "advance", out.decision.reason
        assert out.rollout.step_index == i + 1
        assert pools.read(engine).canary_percent == SECTION.weights[i + 1]
        window = now
    serve(engine, CANDIDATE, 1000, start=window, accept=0.42)  # at 100% only the candidate serves
    out = rollout.tick(engine, now=window + timedelta(seconds=61))
    assert out.decision.action == "promote", out.decision.reason

    with engine.connect() as conn:
        r = rollout.get(conn, r.id)
    assert r.state == "promoted" and r.finished_at is not None
    assert pools.read(engine) == pools.Routes(stable=CANDIDATE, canary=None, canary_percent=0.0)
    history = steps_of(engine, r.id)
    assert [(s.step_index, s.weight, s.decision) for s in history] == [
        (0, 5, "advance"),
        (1, 25, "advance"),
        (2, 50, "advance"),
        (3, 100, "promote"),
    ]
    first = history[0].evidence
    assert first["arms"]["canary"]["shown"] == 300 and first["arms"]["stable"]["shown"] == 5700
    assert first["tests"]["accept_rate"]["tested"] and first["rule"] == "no_harm" and first["by"] == "controller"
    last = history[-1].evidence
    assert last["arms"]["stable"]["shown"] > 0  # at 100%: stable's traffic since before the rollout


def test_a_degraded_candidate_is_rolled_back_with_its_evidence(engine):
    r = start(engine)
    both_arms(engine, T0, 5, total=6000, canary_accept=0.20, stable_accept=0.45)
    out = rollout.tick(engine, now=T0 + timedelta(seconds=61))
    assert out.decision.action == "rollback" and out.decision.rule == "accept_rate"
    assert out.rollout.state == "rolled_back" and "accept rate 20.0% vs 45.0%" in out.rollout.reason
    assert pools.read(engine) == pools.Routes(stable=STABLE, canary=None, canary_percent=0.0)
    (step,) = steps_of(engine, r.id)
    test = step.evidence["tests"]["accept_rate"]
    assert step.decision == "rollback" and step.evidence["rule"] == "accept_rate"
    assert test["n"] == [300, 5700] and test["p"] < 0.05 and test["worse"]
    assert step.evidence["policy"]["alpha"] == 0.05 and step.evidence["window"]["canary"][0].startswith(
        "2026-03-01T12:00"
    )
    assert rollout.tick(engine, now=T0 + timedelta(hours=1)) is None  # finished: nothing more to decide


def test_errors_and_latency_roll_back(sqlite_engine):
    start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=6000, errors=0.10)
    out = rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=61))
    assert out.decision.rule == "error_rate", out.decision.reason
    assert out.decision.evidence["arms"]["canary"]["errors"] == 30

    rollout.start_rollout(sqlite_engine, CANDIDATE, section=SECTION, force=True, now=T0 + timedelta(hours=1))
    both_arms(sqlite_engine, T0 + timedelta(hours=1), 5, total=6000, latency_ms=400.0)
    out = rollout.tick(sqlite_engine, now=T0 + timedelta(hours=1, seconds=61))
    assert out.decision.rule == "latency" and out.decision.evidence["tests"]["latency"]["ratio"] > 1.5


def test_an_under_sampled_step_holds_then_rolls_back_for_insufficient_traffic(sqlite_engine):
    r = start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=1000)  # 50 canary choices: half of min_samples
    out = rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=61))
    assert (out.decision.action, out.decision.rule) == ("hold", "min_samples")
    assert "canary 50" in out.decision.reason and out.rollout.state == "running" and out.rollout.step_index == 0
    assert rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=90)) is None  # next look: an interval after the hold
    assert rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=122)).decision.action == "hold"
    out = rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=183))
    assert (out.decision.action, out.decision.rule) == ("rollback", "insufficient_traffic")
    assert [s.decision for s in steps_of(sqlite_engine, r.id)] == ["hold", "hold", "rollback"]
    assert pools.read(sqlite_engine).canary is None


def test_holds_keep_the_window_open_so_samples_accumulate(sqlite_engine):
    start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=1000)
    assert rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=61)).decision.action == "hold"
    both_arms(sqlite_engine, T0 + timedelta(seconds=61), 5, total=2000)
    out = rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=122))
    assert out.decision.action == "advance" and out.decision.evidence["arms"]["canary"]["shown"] == 150


def test_a_restarted_controller_resumes_from_sql(tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}"
    first = db.make_engine(url)
    db.upgrade(first)
    _versions(first)
    r = start(first)
    both_arms(first, T0, 5, total=6000)
    advanced_at = T0 + timedelta(seconds=61)
    assert rollout.tick(first, now=advanced_at).decision.action == "advance"
    # traffic of the next step, then the process dies (nothing of it survives but the database)
    both_arms(first, advanced_at, 25, total=2000, canary_accept=0.10, stable_accept=0.40)
    first.dispose()

    second = db.make_engine(url)
    assert rollout.tick(second, now=advanced_at + timedelta(seconds=59)) is None  # the step's clock came from SQL
    out = rollout.tick(second, now=advanced_at + timedelta(seconds=61))
    assert out.step_index == 1 and out.weight == 25  # it resumed at step 1 ...
    assert out.decision.action == "rollback"  # ... judging only that step's window
    assert out.decision.evidence["arms"]["canary"]["shown"] == 500
    assert out.decision.evidence["window"]["canary"][0] == advanced_at.isoformat()
    assert [s.decision for s in steps_of(second, r.id)] == ["advance", "rollback"]
    second.dispose()


def test_pools_that_disagree_with_the_rollout_are_repaired(sqlite_engine):
    r = start(sqlite_engine)
    pools.clear_canary(sqlite_engine)  # as if the write after a decision had failed, or someone meddled
    assert rollout.tick(sqlite_engine, now=T0 + timedelta(seconds=1)) is None
    assert pools.read(sqlite_engine) == pools.Routes(stable=STABLE, canary=CANDIDATE, canary_percent=5.0)

    rollout.abort(sqlite_engine, r.id, by="test")
    pools.set_canary(sqlite_engine, CANDIDATE, 5.0, rollout_id=r.id)  # the abort's pool write "failed"
    rollout.tick(sqlite_engine)
    assert pools.read(sqlite_engine).canary is None
    pools.set_canary(sqlite_engine, 7, 10.0)  # later written by someone else (no rollout id): theirs
    rollout.tick(sqlite_engine)
    assert pools.read(sqlite_engine).canary == 7


# --- starting and operator commands -----------------------------------------------------------------


def test_start_refusals(sqlite_engine):
    with pytest.raises(RolloutError, match="unknown version 42") as e:
        rollout.start_rollout(sqlite_engine, 42, section=SECTION)
    assert e.value.status == 400
    with pytest.raises(
        RolloutError, match="failed the learner's evaluation gate .reward hacking suspected.; use --force"
    ):
        rollout.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, stable=STABLE)
    with pytest.raises(RolloutError, match="pass --stable"):
        rollout.start_rollout(
            sqlite_engine, STABLE, section=SECTION
        )  # nothing served, nothing older: no stable to compare with
    r = start(sqlite_engine)
    with pytest.raises(RolloutError, match=f"rollout {r.id} of version {CANDIDATE} is running") as e:
        rollout.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, force=True)
    assert e.value.status == 409
    rollout.abort(sqlite_engine, by="test")
    with pytest.raises(RolloutError, match="was rolled out before"):
        rollout.start_rollout(sqlite_engine, CANDIDATE, section=SECTION)
    with pytest.raises(RolloutError, match="already the stable version"):
        rollout.start_rollout(sqlite_engine, STABLE, section=SECTION)
    forced = rollout.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, force=True)
    assert forced.state == "running" and forced.stable_version == STABLE


def test_stable_version_without_serving_pools(sqlite_engine):
    serve(sqlite_engine, STABLE, 3, start=T0)  # what serving runs, as deployed (no serving_pools row)
    r = rollout.start_rollout(sqlite_engine, CANDIDATE, section=SECTION, now=T0)
    assert r.stable_version == STABLE


def test_pause_resume_promote_abort(sqlite_engine):
    r = start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=6000)
    paused = rollout.pause(sqlite_engine, by="cli:ana", reason="investigating a report")
    assert paused.state == "paused" and paused.reason == "investigating a report"
    assert rollout.tick(sqlite_engine, now=T0 + timedelta(hours=1)) is None  # paused: never advances
    assert pools.read(sqlite_engine).canary_percent == 5.0  # traffic stays where it was
    with pytest.raises(RolloutError, match="only a running rollout can pause"):
        rollout.pause(sqlite_engine, r.id, by="cli:ana")

    resumed_at = datetime.now(UTC)
    assert rollout.resume(sqlite_engine, by="cli:ana").state == "running"
    assert rollout.tick(sqlite_engine, now=resumed_at + timedelta(seconds=30)) is None  # an interval after the resume
    assert rollout.tick(sqlite_engine, now=resumed_at + timedelta(seconds=61)).decision.action == "advance"

    promoted = rollout.promote(sqlite_engine, r.id, by="api:ops-token:1234")
    assert promoted.state == "promoted" and pools.read(sqlite_engine) == pools.Routes(
        stable=CANDIDATE, canary=None, canary_percent=0.0
    )
    history = steps_of(sqlite_engine, r.id)
    assert [s.decision for s in history] == ["pause", "resume", "advance", "promote"]
    assert history[0].evidence["by"] == "cli:ana" and history[-1].evidence == {
        "by": "api:ops-token:1234",
        "rule": "operator",
        "reason": "promote by api:ops-token:1234",
        "from_state": "running",
    }
    with pytest.raises(RolloutError, match="no active rollout") as e:
        rollout.abort(sqlite_engine, by="cli:ana")
    assert e.value.status == 404

    second = rollout.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, force=True)
    assert second.stable_version == CANDIDATE  # the promoted one is stable now
    aborted = rollout.abort(sqlite_engine, second.id, by="cli:ana")
    assert aborted.state == "aborted" and pools.read(sqlite_engine) == pools.Routes(
        stable=CANDIDATE, canary=None, canary_percent=0.0
    )


def test_mode_all_swaps_everyone_at_once(sqlite_engine):
    r = start(sqlite_engine, section=SECTION.model_copy(update={"mode": "all"}))
    assert r.state == "promoted" and r.weights == [100.0]
    assert pools.read(sqlite_engine) == pools.Routes(stable=CANDIDATE, canary=None, canary_percent=0.0)
    assert [(s.decision, s.evidence["rule"]) for s in steps_of(sqlite_engine, r.id)] == [("promote", "mode_all")]


# --- auto mode ------------------------------------------------------------------------------------


def announcement(version, *, passed=True):
    return ModelVersion(
        version=version,
        kind="full",
        uri=f"file:///w/v{version}",
        sha256="0" * 64,
        gate_passed=passed,
        gate_reason=None if passed else "worse on replay",
    )


def test_auto_start_is_idempotent_and_waits_for_the_active_rollout(sqlite_engine):
    pools.set_stable(sqlite_engine, STABLE)
    outcome, r, _ = rollout.start_announced(sqlite_engine, announcement(10), SECTION)
    assert outcome == "started" and r.candidate_version == 10 and r.stable_version == STABLE
    assert rollout.start_announced(sqlite_engine, announcement(10), SECTION)[0] == "skipped"  # a replayed announcement
    assert rollout.start_announced(sqlite_engine, announcement(11), SECTION)[0] == "waiting"
    outcome, _, why = rollout.start_announced(sqlite_engine, announcement(12, passed=False), SECTION)
    assert outcome == "skipped" and "failed the gate" in why
    with sqlite_engine.connect() as conn:
        recorded = dict(
            conn.execute(
                select(db.model_versions.c.version, db.model_versions.c.gate_passed).where(
                    db.model_versions.c.version >= 10
                )
            ).all()
        )
        n_rollouts = conn.execute(select(func.count()).select_from(db.rollouts)).scalar()
    assert recorded == {10: True, 11: True, 12: False} and n_rollouts == 1
    rollout.promote(sqlite_engine, by="test")
    assert rollout.start_announced(sqlite_engine, announcement(11), SECTION)[0] == "started"
    assert rollout.start_announced(sqlite_engine, announcement(9), SECTION)[0] == "skipped"  # older than stable


@pytest.mark.slow
@pytest.mark.kafka
def test_auto_mode_consumes_flywheel_versions(kafka_settings, tmp_path):
    from feedback import bus
    from feedback.schemas import encode, key_of

    base = 10_000_000 + int(time.time()) % 1_000_000  # newer than anything other tests announce on the shared topic
    s = RolloutSettings(
        data_dir=str(tmp_path / "data"),
        kafka=kafka_settings.kafka.model_dump(),
        rollout={"auto": True, "group_id": f"rollout-test-{base}"},
    )
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    _versions(engine)
    pools.set_stable(engine, STABLE)
    import torch

    from learner import store as S

    store = S.open_store(S.default_store_uri(s))  # announced versions must be in this deployment's store
    for v in range(base, base + 3):
        store.publish(
            {"w": torch.full((4,), float(v - base), dtype=torch.bfloat16)},
            parent=v - 1 if v > base else None,
            version=v,
        )

    def announcement(version, *, passed=True):  # what the learner sends for a stored version
        return store.model_version(version, gate_passed=passed, gate_reason=None if passed else "worse on replay")

    producer = bus.producer(s.kafka)
    foreign = ModelVersion(version=base + 5, kind="full", uri="file:///elsewhere/v5", sha256="f" * 64, gate_passed=True)
    for msg in (foreign, announcement(base), announcement(base + 1, passed=False)):
        producer.send(bus.VERSIONS, key=key_of(msg), value=encode(msg))
    producer.flush()

    def drain(starter, until):
        deadline = time.monotonic() + scaled(60)
        lines = []
        while time.monotonic() < deadline and not until(lines):
            lines += starter.poll()
        return lines

    starter = rollout.AutoStarter(s, engine)
    lines = drain(
        starter,
        lambda ls: any("failed the gate" in ln for ln in ls) and any(f"version {base} against" in ln for ln in ls),
    )
    starter.close()
    with engine.connect() as conn:
        assert rollout.active(conn).candidate_version == base, lines
        assert conn.execute(select(db.model_versions).where(db.model_versions.c.version == base + 5)).first() is None
    assert any(f"version {base + 5} (file:///elsewhere/v5) is not in this weight store" in ln for ln in lines), lines

    producer.send(bus.VERSIONS, key=key_of(announcement(base + 2)), value=encode(announcement(base + 2)))
    producer.flush()
    restarted = rollout.AutoStarter(s, engine)  # resumes after the committed offsets: base is not replayed
    drain(restarted, lambda ls: restarted.pending is not None and restarted.pending.version == base + 2)
    assert (
        rollout.start_announced(engine, announcement(base + 2), s.rollout)[0] == "waiting"
    )  # base's rollout still runs
    rollout.abort(engine, by="test")
    lines = drain(restarted, lambda ls: any("against" in ln for ln in ls))
    restarted.close()
    producer.close()
    with engine.connect() as conn:
        versions = [
            row.candidate_version
            for row in conn.execute(select(db.rollouts.c.candidate_version).order_by(db.rollouts.c.id))
        ]
    assert versions == [base, base + 2], lines
    engine.dispose()


# --- the loop -----------------------------------------------------------------------------------


def test_run_controller_survives_a_database_that_is_not_there_yet(tmp_path, caplog):
    """Started before the database is migrated, the loop logs and retries, then drives the rollout."""
    s = RolloutSettings(data_dir=str(tmp_path / "data"), rollout={"poll_s": 0.05})
    engine = db.make_engine(s.database_url)
    stop = threading.Event()
    lines: list[str] = []
    t = threading.Thread(
        target=rollout.run_controller, args=(s, stop), kwargs={"engine": engine, "progress": lines.append}, daemon=True
    )
    t.start()
    try:
        time.sleep(0.3)
        assert t.is_alive() and "no such table" in caplog.text
        db.upgrade(engine)
        _versions(engine)
        pools.set_stable(engine, STABLE)
        now = datetime.now(UTC)
        r = rollout.start_rollout(
            engine, CANDIDATE, section=RolloutSection(weights=[100], interval_s=0.5, min_samples=50), now=now
        )
        serve(
            engine, STABLE, 200, start=now - timedelta(seconds=0.4), span_s=0.3
        )  # before the rollout: the control arm
        serve(engine, CANDIDATE, 200, start=now, span_s=0.3)
        deadline = time.monotonic() + scaled(15)
        while time.monotonic() < deadline and not any("promote" in ln for ln in lines):
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert any("recovered" in ln for ln in lines) and any(
        f"rollout {r.id}" in ln and "promote" in ln for ln in lines
    ), lines
    assert pools.read(engine).stable == CANDIDATE
    engine.dispose()


# --- HTTP -----------------------------------------------------------------------------------------


@pytest.fixture
def api(sqlite_engine):
    from serving.api import ApiState, build_app
    from serving.settings import ServeSettings

    class Sink:
        def send(self, topic, msg):
            return True

    state = dict(
        cfg=ServeSettings(),
        replicas={},
        producer=Sink(),
        editor_tokens={"ed"},
        decode=lambda ids, **kw: "",
        ops_tokens={"ops"},
        database_url=sqlite_engine.url.render_as_string(hide_password=False),
    )
    app = build_app()
    app.state.api = ApiState(**state)
    pools.set_stable(sqlite_engine, STABLE)
    return TestClient(app), app.state.api


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
    assert ro["reason"] == "started by " + "api:ops-token:" + hashlib.sha256(b"ops").hexdigest()[:8]
    assert client.post("/ops/rollouts", headers=ops, json={"version": GATE_FAILED}).status_code == 409
    assert client.post("/ops/rollouts", headers=ops, json={"version": 99}).status_code == 400
    assert (
        client.post("/ops/rollouts", headers=ops, json={"version": CANDIDATE, "weights": [50, 10]}).status_code == 422
    )

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
    client, st = api
    st.database_url = None
    r = client.get("/ops/rollouts", headers={"Authorization": "Bearer ops"})
    assert r.status_code == 503 and "database" in r.json()["error"]["message"]


# --- CLI and config -------------------------------------------------------------------------------


def test_cli(tmp_path):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'data' / 'flywheel.db'}")
    db.upgrade(engine)
    _versions(engine)
    pools.set_stable(engine, STABLE)
    engine.dispose()

    r = flywheel("rollout", "start", "42", tmp_path=tmp_path)
    assert (
        r.returncode == 1
        and r.stderr.strip().startswith("flywheel: error: unknown version 42")
        and len(r.stderr.strip().splitlines()) == 1
    )
    r = flywheel(
        "rollout",
        "start",
        str(CANDIDATE),
        "--weights",
        "10,50,100",
        "--interval",
        "2m",
        "--threshold",
        "reward_drop=0.1",
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "canary at 10%" in r.stdout and "120s each" in r.stdout
    r = flywheel("rollout", "start", str(GATE_FAILED), tmp_path=tmp_path)
    assert r.returncode == 1 and "failed the learner's evaluation gate" in r.stderr
    r = flywheel("rollout", "start", str(GATE_FAILED), "--force", tmp_path=tmp_path)
    assert r.returncode == 1 and "is running" in r.stderr
    assert flywheel("rollout", "pause", tmp_path=tmp_path).returncode == 0
    r = flywheel("rollout", "status", "--json", tmp_path=tmp_path)
    st = json.loads(r.stdout)
    assert (
        st["rollout"]["state"] == "paused"
        and st["rollout"]["interval_s"] == 120
        and st["rollout"]["thresholds"]["reward_drop"] == 0.1
    )
    assert st["steps"][0]["evidence"]["by"].startswith("cli")
    r = flywheel("rollout", "abort", "--reason", "not today", tmp_path=tmp_path)
    assert r.returncode == 0 and "aborted" in r.stdout
    r = flywheel("rollout", "start", "2", "--interval", "soon", tmp_path=tmp_path)
    assert r.returncode == 1 and "bad duration" in r.stderr


def test_example_config_documents_every_rollout_setting():
    example = REPO / "flywheel.example.toml"
    s = RolloutSettings.load(example)
    text = example.read_text()
    for section, model in (("rollout", s.rollout), ("rollout.thresholds", s.rollout.thresholds)):
        for name in type(model).model_fields:
            assert f"\n{name} =" in text or f"\n# {name} =" in text or f"[{section}.{name}]" in text, (
                f"{section}.{name} missing from the example config"
            )
    assert s.rollout == RolloutSection()  # the example shows the defaults


def test_settings_refuse_bad_weights():
    from feedback.core.errors import UserError

    with pytest.raises(UserError, match="increasing percentages"):
        RolloutSettings.load(None, ["rollout.weights=[50, 25]"])
    from feedback.core.config import parse_duration

    assert parse_duration("1.5h") == 5400 and parse_duration("90") == 90 and parse_duration("1h30m") == 5400
    assert RolloutSettings.load(None, ['rollout.interval_s="2m"']).rollout.interval_s == 120
    for bad in ("", "3x", "-5s", "0"):
        with pytest.raises(ValueError):
            parse_duration(bad)
