"""Replica pools: the targets in SQL, the ingress routing on them, replicas reconciling to them,
and `flywheel swap`. Real SQLite, real store and HotSwapper; in-process services stand in for
the Ray pools."""

import asyncio
import shutil

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import select

from feedback import db, pools
from feedback.pools import CANARY, STABLE, Routes
from learner import store as S
from learner.formats import own_format
from serving.app import PoolReconciler, pool_sizes
from serving.hotswap import HotSwapper
from serving.http.app import build_app
from serving.http.deps import ApiState
from serving.http.routing import RoutingState, refresh_routing
from serving.replica import CompletionService
from serving.routing import bucket, user_hash
from serving.settings import ServeSettings
from tests.helpers import flywheel, scaled
from tests.ops.cli.test_main import assert_one_line_error
from tests.serving.conftest import TOKEN, FakeEngine, ListSink, LocalPool
from tests.serving.test_hotswap import (  # noqa: F401  (published: a fixture)
    WeightsEngine,
    bits_equal,
    make_service,
    published,
    sync,
)


@pytest.fixture
def engine(tmp_path):
    e = db.make_engine(f"sqlite:///{tmp_path / 'pools.db'}")
    db.upgrade(e)
    return e


def swap_rows(engine) -> list:
    with engine.connect() as conn:
        return list(conn.execute(select(db.swap_events).order_by(db.swap_events.c.id)))


# --- the targets in SQL --------------------------------------------------------------------------


def test_targets_round_trip(engine):
    assert pools.read(engine) == Routes()  # no rows: every pool serves what it was deployed with
    pools.set_canary(engine, 5, 10.0, rollout_id=7)
    assert pools.read(engine) == Routes(stable=None, canary=5, canary_percent=10.0)
    pools.set_canary(engine, 5, 25.0)
    assert pools.read(engine).canary_percent == 25.0
    pools.set_stable(engine, 5)
    r = pools.read(engine)
    assert r == Routes(stable=5, canary=None, canary_percent=0.0) and r.target(STABLE) == 5 and r.target(CANARY) is None
    pools.set_canary(engine, 6, 50.0)
    pools.clear_canary(engine)
    assert pools.read(engine) == Routes(stable=5, canary=None, canary_percent=0.0)
    with pytest.raises(ValueError, match="within"):
        pools.set_canary(engine, 6, 101.0)


def test_versions_in_use(engine):
    from datetime import UTC, datetime, timedelta

    from ops.rollout.stats import Policy

    with engine.connect() as conn:
        assert pools.versions_in_use(conn, now=datetime.now(UTC)) == set()
    pools.set_canary(engine, 9, 5.0)
    pools.record_swap(engine, pool=STABLE, replica="a", report={"ok": True, "from_version": 1, "target": 2})
    pools.record_swap(engine, pool=STABLE, replica="a", report={"ok": False, "from_version": 2, "target": 7})
    pools.record_swap(engine, pool=CANARY, replica="b", report={"ok": True, "from_version": 3, "target": 4})
    with engine.begin() as conn:
        conn.execute(
            db.rollouts.insert().values(
                candidate_version=12,
                stable_version=11,
                state=db.RUNNING,
                step_index=0,
                weights=[5, 100],
                interval_s=60,
                thresholds=Policy().thresholds(),
                min_samples=10,
            )
        )
        conn.execute(db.swap_events.update().where(db.swap_events.c.replica == "b").values(at=datetime(2020, 1, 1)))
    with engine.connect() as conn:
        # the canary's target 9; replica a still serves 2 (its swap to 7 failed); b's report is years
        # old; the running rollout's candidate 12 and stable 11
        assert pools.versions_in_use(conn, now=datetime.now(UTC)) == {9, 2, 12, 11}
        assert 4 in pools.versions_in_use(conn, now=datetime.now(UTC), served_within=timedelta(days=365 * 10))


def test_record_swap(engine):
    ok = {
        "ok": True,
        "version": 2,
        "from_version": 1,
        "target": 2,
        "plan": {"nbytes": 1234},
        "tensors_reloaded": 9,
        "pause_s": 0.05,
        "prepare_s": 0.5,
        "stage_s": 0.02,
        "drain_s": 0.01,
        "reload_s": 0.04,
        "restarted": 3,
        "error": None,
    }
    bad = {
        "ok": False,
        "version": 2,
        "from_version": 2,
        "target": 9,
        "plan": {},
        "error": "swap v2 -> v9 failed: StoreError: not in the store",
    }
    pools.record_swap(engine, pool=STABLE, replica="r1", report=ok)
    pools.record_swap(engine, pool=CANARY, replica="r2", report=bad)
    a, b = swap_rows(engine)
    assert (a.stage_s, a.drain_s, a.reload_s, a.restarted) == (0.02, 0.01, 0.04, 3)
    assert (b.stage_s, b.drain_s, b.reload_s, b.restarted) == (None, None, None, None)  # failed before them
    assert (a.pool, a.replica, a.from_version, a.to_version, a.ok, a.fetched_bytes, a.tensors_reloaded) == (
        STABLE,
        "r1",
        1,
        2,
        True,
        1234,
        9,
    )
    assert (b.pool, b.to_version, b.ok, b.pause_s, b.fetched_bytes) == (
        CANARY,
        9,
        False,
        0.0,
        0,
    ) and "not in the store" in b.error


def test_pool_sizes():
    assert pool_sizes(ServeSettings(replicas=2)) == {STABLE: 2, CANARY: 1}
    assert pool_sizes(ServeSettings(canary_replicas=0)) == {STABLE: 1}


# --- the ingress routes on them ------------------------------------------------------------------


def two_pools(tok, engine, canary_reports=None):
    """An app with a stable pool on v3 and a canary pool on v4, its state, and its record sink."""
    # Forty users behind one token, as fast as the fake engine answers: no per-token rate limit.
    cfg = ServeSettings(auth_tokens=[TOKEN], limits={"completions": ""})
    stable = CompletionService(FakeEngine(tok), tok, own_format(tok, 2048), cfg, version=3)
    canary = CompletionService(FakeEngine(tok, text="return y"), tok, own_format(tok, 2048), cfg, version=4)
    sink = ListSink()
    st = ApiState(
        cfg=cfg,
        replicas={STABLE: LocalPool(stable), CANARY: LocalPool(canary, reports=canary_reports)},
        producer=sink,
        editor_tokens=cfg.editor_tokens(),
        decode=tok.decode,
    )
    app = build_app()
    app.state.api = st
    client = TestClient(app, raise_server_exceptions=False)
    client.headers["Authorization"] = f"Bearer {TOKEN}"
    return client, st, sink


def refresh(st, engine):
    asyncio.run(refresh_routing(st, lambda: pools.read(engine)))


USERS = [f"user{i}" for i in range(40)]


def served_by(client, users=USERS, **extra) -> dict[str, str]:
    out = {}
    for u in users:
        r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4, "user": u, **extra})
        assert r.status_code == 200, r.text
        out[u] = r.json()["model"]
    return out


def test_the_canary_gets_its_share_only_once_it_serves_the_target(tok, engine):
    client, st, sink = two_pools(tok, engine)
    refresh(st, engine)
    assert set(served_by(client).values()) == {"flywheel@v3"}  # no targets: everyone on stable

    pools.set_canary(engine, 5, 50.0)  # the canary pool still serves v4: not yet
    refresh(st, engine)
    assert not st.routing.canary_live and set(served_by(client).values()) == {"flywheel@v3"}
    health = client.get("/v1/health").json()["flywheel"]
    assert health["pools"] == {STABLE: {"serving": 3, "target": None}, CANARY: {"serving": 4, "target": 5}}
    assert health["canary_percent"] == 50.0 and not health["canary_live"]

    pools.set_canary(engine, 4, 50.0)  # now it does: the users below the share go there, sticky
    refresh(st, engine)
    got = served_by(client)
    key = st.cfg.user_hash_key()
    want = {u: "flywheel@v4" if bucket(user_hash(key, token=TOKEN, user=u)) < 50 else "flywheel@v3" for u in USERS}
    assert got == want and set(got.values()) == {"flywheel@v3", "flywheel@v4"}
    assert served_by(client) == want  # the same users again: the same pools
    assert client.get("/v1/health").json()["flywheel"]["canary_live"]

    pools.set_canary(engine, 4, 0.0)  # a share of 0 sends no one
    refresh(st, engine)
    assert set(served_by(client).values()) == {"flywheel@v3"}
    pools.set_canary(engine, 4, 100.0)
    refresh(st, engine)
    assert set(served_by(client).values()) == {"flywheel@v4"}
    pools.clear_canary(engine)  # a rollback: everyone back on stable at once
    refresh(st, engine)
    assert set(served_by(client).values()) == {"flywheel@v3"}
    records = [m for _, m in sink.sent]
    assert {r.model_version for r in records} == {3, 4}


def test_pinned_versions_go_to_the_pool_serving_them(tok, engine):
    client, st, sink = two_pools(tok, engine)
    refresh(st, engine)
    assert set(served_by(client, USERS[:5], model="flywheel@v4").values()) == {
        "flywheel@v4"
    }  # even with no canary share
    assert set(served_by(client, USERS[:5], model="flywheel@v3").values()) == {"flywheel@v3"}
    served_by(client, USERS[:2], model="flywheel")
    # the records say which requests chose their version: rollout arms and the learner skip those
    assert [m.pinned for _, m in sink.sent] == [True] * 10 + [False] * 2
    r = client.post("/v1/completions", json={"prompt": "x", "model": "flywheel@v7"})
    assert r.status_code == 404 and "[3, 4]" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "x", "model": "flywheel@vX"}).status_code == 400
    models = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert models == ["flywheel", "flywheel@v3", "flywheel@v4"]


def test_records_carry_the_version_that_produced_them(tok, engine):
    """A pool mid-swap may report the target while its replica still serves the old version:
    the response and the record say what really answered."""
    client, st, sink = two_pools(tok, engine, canary_reports=5)
    pools.set_canary(engine, 5, 100.0)
    refresh(st, engine)
    assert st.routing.canary_live
    assert set(served_by(client, USERS[:3]).values()) == {"flywheel@v4"}
    assert {m.model_version for _, m in sink.sent} == {4}


def test_routing_survives_a_database_outage_and_a_silent_pool(tok, engine, tmp_path):
    client, st, _ = two_pools(tok, engine)
    pools.set_canary(engine, 4, 100.0)
    refresh(st, engine)
    assert st.routing.canary_live

    def down():
        raise ConnectionError("database is down")

    asyncio.run(refresh_routing(st, down))  # the last routes stay: nobody moves on a blip
    assert st.routing.canary_live and "database is down" in st.routing.error
    public = client.get("/v1/health").json()["flywheel"]["routing_error"]
    assert public and "database is down" not in public  # said, without the driver's detail
    assert set(served_by(client, USERS[:3]).values()) == {"flywheel@v4"}

    async def silent():
        raise TimeoutError

    st.replicas[CANARY].served_version = silent  # the canary stops answering: its users go back to stable
    refresh(st, engine)
    assert st.routing.error is None and st.routing.serving[CANARY] is None and not st.routing.canary_live
    assert set(served_by(client, USERS[:3]).values()) == {"flywheel@v3"}


def test_without_a_canary_pool_everyone_is_on_stable(tok, engine):
    client, st, _ = two_pools(tok, engine)
    del st.replicas[CANARY]
    st.routing = RoutingState()
    pools.set_canary(engine, 4, 100.0)
    refresh(st, engine)
    assert st.routing.serving == {STABLE: 3} and set(served_by(client, USERS[:3]).values()) == {"flywheel@v3"}
    assert list(client.get("/v1/health").json()["flywheel"]["pools"]) == [STABLE]


# --- replicas reconcile to them ------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@sync
async def test_a_replica_swaps_to_its_pools_target_and_backs_off_a_failing_one(tok, published, engine):  # noqa: F811
    root, ckpts = published
    service = make_service(tok, WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0))
    clock = Clock()
    rec = PoolReconciler(
        engine, pool=STABLE, replica="r1", swapper=HotSwapper(service, S.open_store(root)), clock=clock
    )

    assert await rec.step() is None and service.version == 0  # no target: as deployed
    pools.set_stable(engine, 1)
    report = await rec.step()
    assert report["ok"] and service.version == 1 and (await service.complete(req())).model_version == 1
    assert await rec.step() is None  # there already

    pools.set_stable(engine, 9)  # not in the store
    report = await rec.step()
    assert not report["ok"] and service.version == 1
    st = rec.status()
    assert st["failed_target"] == 9 and st["consecutive_failures"] == 1 and st["retry_in_s"] == 30
    assert await rec.step() is None  # not retried in a tight loop
    clock.t += 29
    assert await rec.step() is None
    clock.t += 2
    assert not (await rec.step())["ok"]  # retried after 30 s, then after 60 s
    assert rec.status()["consecutive_failures"] == 2 and rec.status()["retry_in_s"] == 60
    clock.t += 59
    assert await rec.step() is None

    pools.set_stable(engine, 2)  # a new target is tried at once
    assert (await rec.step())["ok"] and service.version == 2
    assert rec.status()["failed_target"] is None and rec.status()["retry_in_s"] is None

    rows = swap_rows(engine)
    assert [(r.pool, r.replica, r.from_version, r.to_version, r.ok) for r in rows] == [
        (STABLE, "r1", 0, 1, True),
        (STABLE, "r1", 1, 9, False),
        (STABLE, "r1", 1, 9, False),
        (STABLE, "r1", 1, 2, True),
    ]
    assert (
        "not in the store" in rows[1].error and rows[0].tensors_reloaded == len(ckpts[1]) and rows[3].fetched_bytes > 0
    )


@sync
async def test_each_pool_follows_its_own_target(tok, published, engine):  # noqa: F811
    root, ckpts = published
    services, loops = {}, []
    for pool in (STABLE, CANARY):
        services[pool] = make_service(tok, WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0))
        rec = PoolReconciler(
            engine, pool=pool, replica=f"{pool}-0", swapper=HotSwapper(services[pool], S.open_store(root))
        )
        loops.append(asyncio.create_task(rec.run(0.01)))

    async def until(cond, timeout_s=20.0):
        for _ in range(int(scaled(timeout_s) / 0.01)):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    try:
        pools.set_canary(engine, 2, 10.0)
        await until(lambda: services[CANARY].version == 2)
        pools.clear_canary(engine)  # a rollback leaves the canary where it is; it serves no one
        pools.set_stable(engine, 3)
        await until(lambda: services[STABLE].version == 3)
        await asyncio.sleep(0.05)
        assert services[CANARY].version == 2 and all(not t.done() for t in loops)
    finally:
        for t in loops:
            t.cancel()
    assert {(r.pool, r.to_version, r.ok) for r in swap_rows(engine)} == {(CANARY, 2, True), (STABLE, 3, True)}


@sync
async def test_a_replica_restarted_after_stable_fell_far_behind_still_reaches_its_target(tok, engine, tmp_path):
    """Stable stays on v3 while the learner publishes 56 more versions, cleaning up after each as
    it does (keep 32): v3, and the snapshot and deltas it is built from, stay; so do a canary's
    target and a version a replica still serves. A replica restarted on v0 swaps to v3."""
    from learner.publish import cleanup

    def ckpt(v: int) -> dict:
        g = torch.Generator().manual_seed(v)
        return {"w.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.full((4,), float(v))}

    store = S.open_store(tmp_path / "w", full_every=8)
    store.publish(ckpt(0), parent=None)
    for v in range(1, 60):
        store.publish(ckpt(v), parent=v - 1)
        if v == 3:
            pools.set_stable(engine, 3)
        if v == 6:  # a replica swapped to v6 (its pool's target moved on since)
            report = {"ok": True, "from_version": 5, "target": 6}
            pools.record_swap(engine, pool=CANARY, replica="r-old", report=report)
        if v == 20:
            pools.set_canary(engine, 20, 5.0)
        cleanup(store, engine, keep=32, also=(v,))
    kept = set(store.versions())
    # full snapshots at 0, 8, 16, ...: v3 and v6 need 0..6, v20 16..20, the newest 32 (28..59) 24..59
    assert kept == set(range(0, 7)) | set(range(16, 21)) | set(range(24, 60))
    assert store.plan(3) == S.Plan(3, None, 0, (1, 2, 3), store.plan(3).nbytes)

    service = make_service(tok, WeightsEngine(S.to_hf_tensors(ckpt(0)), version=0))  # restarted from its folder
    rec = PoolReconciler(engine, pool=STABLE, replica="r1", swapper=HotSwapper(service, S.open_store(tmp_path / "w")))
    report = await rec.step()
    assert report["ok"], report["error"]
    assert service.version == 3 and bits_equal(service.engine.inner.weights, S.to_hf_tensors(ckpt(3)))

    class Down:
        def connect(self):
            raise OSError("database is down")

    assert cleanup(store, Down(), keep=1) == [] and set(store.versions()) == kept  # unsure: delete nothing


@sync
async def test_database_errors_never_stop_the_replica(tok, published, tmp_path):  # noqa: F811
    root, ckpts = published
    bare = db.make_engine(f"sqlite:///{tmp_path / 'not-migrated.db'}")
    service = make_service(tok, WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0))
    rec = PoolReconciler(bare, pool=STABLE, replica="r1", swapper=HotSwapper(service, S.open_store(root)))
    assert await rec.step() is None and "serving_pools" in rec.status()["db_error"]
    loop = asyncio.create_task(rec.run(0.01))
    await asyncio.sleep(0.1)
    assert not loop.done() and service.version == 0
    db.upgrade(bare)  # the database comes back: the loop carries on
    pools.set_stable(bare, 1)
    for _ in range(2000):  # the swap, then its swap_events row, then the step's end clears the error
        if service.version == 1 and swap_rows(bare) and rec.status()["db_error"] is None:
            break
        await asyncio.sleep(0.01)
    loop.cancel()
    assert service.version == 1 and rec.status()["db_error"] is None and len(swap_rows(bare)) == 1


def req():
    from tests.serving.test_hotswap import request

    return request(0)


# --- flywheel swap -------------------------------------------------------------------------------


def test_swap_to_an_unknown_version_is_one_line(tmp_path):
    r = flywheel("swap", "7", tmp_path=tmp_path)
    assert_one_line_error(r, "version 7 is not in the weight store")
    assert_one_line_error(flywheel("swap", tmp_path=tmp_path), "VERSION")


def test_swap_all_sets_the_stable_target(tmp_path, published):  # noqa: F811
    root, _ = published
    shutil.copytree(root, tmp_path / "data" / "weights")
    e = db.make_engine(f"sqlite:///{tmp_path / 'data' / 'flywheel.db'}")
    db.upgrade(e)
    pools.set_canary(e, 3, 20.0)
    r = flywheel("swap", "2", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "stable pool -> v2" in r.stdout and "canary on v3" in r.stdout
    assert pools.read(e) == Routes(stable=2, canary=None, canary_percent=0.0)
    pools.record_swap(
        e, pool=STABLE, replica="r1", report={"ok": True, "from_version": 0, "target": 2, "plan": {"nbytes": 10}}
    )
    timed = {"ok": True, "from_version": 2, "target": 3, "plan": {}, "drain_s": 0.021, "reload_s": 0.055}
    pools.record_swap(e, pool=STABLE, replica="r1", report=timed)
    r = flywheel("swap", "--status", tmp_path=tmp_path, env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "serving_pools" in r.stdout and "v0 -> v2" in r.stdout
    assert "21 + 55" in r.stdout  # where v2 -> v3's pause went; v0 -> v2 has no such figures
