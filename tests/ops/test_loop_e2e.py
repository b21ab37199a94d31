"""The whole loop on one machine, as `make demo` runs it, with a tiny model and short cadences:
simulated editors over HTTP -> Kafka -> sink -> SQL -> learner -> weight store (delta) ->
flywheel.versions -> auto canary -> in-place hot swaps -> completions tagged with the new
version, whose logprobs are the learner's model at that version."""

from __future__ import annotations

import io
import json
import uuid
from collections import defaultdict
from datetime import UTC, datetime

import pytest
import torch
from rich.console import Console
from sqlalchemy import text

from feedback import db
from learner import store as S
from learner.train.learn import model_from_packed
from learner.train.pretrain import find_base_model, load_master_weights
from ops import demo
from serving.app import engine_precision
from tests.helpers import free_port, scaled, served_logprob_tolerance
from tests.learner.train.learn_support import make_corpus, tiny_pretrain

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def test_demo_closes_the_loop(tmp_path, kafka_settings):
    corpus = make_corpus(tmp_path / "corpus")
    s = demo.DemoSettings(
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "cache",
        kafka={"bootstrap_servers": kafka_settings.kafka.bootstrap},
        pretrain=tiny_pretrain(corpus, seq_len=128),
        model={
            "min_confidence": 0.0
        },  # a tiny test model is unsure of nearly every token: show all (the gate has tests of its own)
        serve={"port": free_port(), "ray_num_cpus": 2},
        sink={"feedback_window_s": 3.0, "grace_period_s": 30.0},
        # The editors' timeout scales with the machine: on a loaded one a completion queues behind the
        # learner and the gate, which is slowness, not a failure of the swaps this test is about.
        simulate={"users": 4, "rate": 2.0, "max_tokens": 8, "edit_delay_s": 0.5, "timeout_s": scaled(60.0)},
        learn={
            "publish_every": 15.0,
            "min_samples": 16,
            "batch_size": 8,
            "poll_s": 0.5,
            "gate": {"sites": 8, "min_sites": 8, "max_tokens": 8, "max_kl": 5.0, "reward_tolerance": 1.0},
        },
        rollout={
            "auto": True,
            "group_id": f"loop-test-{uuid.uuid4().hex[:8]}",
            "weights": [50.0, 100.0],
            "interval_s": 8.0,
            "min_samples": 4,
            "max_holds": 8,
            "poll_s": 1.0,
            "thresholds": {"p99_latency_ratio": 100.0},
            "promote_rule": "no_harm",  # as the demo: a few shown choices per arm
        },
        # An upper bound: the loop ends as soon as what this test checks has happened.
        # No fault injection: its rollout would compete with the learned one this test waits for.
        demo={"minutes": scaled(6.0), "degraded_candidate": False},
        eval={"sites": 8, "max_tokens": 8},
    )
    # The session's broker is shared: other tests' records sit on its topics and the sink ingests
    # them too. Only what this loop served (created after it began) is checked below.
    began = datetime.now(UTC).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
    out = io.StringIO()
    result: dict = {}
    rc = demo.run(s, Console(file=out, width=200), result, until=lambda: _promoted_and_served(s.database_url, began))
    log = out.getvalue()
    assert rc == 0, log[-4000:]
    sim = result["simulated"]
    assert sim["errors"] == 0 and sim["requests"] > 0, (sim["failures"], log[-4000:])  # none failed, through every swap

    engine = db.make_engine(s.database_url)
    with engine.connect() as conn:
        versions = {
            r.version: r
            for r in conn.execute(
                text(
                    "SELECT version, parent, kind, size_bytes, full_size_bytes, gate_passed, metrics FROM model_versions"
                )
            )
        }
        rollouts = conn.execute(
            text(
                "SELECT id, candidate_version, stable_version, state, started_at, finished_at FROM rollouts ORDER BY id"
            )
        ).all()
        steps = conn.execute(text("SELECT rollout_id, decision, evidence FROM rollout_steps ORDER BY id")).all()
        swaps = conn.execute(text("SELECT pool, from_version, to_version, ok FROM swap_events ORDER BY id")).all()
        served = conn.execute(
            text(
                "SELECT c.completion_id, c.model_version, c.user_hash, c.created_at, c.prompt_token_ids, ch.token_ids, ch.logprobs "
                "FROM completions c JOIN completion_choices ch ON ch.completion_id = c.completion_id WHERE c.created_at >= :began ORDER BY c.id"
            ),
            {"began": began},
        ).all()

    # The learner published learned versions as deltas that passed the gate, announced and recorded.
    learned = [v for v, r in versions.items() if v > 0 and r.gate_passed and "injected_fault" not in _json(r.metrics)]
    assert learned, log[-4000:]
    sizes = {v: (versions[v].kind, versions[v].size_bytes, versions[v].full_size_bytes) for v in learned}
    deltas = {v: x for v, x in sizes.items() if x[0] == "delta"}
    # deltas, but for the full snapshot every learn.full_every versions (the small model's ratio is benchmarked)
    assert deltas and all(size < full for _, size, full in deltas.values()), str(sizes)
    assert len(sizes) - len(deltas) <= len(sizes) // s.learn.full_every, str(sizes)
    # Auto canary: a learned version was promoted, with its decisions recorded with evidence.
    promoted = [r for r in rollouts if r.state == "promoted"]
    assert promoted and promoted[0].candidate_version in learned, (rollouts, log[-4000:])
    assert all("arms" in _json(st.evidence) for st in steps if st.decision in ("advance", "promote", "rollback"))
    # Every pool swapped in place (no restart), and every swap succeeded.
    assert swaps and all(w.ok for w in swaps)
    assert {("stable", promoted[0].candidate_version)} <= {(w.pool, w.to_version) for w in swaps}

    # Completions are tagged with the version that produced them, and their logprobs are the
    # learner's model at that version (its published FP4 weights).
    store = S.open_store(S.default_store_uri(s))
    _, args = load_master_weights(find_base_model(s))
    v = promoted[0].candidate_version
    tagged = [r for r in served if r.model_version == v and r.token_ids][:5]
    assert tagged, "no completion was served by the promoted version"
    model = model_from_packed(store.materialize(v), args)
    seqs = [(_json(r.prompt_token_ids), _json(r.token_ids)) for r in tagged]
    tol = served_logprob_tolerance(model, seqs, engine_precision(s.serve).dtype)
    for (prompt, gen), r in zip(seqs, tagged, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen]))[0, len(prompt) - 1 : -1]
        mine = torch.log_softmax(logits.float(), -1)[torch.arange(len(gen)), gen]
        assert (mine - torch.tensor(_json(r.logprobs))).abs().max() < tol

    # The summary's held-out evaluation (flywheel eval's) of the base and of what stable serves at the end.
    heldout = result["heldout"]
    assert "v0 (base)" in heldout and all(h["n"] == 8 and "accept_rate" in h["intervals"] for h in heldout.values())
    assert "held-out evaluation: 8 sites" in log

    # Sticky users: while a rollout runs, nobody goes from the candidate back to stable.
    for ro in rollouts:
        seen: dict[str, list[int]] = defaultdict(list)
        for r in served:
            if ro.started_at <= r.created_at and (ro.finished_at is None or r.created_at < ro.finished_at):
                seen[r.user_hash].append(r.model_version)
        for user, vs in seen.items():
            first = vs.index(ro.candidate_version) if ro.candidate_version in vs else len(vs)
            assert all(x == ro.candidate_version for x in vs[first:]) or ro.state != "promoted", (ro.id, user, vs)


def _promoted_and_served(url: str, began: str) -> bool:
    """A learned version (not the injected fault) was promoted and has served a few completions."""
    with db.shared_engine(url).connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT COUNT(*) FROM rollouts r JOIN model_versions v ON v.version = r.candidate_version "
                    "JOIN completions c ON c.model_version = r.candidate_version "
                    "WHERE r.state = 'promoted' AND v.gate_passed AND CAST(v.metrics AS TEXT) NOT LIKE '%injected_fault%' "
                    "AND c.created_at >= :began"
                ),
                {"began": began},
            ).scalar()
            >= 5
        )


def _json(v):
    return json.loads(v) if isinstance(v, str) else v


# `make test-extended`: the families' loop (tests/ops/test_families_e2e.py) covers an imported model
# from import to swap in `make test`; this is the demo's own handling of `model.base`, 5 minutes.
@pytest.mark.extended
def test_demo_runs_on_an_imported_model(tmp_path, kafka_settings):
    """`flywheel demo --base PATH`: the same loop on an imported Hugging Face model (a tiny Qwen3-MoE):
    no pretraining; the learner imports it as v0; serving serves the store's v0; learned versions
    ship as deltas against it and swap in place."""
    from tests.learner.family_models import make_family_model

    folder = make_family_model(tmp_path / "model", "qwen3_moe", chat_eos=True)
    s = demo.DemoSettings(
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "cache",
        kafka={"bootstrap_servers": kafka_settings.kafka.bootstrap},
        model={
            "base": str(folder),
            "min_confidence": 0.0,
        },  # a random test model is unsure of nearly every token: show all (the gate has tests of its own)
        pretrain={"corpus": str(make_corpus(tmp_path / "corpus")), "heldout_fraction": 0.25},
        serve={"port": free_port(), "ray_num_cpus": 2},
        sink={"feedback_window_s": 3.0, "grace_period_s": 30.0},
        simulate={"users": 4, "rate": 2.0, "max_tokens": 8, "edit_delay_s": 0.5, "timeout_s": scaled(60.0)},
        learn={
            "publish_every": 15.0,
            "min_samples": 16,
            "batch_size": 8,
            "poll_s": 0.5,
            "lr": 1e-3,
            "gate": {"sites": 8, "min_sites": 8, "max_tokens": 8, "max_kl": 5.0, "reward_tolerance": 1.0},
        },
        rollout={
            "auto": True,
            "group_id": f"loop-test-{uuid.uuid4().hex[:8]}",
            "weights": [100.0],
            "interval_s": 8.0,
            "min_samples": 2,
            "max_holds": 8,
            "poll_s": 1.0,
            "thresholds": {"p99_latency_ratio": 100.0},
            "promote_rule": "no_harm",  # as the demo: a few shown choices per arm
        },
        demo={"minutes": 2.0, "degraded_candidate": False},
    )
    out = io.StringIO()
    result: dict = {}
    rc = demo.run(s, Console(file=out, width=200), result)
    log = out.getvalue()
    assert rc == 0 and result["simulated"]["errors"] == 0, log[-4000:]
    assert "imported base" in log and "no pretraining" in log and "qwen fill-in-the-middle template" in log
    store = S.open_store(S.default_store_uri(s))
    assert store.base()["kind"] == "imported" and store.base()["source"] == str(folder)
    published = {p["version"]: p for p in result["published"]}
    assert published[0]["kind"] == "full" and any(p["kind"] == "delta" for v, p in published.items() if v > 0), log[
        -4000:
    ]
    assert result["swaps"] and all(w["ok"] for w in result["swaps"]), result["swaps"]
    assert (tmp_path / "data" / "served" / "v000000" / "config.json").read_bytes() == (
        folder / "config.json"
    ).read_bytes()
