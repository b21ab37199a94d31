"""`flywheel soak` end to end with a tiny model: every fault is injected into the running loop
(the broker stopped, the sink and the learner SIGKILLed, PostgreSQL crashed, a replica killed, a
damaged version rolled out), and every check passes: nothing the editors were answered is lost
or doubled, no request got a 5xx but a 503 during the replica's restart, and no replica served a
version that does not verify."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from feedback.core.errors import UserError
from ops.soak.faults import DONE, SKIPPED
from ops.soak.postgres import find_bin
from ops.soak.run import run
from ops.soak.settings import FAULTS, SoakSettings
from tests.helpers import make_settings, scaled
from tests.learner.train.learn_support import make_corpus, tiny_pretrain

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def postgres_programs():
    try:
        return find_bin(None)
    except UserError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs PostgreSQL (.ci/run): {e}")
        pytest.skip(str(e))


def tiny_soak(tmp_path, **soak) -> SoakSettings:
    corpus = make_corpus(tmp_path / "corpus")
    # The tiny base is trained in this test's own cache; Kafka's jars come from the shared one.
    cache = tmp_path / "cache"
    cache.mkdir()
    shared = make_settings(tmp_path).cache_dir / "kafka"
    shared.mkdir(parents=True, exist_ok=True)
    (cache / "kafka").symlink_to(shared, target_is_directory=True)
    return SoakSettings(
        data_dir=tmp_path / "data",
        cache_dir=cache,
        pretrain=tiny_pretrain(corpus, seq_len=128),
        model={
            "min_confidence": 0.0
        },  # a tiny test model is unsure of nearly every token: show all (the gate has tests of its own)
        serve={"ray_num_cpus": 2},
        sink={"feedback_window_s": 3.0, "grace_period_s": 30.0},
        simulate={"users": 4, "rate": 2.0, "max_tokens": 8, "edit_delay_s": 0.5, "timeout_s": scaled(60.0)},
        learn={
            "publish_every": 10.0,
            "min_samples": 8,
            "batch_size": 4,
            "poll_s": 0.5,
            "gate": {"sites": 8, "min_sites": 8, "max_tokens": 8, "max_kl": 5.0, "reward_tolerance": 1.0},
        },
        rollout={
            "auto": True,
            "weights": [50.0, 100.0],
            "interval_s": 8.0,
            "min_samples": 4,
            "max_holds": 4,
            "poll_s": 1.0,
            "unannounced_after_s": 10.0,
            "thresholds": {"p99_latency_ratio": 100.0},
            "promote_rule": "no_harm",  # as the soak's own settings
        },
        soak={
            "minutes": 1.0,
            "warmup_s": 10.0,
            "gap_s": 5.0,
            "broker_down_s": 5.0,
            "postgres_down_s": 3.0,
            "fault_timeout_s": scaled(240.0),
            "restart_grace_s": scaled(15.0),
            "drain_timeout_s": scaled(120.0),
        }
        | soak,
    )


# About 10 minutes each on 2 quiet cores: `make test-soak` runs both; the PostgreSQL one injects every
# fault (SQLite has no server to crash). Kept out of `make test` for CI's 45 minutes.
@pytest.mark.timeout(scaled(1800))
@pytest.mark.parametrize(
    "database",
    [
        pytest.param("sqlite", marks=pytest.mark.soak),
        pytest.param("postgresql", marks=[pytest.mark.soak, pytest.mark.postgres]),
    ],
)
def test_soak_injects_every_fault_and_loses_nothing(tmp_path, database):
    if database == "postgresql":
        postgres_programs()
    s = tiny_soak(tmp_path, database=database)
    out = io.StringIO()
    result: dict = {}
    rc = run(s, Console(file=out, width=220), result)
    log = out.getvalue()
    assert rc == 0, log[-6000:]
    faults = result["faults"]
    assert [f.kind for f in faults[: len(FAULTS)]] == list(FAULTS)
    skipped = {"postgres"} if database == "sqlite" else set()
    assert all(f.outcome == (SKIPPED if f.kind in skipped else DONE) for f in faults), log[-6000:]
    checks = {c.name.split(":")[0]: c for c in result["checks"]}
    assert all(c.ok for c in checks.values()) and len(checks) == 7
    ev = result["evidence"]
    assert sum(1 for c in ev.calls if c.kind == "completion" and c.status == 200) > 50
    assert ev.damaged and all(v in ev.stored for v in ev.damaged)  # planted, refused, kept for a look
    assert "checks (the editors' ledger" in log and "faults injected" in log
