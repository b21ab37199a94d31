"""Commands on rollouts: start one, and the operator's pause, resume, promote and abort.

The CLI (`flywheel rollout ...`), the HTTP routes (routes.py) and auto mode (auto.py) all
call these. Each is one transaction that checks and changes the rollout's row, then writes
the serving pools (topology.py); a refused command raises RolloutError, whose `status` is the
HTTP answer.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import text as sql_text
from sqlalchemy.engine import Connection, Engine

from feedback import db, pools
from feedback.core.clock import utcnow
from feedback.db import ABORTED, ACTIVE_ROLLOUT_STATES, PAUSED, PROMOTED, RUNNING
from ops.rollout.rows import Rollout, RolloutError, active, compare_and_set, get, insert_step, latest, recorded_version
from ops.rollout.settings import RolloutSection
from ops.rollout.stats import PROMOTE
from ops.rollout.topology import apply_pools

log = logging.getLogger("flywheel.rollout")

R = db.rollouts


def start_rollout(
    engine: Engine,
    version: int,
    *,
    section: RolloutSection | None = None,
    force: bool = False,
    stable: int | None = None,
    by: str = "cli",
    now: datetime | None = None,
) -> Rollout:
    """Create a rollout of `version` and point the canary at it (`section.mode` all: make it stable).

    Refused (RolloutError): a version not in model_versions, one that failed the learner's gate
    or was rolled out before (unless `force`), while another rollout is active, or without a
    known stable version to compare with (pass `stable`).
    """
    section = section or RolloutSection()
    now = now or utcnow()
    with engine.begin() as conn:
        _serialize(conn)
        mv = recorded_version(conn, version=version)
        if mv is None:
            raise RolloutError(
                f"unknown version {version}: it is not in model_versions (the learner records each version it publishes)",
                status=400,
                code="unknown_version",
            )
        if not mv.gate_passed and not force:
            why = f" ({mv.gate_reason})" if mv.gate_reason else ""
            raise RolloutError(
                f"version {version} failed the learner's evaluation gate{why}; use --force to roll it out anyway",
                code="gate_failed",
            )
        busy = active(conn)
        if busy is not None:
            raise RolloutError(
                f"rollout {busy.id} of version {busy.candidate_version} is {busy.state}; finish it first (flywheel rollout promote|abort {busy.id})",
                code="busy",
            )
        before = latest(conn, version=version)
        if before is not None and not force:
            raise RolloutError(
                f"version {version} was rolled out before (rollout {before.id}: {before.state}); use --force to roll it out again",
                code="already_rolled_out",
            )
        stable = stable if stable is not None else pools.current_stable(conn, candidate=version)
        if section.mode == "canary":
            if stable is None:
                raise RolloutError(
                    "no stable version is known (no serving_pools row, rollout or completion names one); pass --stable VERSION",
                    status=400,
                    code="no_stable",
                )
            if stable == version:
                raise RolloutError(f"version {version} is already the stable version", code="already_stable")
        row = dict(
            candidate_version=version,
            stable_version=stable if stable is not None else version,
            state=RUNNING if section.mode == "canary" else PROMOTED,
            step_index=0,
            weights=section.weights if section.mode == "canary" else [100.0],
            interval_s=section.interval_s,
            thresholds=section.policy().thresholds() | {"mode": section.mode},
            min_samples=section.min_samples,
            reason=f"started by {by}" if section.mode == "canary" else f"mode all: made stable at once by {by}",
            started_at=now,
            updated_at=now,
            finished_at=None if section.mode == "canary" else now,
        )
        rollout_id = conn.execute(R.insert().values(**row).returning(R.c.id)).scalar_one()
        if section.mode == "all":
            evidence = {"by": by, "rule": "mode_all", "reason": row["reason"]}
            insert_step(
                conn, rollout_id=rollout_id, step_index=0, weight=100.0, decision=PROMOTE, evidence=evidence, at=now
            )
        r = get(conn, rollout_id=rollout_id)
    assert r is not None
    log.info("rollout %d: version %d against stable %d, weights %s", r.id, version, r.stable_version, r.weights)
    apply_pools(engine, r)
    return r


def _serialize(conn: Connection) -> None:
    """Hold the database's writer lock for the rest of this transaction, so that two starts cannot
    both see "no active rollout" (the schema has no partial unique index to say it)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sql_text("SELECT pg_advisory_xact_lock(72026007)"))  # any constant: Flywheel's rollout lock
    else:  # SQLite: the first write takes the lock (pysqlite defers BEGIN until then)
        conn.execute(R.update().where(R.c.id == -1).values(id=R.c.id))


# --- operator commands ------------------------------------------------------------------------


def pause(engine: Engine, rollout_id: int | None = None, *, by: str, reason: str | None = None) -> Rollout:
    """Stop advancing the rollout (traffic stays where it is) until `resume`."""
    return _operator(engine, rollout_id, "pause", (RUNNING,), PAUSED, by=by, reason=reason)


def resume(engine: Engine, rollout_id: int | None = None, *, by: str, reason: str | None = None) -> Rollout:
    """Let a paused rollout advance again; its next evaluation is `interval_s` later."""
    return _operator(engine, rollout_id, "resume", (PAUSED,), RUNNING, by=by, reason=reason)


def promote(engine: Engine, rollout_id: int | None = None, *, by: str, reason: str | None = None) -> Rollout:
    """Make the candidate stable now, whatever the step."""
    return _operator(engine, rollout_id, "promote", ACTIVE_ROLLOUT_STATES, PROMOTED, by=by, reason=reason)


def abort(engine: Engine, rollout_id: int | None = None, *, by: str, reason: str | None = None) -> Rollout:
    """Send every user back to stable and end the rollout."""
    return _operator(engine, rollout_id, "abort", ACTIVE_ROLLOUT_STATES, ABORTED, by=by, reason=reason)


def _operator(
    engine: Engine,
    rollout_id: int | None,
    decision: str,
    allowed: tuple[str, ...],
    to: str,
    *,
    by: str,
    reason: str | None,
) -> Rollout:
    now = utcnow()
    with engine.begin() as conn:
        r = get(conn, rollout_id=rollout_id) if rollout_id is not None else active(conn)
        if r is None:
            raise RolloutError(
                f"no rollout {rollout_id}" if rollout_id is not None else "no active rollout",
                status=404,
                code="not_found",
            )
        if r.state not in allowed:
            raise RolloutError(
                f"rollout {r.id} is {r.state}; only a {' or '.join(allowed)} rollout can {decision}", code="bad_state"
            )
        said = reason or f"{decision} by {by}"
        evidence = {"by": by, "rule": "operator", "reason": said, "from_state": r.state}
        if not compare_and_set(
            conn, r, state=to, reason=said, updated_at=now, finished_at=now if to not in ACTIVE_ROLLOUT_STATES else None
        ):
            raise RolloutError(
                f"rollout {r.id} changed meanwhile; look again (flywheel rollout status) and retry", code="changed"
            )
        insert_step(
            conn,
            rollout_id=r.id,
            step_index=r.step_index,
            weight=r.weight,
            decision=decision,
            evidence=evidence,
            at=now,
        )
        r = get(conn, rollout_id=r.id)
    assert r is not None
    log.info("rollout %d: %s by %s", r.id, decision, by)
    apply_pools(engine, r)
    return r
