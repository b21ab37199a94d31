"""Starting rollouts, what is refused, and the operator's pause, resume, promote and abort."""

from datetime import UTC, datetime, timedelta

import pytest

from feedback import pools
from ops.rollout import commands, controller
from ops.rollout.rows import RolloutError
from tests.ops.rollout.traffic import CANDIDATE, GATE_FAILED, SECTION, STABLE, T0, both_arms, serve, start, steps_of


def test_start_refusals(sqlite_engine):
    with pytest.raises(RolloutError, match="unknown version 42") as e:
        commands.start_rollout(sqlite_engine, 42, section=SECTION)
    assert e.value.status == 400
    with pytest.raises(
        RolloutError, match="failed the learner's evaluation gate .reward hacking suspected.; use --force"
    ):
        commands.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, stable=STABLE)
    with pytest.raises(RolloutError, match="pass --stable"):
        commands.start_rollout(
            sqlite_engine, STABLE, section=SECTION
        )  # nothing served, nothing older: no stable to compare with
    r = start(sqlite_engine)
    with pytest.raises(RolloutError, match=f"rollout {r.id} of version {CANDIDATE} is running") as e:
        commands.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, force=True)
    assert e.value.status == 409
    commands.abort(sqlite_engine, by="test")
    with pytest.raises(RolloutError, match="was rolled out before"):
        commands.start_rollout(sqlite_engine, CANDIDATE, section=SECTION)
    with pytest.raises(RolloutError, match="already the stable version"):
        commands.start_rollout(sqlite_engine, STABLE, section=SECTION)
    forced = commands.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, force=True)
    assert forced.state == "running" and forced.stable_version == STABLE


def test_stable_version_without_serving_pools(sqlite_engine):
    serve(sqlite_engine, STABLE, 3, start=T0)  # what serving runs, as deployed (no serving_pools row)
    r = commands.start_rollout(sqlite_engine, CANDIDATE, section=SECTION, now=T0)
    assert r.stable_version == STABLE


def test_pause_resume_promote_abort(sqlite_engine):
    r = start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=6000)
    paused = commands.pause(sqlite_engine, by="cli:ana", reason="investigating a report")
    assert paused.state == "paused" and paused.reason == "investigating a report"
    assert controller.tick(sqlite_engine, now=T0 + timedelta(hours=1)) is None  # paused: never advances
    assert pools.read(sqlite_engine).canary_percent == 5.0  # traffic stays where it was
    with pytest.raises(RolloutError, match="only a running rollout can pause"):
        commands.pause(sqlite_engine, r.id, by="cli:ana")

    resumed_at = datetime.now(UTC)
    assert commands.resume(sqlite_engine, by="cli:ana").state == "running"
    assert (
        controller.tick(sqlite_engine, now=resumed_at + timedelta(seconds=30)) is None
    )  # an interval after the resume
    assert controller.tick(sqlite_engine, now=resumed_at + timedelta(seconds=61)).decision.action == "advance"

    promoted = commands.promote(sqlite_engine, r.id, by="api:ops-token:1234")
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
        commands.abort(sqlite_engine, by="cli:ana")
    assert e.value.status == 404

    second = commands.start_rollout(sqlite_engine, GATE_FAILED, section=SECTION, force=True)
    assert second.stable_version == CANDIDATE  # the promoted one is stable now
    aborted = commands.abort(sqlite_engine, second.id, by="cli:ana")
    assert aborted.state == "aborted" and pools.read(sqlite_engine) == pools.Routes(
        stable=CANDIDATE, canary=None, canary_percent=0.0
    )


def test_mode_all_swaps_everyone_at_once(sqlite_engine):
    r = start(sqlite_engine, section=SECTION.model_copy(update={"mode": "all"}))
    assert r.state == "promoted" and r.weights == [100.0]
    assert pools.read(sqlite_engine) == pools.Routes(stable=CANDIDATE, canary=None, canary_percent=0.0)
    assert [(s.decision, s.evidence["rule"]) for s in steps_of(sqlite_engine, r.id)] == [("promote", "mode_all")]
