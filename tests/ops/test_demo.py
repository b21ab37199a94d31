"""The demo's summary evaluates with `flywheel eval`'s evaluation: the base and the version stable
serves, side by side (a learner on a tiny base and SQLite; no broker, no vLLM)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from rich.console import Console

from feedback import pools
from learner import eval as E
from learner.train.eval_settings import EvalSection
from learner.train.learn import Learner, model_from_packed
from learner.train.pretrain import ensure_base_model
from ops import demo
from tests.learner.train.learn_support import (
    ListProducer,
    make_corpus,
    record_served,
    rerouted_samples,
    tiny_learn_settings,
)


def test_summary_evaluates_the_base_and_the_stable_version(tmp_path):
    s = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    ensure_base_model(s, Console(file=io.StringIO()))
    learner = Learner(s, producer=ListProducer())
    learner.start()  # publishes the base as v0
    packed = learner.store.materialize(0)
    packed["lm_head.weight"] = -packed["lm_head.weight"]  # a v1 that differs
    learner.store.publish(packed, 0, version=1)
    pools.set_stable(learner.engine, 1)
    cfg = EvalSection(sites=5, max_tokens=6)

    out = io.StringIO()
    got = demo.evaluate_versions(learner, learner.engine, cfg, Console(file=out, width=200))
    assert list(got) == ["v0 (base)", "v1 (stable)"]
    replays = []
    for v, name in ((0, "v0 (base)"), (1, "v1 (stable)")):
        model = model_from_packed(learner.store.materialize(v), learner.args)
        here = E.evaluate(model, learner.tok, learner.format, learner.heldout, sites=5, seed=cfg.seed, max_tokens=6)
        assert (got[name]["n"], got[name]["shown"], got[name]["accepted"]) == (5, here.shown, here.accepted)
        assert got[name]["outcomes"] == here.outcomes and "accept_rate" in got[name]["intervals"]
        replays.append(here.results)
    # stable against the base, paired on the same sites
    assert got["v1 (stable)"]["vs_base"] == E.paired_accept_ratio(*replays).as_dict()
    assert "vs_base" not in got["v0 (base)"]
    assert "held-out evaluation: 5 sites" in out.getvalue() and "v1 (stable)" in out.getvalue()
    learner.close()


def test_the_summary_measures_each_served_versions_mismatch_on_what_it_served(tmp_path):
    from learner.train.mismatch import served_mismatch, served_samples

    s = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    ensure_base_model(s, Console(file=io.StringIO()))
    learner = Learner(s, producer=ListProducer())
    learner.start()
    packed = learner.store.materialize(0)
    packed["lm_head.weight"] = -packed["lm_head.weight"]
    learner.store.publish(packed, 0, version=1)
    models = {v: model_from_packed(learner.store.materialize(v), learner.args) for v in (0, 1)}
    # v0's engine took other experts at a quarter of the pairs; v1's routed as the forward does
    for v, every in ((0, 4), (1, 0)):
        record_served(learner.engine, rerouted_samples(models[v], 5, reroute_every=every, version=v, seed=v))
    # what a database shared with another deployment holds: a version this store never published,
    # and a record of another model (a token beyond this vocabulary) under v0
    record_served(learner.engine, rerouted_samples(models[0], 1, reroute_every=4, version=7, seed=7))
    alien = rerouted_samples(models[0], 1, reroute_every=4, version=0, seed=8)[0]
    record_served(learner.engine, [replace(alien, token_ids=[learner.args.vocab_size] + alien.token_ids[1:])])

    out = io.StringIO()
    rows = demo.served_mismatch_report(learner, learner.engine, Console(file=out, width=200), 4)
    assert [(r["version"], r["completions"]) for r in rows] == [(0, 4), (1, 4)]
    for r in rows:
        want = served_mismatch(
            models[r["version"]],
            learner.args,
            learner.format,
            served_samples(learner.engine, r["version"], 4, learner.args.vocab_size),
            version=r["version"],
        )
        assert r == want.as_dict()
    assert rows[0]["ratio"] < 0.01 < rows[0]["rerouted"] and rows[1]["rerouted"] == 0.0 and rows[1]["ratio"] is None
    assert "replay / own is - where no route differs" in out.getvalue()
    assert "on what each version served (newest 4" in out.getvalue()
    lo, hi = rows[0]["ratio_interval"]
    assert f"{rows[0]['ratio']:.2f}x [{lo:.2f}, {hi:.2f}]" in out.getvalue() and rows[1]["ratio_interval"] is None
    learner.close()


def test_the_summary_says_when_learned_versions_never_got_a_rollout(tmp_path):
    from feedback import db
    from ops.rollout import commands
    from tests.ops.rollout.traffic import CANDIDATE, SECTION, record_versions

    engine = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(engine)
    record_versions(engine)  # v1, v2 passed the gate, v3 did not
    out = io.StringIO()
    demo.summarize(engine, Console(file=out, width=200))
    assert "no rollout started, though v1-v2 passed the gate" in out.getvalue()

    pools.set_stable(engine, 1)
    commands.start_rollout(engine, CANDIDATE, section=SECTION, by="test")
    out = io.StringIO()
    demo.summarize(engine, Console(file=out, width=200))
    assert "no rollout started" not in out.getvalue() and "rollout #1: v2 -> running" in out.getvalue()
    engine.dispose()


def test_the_published_table_shows_each_versions_mismatch_with_and_without_serving_routes(tmp_path):
    from sqlalchemy import update

    from feedback import db
    from tests.ops.rollout.traffic import record_versions

    engine = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(engine)
    record_versions(engine)
    with engine.begin() as conn:  # what the learner records for a version's updates (learner.train.learn)
        conn.execute(
            update(db.model_versions)
            .where(db.model_versions.c.version == 1)
            .values(metrics={"mismatch_kl_replay": 1e-4, "mismatch_kl_no_replay": 4e-4, "recorded_routing": 0.9})
        )
        v3 = {"mismatch_kl_replay": 2e-4, "mismatch_kl_no_replay": 5e-4, "recorded_routing": 1.0, "mismatch_updates": 3}
        conn.execute(update(db.model_versions).where(db.model_versions.c.version == 3).values(metrics=v3))
    out = io.StringIO()
    summary = demo.summarize(engine, Console(file=out, width=240))
    assert "1.0e-04 / 4.0e-04 = 0.25x (90% serving routes)" in out.getvalue()
    assert "2.0e-04 / 5.0e-04 = 0.40x (100% serving routes, 3 updates)" in out.getvalue()
    first = summary["published"][0]
    assert (first["mismatch_kl_replay"], first["recorded_routing"]) == (1e-4, 0.9)
    assert summary["published"][1]["mismatch_kl_replay"] is None  # a version without updates says nothing
    # pooled over the versions that say how many updates they cover (v1's row predates the count)
    assert summary["mismatch_pooled"] == {"mismatch_kl_replay": 2e-4, "mismatch_kl_no_replay": 5e-4, "updates": 3}
    assert (
        "mismatch KL over all 3 updates: serving's routes replayed 2.0e-04, own routing 5.0e-04 = 0.40x"
        in out.getvalue()
    )
    engine.dispose()


def test_pooled_mismatch_weights_each_version_by_its_updates():
    a = {"mismatch_kl_replay": 7e-5, "mismatch_kl_no_replay": 7e-5, "mismatch_updates": 3}  # no rare route in 3 updates
    b = {"mismatch_kl_replay": 6e-5, "mismatch_kl_no_replay": 3e-4, "mismatch_updates": 9}
    replay, own, n = demo.pooled_mismatch([a, b, {}, {"mismatch_kl_replay": 1.0, "mismatch_kl_no_replay": 1.0}])
    assert n == 12
    assert replay == pytest.approx((3 * 7e-5 + 9 * 6e-5) / 12) and own == pytest.approx((3 * 7e-5 + 9 * 3e-4) / 12)
    assert demo.pooled_mismatch([{}, {"mismatch_kl_replay": 1.0, "mismatch_kl_no_replay": 1.0}]) is None


def test_the_machine_report_shows_where_the_slowest_completions_spent_their_time():
    from ops.simulate import SimStats

    stats = SimStats(requests=20, latency_ms={"v0": [100.0] * 19 + [900.0]})
    fast = {"parse": 1.0, "hop": 2.0, "engine": 80.0, "total": 90.0}
    slow = {"parse": 1.0, "hop": 700.0, "engine": 100.0, "total": 810.0}
    stats.stages = [(100.0, fast)] * 19 + [(900.0, slow)]
    out = io.StringIO()
    demo.print_machine_report(Console(file=out, width=200), stats, "bfloat16", "bfloat16", timeout_s=30)
    text = out.getvalue()
    assert "where completion time went" in text
    hop = next(line for line in text.splitlines() if line.strip("│┃ ").startswith("hop"))
    assert "700" in hop  # the slowest one waited in Ray Serve, not in the engine


def test_a_background_thread_yields_the_cpu_and_the_caller_keeps_its_priority():
    import os
    import threading

    seen = {}

    def work():
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = demo._background("learner", Console(file=io.StringIO()), [], work, nice=min(19, before + 5))
    t.start()
    t.join()
    assert seen["nice"] == min(19, before + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # only that thread
