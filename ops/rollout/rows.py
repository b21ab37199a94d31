"""The rollouts and rollout_steps tables as values: what a rollout is, its decisions, and the
guarded writes every decision goes through.

`compare_and_set` is the only way a rollout's row changes after it is inserted: it updates
only if (state, step, updated_at) are still what the caller read, so two controllers, or a
controller and an operator, never both act on the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine, Row

from feedback import db, pools
from feedback.core.clock import as_utc
from feedback.core.errors import UserError
from feedback.db import ACTIVE_ROLLOUT_STATES
from ops.rollout.stats import Policy, json_safe


class RolloutError(UserError):
    """A refused rollout command; `status` is its HTTP status (400 bad input, 404 unknown, 409 conflict)."""

    def __init__(self, message: str, *, status: int = 409, code: str = "conflict"):
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Rollout:
    id: int
    candidate_version: int
    stable_version: int
    state: str
    step_index: int
    weights: list[float]
    interval_s: float
    thresholds: dict[str, Any]
    min_samples: int
    reason: str | None
    started_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row) -> Rollout:
        d = dict(row._mapping)
        for k in ("started_at", "updated_at", "finished_at"):
            if d[k] is not None:  # finished_at, while the rollout is active
                d[k] = as_utc(d[k])
        d["weights"] = [float(w) for w in d["weights"]]
        return cls(**d)

    @property
    def policy(self) -> Policy:
        return Policy.from_row(self.min_samples, self.thresholds)

    @property
    def weight(self) -> float:
        return self.weights[min(self.step_index, len(self.weights) - 1)]

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_ROLLOUT_STATES

    def as_dict(self) -> dict[str, Any]:
        return _plain(self) | {"weight": self.weight}


@dataclass(frozen=True)
class Step:
    id: int
    rollout_id: int
    step_index: int
    weight: float
    decision: str
    evidence: dict[str, Any]
    decided_at: datetime

    def as_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True)
class Status:
    """The rollout asked about (else the active one, else the latest), its recent steps, and the pools."""

    rollout: Rollout | None
    steps: list[Step]
    recent: list[Rollout]
    routes: pools.Routes

    def as_dict(self) -> dict[str, Any]:
        return {
            "rollout": self.rollout.as_dict() if self.rollout else None,
            "steps": [s.as_dict() for s in self.steps],
            "recent": [r.as_dict() for r in self.recent],
            "pools": {
                "stable": self.routes.stable,
                "canary": self.routes.canary,
                "canary_percent": self.routes.canary_percent,
            },
        }


def _plain(row: Rollout | Step) -> dict[str, Any]:
    """The fields as JSON values: timestamps in ISO 8601."""
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.__dict__.items()}


R = db.rollouts
S = db.rollout_steps


def recorded_version(conn: Connection, *, version: int) -> Row | None:
    """The learner's record of `version` (its model_versions row: gate result, sha256), or None."""
    return conn.execute(select(db.model_versions).where(db.model_versions.c.version == version)).first()


def get(conn: Connection, *, rollout_id: int) -> Rollout | None:
    """The rollout `rollout_id`, or None."""
    row = conn.execute(select(R).where(R.c.id == rollout_id)).first()
    return Rollout.from_row(row) if row else None


def active(conn: Connection) -> Rollout | None:
    """The active (running or paused) rollout, or None: there is at most one."""
    row = conn.execute(select(R).where(R.c.state.in_(ACTIVE_ROLLOUT_STATES)).order_by(R.c.id.desc()).limit(1)).first()
    return Rollout.from_row(row) if row else None


def latest(conn: Connection, *, version: int | None = None) -> Rollout | None:
    """The newest rollout (of candidate `version`, if given), or None."""
    q = select(R) if version is None else select(R).where(R.c.candidate_version == version)
    row = conn.execute(q.order_by(R.c.id.desc()).limit(1)).first()
    return Rollout.from_row(row) if row else None


def steps(conn: Connection, *, rollout_id: int, limit: int | None = None) -> list[Step]:
    """The rollout's decisions, oldest first (the newest `limit` of them)."""
    q = select(S).where(S.c.rollout_id == rollout_id).order_by(S.c.id.desc())
    rows = conn.execute(q.limit(limit) if limit else q).all()
    return [Step(**(dict(r._mapping) | {"decided_at": as_utc(r.decided_at)})) for r in reversed(rows)]


def status(engine: Engine, *, rollout_id: int | None = None, limit: int = 20) -> Status:
    """The rollout `rollout_id` (default: the active one, else the latest), its last `limit` steps,
    the `limit` most recent rollouts and the serving pools."""
    with engine.connect() as conn:
        if rollout_id is not None:
            r = get(conn, rollout_id=rollout_id)
            if r is None:
                raise RolloutError(f"no rollout {rollout_id}", status=404, code="not_found")
        else:
            r = active(conn) or latest(conn)
        recent = [Rollout.from_row(x) for x in conn.execute(select(R).order_by(R.c.id.desc()).limit(limit))]
        return Status(
            rollout=r,
            steps=steps(conn, rollout_id=r.id, limit=limit) if r else [],
            recent=recent,
            routes=pools.read(engine),
        )


def compare_and_set(conn: Connection, r: Rollout, **values) -> bool:
    """Update the rollout only if nobody changed it since `r` was read."""
    q = R.update().where(
        R.c.id == r.id, R.c.state == r.state, R.c.step_index == r.step_index, R.c.updated_at == r.updated_at
    )
    return conn.execute(q.values(**values)).rowcount == 1


def insert_step(
    conn: Connection, *, rollout_id: int, step_index: int, weight: float, decision: str, evidence: dict, at: datetime
) -> None:
    """Record one decision with its evidence (made JSON-safe), decided `at`."""
    row = dict(
        rollout_id=rollout_id,
        step_index=step_index,
        weight=weight,
        decision=decision,
        evidence=json_safe(evidence),
        decided_at=at,
    )
    conn.execute(S.insert().values(**row))
