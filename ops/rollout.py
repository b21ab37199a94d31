"""The canary rollout controller: start, watch, advance, promote or roll back a model version.

A rollout moves a candidate version through traffic steps (`weights`, percent of users, by
default 5, 25, 50, 100). At each step the controller waits `interval_s`, then compares the
canary (completions served by the candidate) with stable (served by the stable version)
over the step's time window, from the SQL tables, and decides (ops/rollout_stats.py):

  rollback  a guarded metric is significantly worse (or p99 latency over its ratio), or a
            step stayed under-sampled for `max_holds` evaluations ("insufficient traffic");
  hold      too few samples yet: look again `interval_s` later, with the window still open;
  advance   enough samples and no significant harm: the next weight;
  promote   the same, at the last weight: the candidate becomes stable.

All state is in SQL, nothing in the process, so a controller can die and restart anywhere:

  - `rollouts` holds the state (running, paused, promoted, rolled_back, aborted), the step
    index and the policy the rollout began with (weights, interval, min_samples, thresholds);
  - `rollout_steps` holds every decision with its evidence. A step's window begins at the
    `advance` row that opened it (the rollout's `started_at` for the first), the next
    evaluation is due `interval_s` after the latest row of any kind, and the holds of a step
    are its `hold` rows;
  - the serving topology (`serving_pools`, feedback/pools.py) follows the rollout. A
    decision is committed first and the pools written after it; each controller pass
    compares the pools with the latest rollout and repairs a write that failed.

At weight 100 stable serves nobody, so the stable arm there is all of stable's traffic from
one interval before the rollout began until now (a historical control).

Decisions are compare-and-set updates on (state, step, updated_at): two controllers, or a
controller and an operator, never both act on the same step. One rollout may be active
(running or paused) at a time, and (unless forced) a version is rolled out once.

Auto mode (`rollout.auto`) consumes `flywheel.versions` in the consumer group
`rollout.group_id`, so a restarted controller resumes where it left off, and rolls out the
newest announced version that passed the learner's gate, is newer than stable and has no
rollout yet; a version announced while another rollout runs waits for it to finish (a newer
announcement supersedes it). Mode `all` skips the canary: the version becomes stable at
once (recorded as a promoted rollout).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Self

from pydantic import Field, model_validator
from sqlalchemy import and_, case, func, select
from sqlalchemy import text as sql_text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from feedback import db, pools
from feedback.core.clock import as_utc
from feedback.core.config import FlywheelSettings, Seconds, Section
from feedback.core.errors import UserError, first_line
from feedback.db import ABORTED, ACTIVE_ROLLOUT_STATES, PAUSED, PROMOTED, ROLLED_BACK, RUNNING
from feedback.schemas import ModelVersion
from ops.rollout_stats import ADVANCE, HOLD, PROMOTE, ROLLBACK, Arm, Decision, Policy, decide, json_safe

log = logging.getLogger("flywheel.rollout")

ERROR_FINISH_REASONS = ("abort", "error")
ACCEPT_EVENTS = ("select", "edit")


# --- settings -------------------------------------------------------------------------------------


class Thresholds(Section):
    """How much worse than stable the canary may look before a significant difference counts as harm."""

    accept_rate_drop: float = Field(default=0.02, ge=0, le=1)
    """Tolerated drop in accept rate (accepted / shown), absolute: 0.02 is 2 percentage points."""
    reward_drop: float = Field(default=0.05, ge=0)
    """Tolerated drop in mean reward per choice, in reward units (sink.reward: accepted = 0.75)."""
    error_rate_increase: float = Field(default=0.01, ge=0, le=1)
    """Tolerated rise in the share of aborted choices, absolute."""
    p99_latency_ratio: float = Field(default=1.5, ge=1)
    """Roll back when the canary's latency is significantly above stable's times this factor (Welch's t-test on
    log latency: a ratio of geometric means); each arm's p99 is kept in the evidence."""


class RolloutSection(Section):
    """Section `[rollout]`: the policy new rollouts get, and how the controller runs."""

    mode: Literal["canary", "all"] = "canary"
    """`canary`: step through `weights`, testing at each; `all`: make the version stable at once (no canary)."""
    weights: list[float] = [5.0, 25.0, 50.0, 100.0]
    """Canary share of users per step, percent, increasing; passing the last step promotes."""
    interval_s: Seconds = Field(default=60.0, gt=0)
    """How long each step runs before it is evaluated (and between evaluations of a holding step)."""
    min_samples: int = Field(default=200, ge=2)
    """Observations per arm below which a metric is not tested; the step holds until the accept rate has them."""
    alpha: float = Field(default=0.05, gt=0, lt=0.5)
    """Significance level of each one-sided test (canary worse than stable beyond the threshold)."""
    max_holds: int = Field(default=30, ge=0)
    """Under-sampled evaluations a step may hold before the rollout is rolled back for insufficient traffic."""
    require_reward: bool = False
    """Also hold until mean reward has `min_samples` per arm. Rewards appear sink.feedback_window_s after
    a completion, so set this only with `interval_s` well above that window; otherwise reward still guards
    (rolls back) whenever it has the samples."""
    thresholds: Thresholds = Thresholds()
    """Tolerances of the guarded metrics (section `[rollout.thresholds]`)."""
    poll_s: float = Field(default=5.0, gt=0)
    """How often the controller checks the active rollout (and, in auto mode, the versions topic)."""
    auto: bool = False
    """Start a rollout for every version announced on flywheel.versions that passed the learner's gate."""
    group_id: str = Field(default="flywheel-rollout", min_length=1)
    """Kafka consumer group of the auto-mode controller (a restart resumes from its committed offset)."""

    @model_validator(mode="after")
    def _weights_increase(self) -> Self:
        w = self.weights
        if not w or any(not 0 < x <= 100 for x in w) or any(b <= a for a, b in zip(w, w[1:])):
            raise ValueError(
                f"rollout.weights must be increasing percentages in (0, 100], e.g. [5, 25, 50, 100]; got {w}"
            )
        return self

    def policy(self) -> Policy:
        return Policy(
            min_samples=self.min_samples,
            alpha=self.alpha,
            max_holds=self.max_holds,
            require_reward=self.require_reward,
            **self.thresholds.model_dump(),
        )


class RolloutSettings(FlywheelSettings):
    """`flywheel rollout`: the canary controller and its commands."""

    rollout: RolloutSection = RolloutSection()


def parse_weights(value: str) -> list[float]:
    """`5,25,50,100` -> [5.0, 25.0, 50.0, 100.0]; ValueError otherwise."""
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad weights {value!r}: expected comma-separated percentages, e.g. 5,25,50,100") from None


# --- rows -----------------------------------------------------------------------------------------


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
            d[k] = _utc(d[k])
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
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in self.__dict__.items()} | {
            "weight": self.weight
        }


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
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in self.__dict__.items()}


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


def _utc(dt: datetime | None) -> datetime | None:
    return None if dt is None else as_utc(dt)


def _now() -> datetime:
    return datetime.now(UTC)


R = db.rollouts
S = db.rollout_steps


def get(conn: Connection, rollout_id: int) -> Rollout | None:
    row = conn.execute(select(R).where(R.c.id == rollout_id)).first()
    return Rollout.from_row(row) if row else None


def active(conn: Connection) -> Rollout | None:
    row = conn.execute(select(R).where(R.c.state.in_(ACTIVE_ROLLOUT_STATES)).order_by(R.c.id.desc()).limit(1)).first()
    return Rollout.from_row(row) if row else None


def latest(conn: Connection) -> Rollout | None:
    row = conn.execute(select(R).order_by(R.c.id.desc()).limit(1)).first()
    return Rollout.from_row(row) if row else None


def steps(conn: Connection, rollout_id: int, *, limit: int | None = None) -> list[Step]:
    """The rollout's decisions, oldest first (the newest `limit` of them)."""
    q = select(S).where(S.c.rollout_id == rollout_id).order_by(S.c.id.desc())
    rows = conn.execute(q.limit(limit) if limit else q).all()
    return [Step(**(dict(r._mapping) | {"decided_at": _utc(r.decided_at)})) for r in reversed(rows)]


def status(engine: Engine, rollout_id: int | None = None, *, limit: int = 20) -> Status:
    """The rollout `rollout_id` (default: the active one, else the latest), its last `limit` steps,
    the `limit` most recent rollouts and the serving pools."""
    with engine.connect() as conn:
        if rollout_id is not None:
            r = get(conn, rollout_id)
            if r is None:
                raise RolloutError(f"no rollout {rollout_id}", status=404, code="not_found")
        else:
            r = active(conn) or latest(conn)
        recent = [Rollout.from_row(x) for x in conn.execute(select(R).order_by(R.c.id.desc()).limit(limit))]
        return Status(
            rollout=r, steps=steps(conn, r.id, limit=limit) if r else [], recent=recent, routes=pools.read(engine)
        )


# --- starting ---------------------------------------------------------------------------------


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
    now = now or _now()
    with engine.begin() as conn:
        _serialize(conn)
        mv = conn.execute(select(db.model_versions).where(db.model_versions.c.version == version)).first()
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
        before = conn.execute(
            select(R.c.id, R.c.state).where(R.c.candidate_version == version).order_by(R.c.id.desc()).limit(1)
        ).first()
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
            _insert_step(
                conn, rollout_id, 0, 100.0, PROMOTE, {"by": by, "rule": "mode_all", "reason": row["reason"]}, now
            )
        r = get(conn, rollout_id)
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
    now = _now()
    with engine.begin() as conn:
        r = get(conn, rollout_id) if rollout_id is not None else active(conn)
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
        if not _compare_and_set(
            conn, r, state=to, reason=said, updated_at=now, finished_at=now if to not in ACTIVE_ROLLOUT_STATES else None
        ):
            raise RolloutError(
                f"rollout {r.id} changed meanwhile; look again (flywheel rollout status) and retry", code="changed"
            )
        _insert_step(conn, r.id, r.step_index, r.weight, decision, evidence, now)
        r = get(conn, r.id)
    assert r is not None
    log.info("rollout %d: %s by %s", r.id, decision, by)
    apply_pools(engine, r)
    return r


def _compare_and_set(conn: Connection, r: Rollout, **values) -> bool:
    """Update the rollout only if nobody changed it since `r` was read."""
    q = R.update().where(
        R.c.id == r.id, R.c.state == r.state, R.c.step_index == r.step_index, R.c.updated_at == r.updated_at
    )
    return conn.execute(q.values(**values)).rowcount == 1


def _insert_step(
    conn: Connection, rollout_id: int, step_index: int, weight: float, decision: str, evidence: dict, now: datetime
) -> None:
    row = dict(
        rollout_id=rollout_id,
        step_index=step_index,
        weight=weight,
        decision=decision,
        evidence=json_safe(evidence),
        decided_at=now,
    )
    conn.execute(S.insert().values(**row))


# --- serving pools ------------------------------------------------------------------------------


def apply_pools(engine: Engine, r: Rollout) -> None:
    """Write the serving topology the rollout's state asks for; RolloutError (503) if the database
    refuses (the decision itself is committed: the controller repairs the pools when it answers)."""
    try:
        if r.active:
            pools.set_canary(engine, r.candidate_version, r.weight, rollout_id=r.id)
        elif r.state == PROMOTED:
            pools.set_stable(engine, r.candidate_version, rollout_id=r.id)
        else:
            pools.clear_canary(engine, rollout_id=r.id)
    except SQLAlchemyError as e:
        raise RolloutError(
            f"rollout {r.id} is {r.state}, but serving_pools could not be written ({type(e).__name__}); "
            "the controller (flywheel rollout run) applies it when the database answers",
            status=503,
            code="pools_unwritten",
        ) from None


def reconcile(engine: Engine, r: Rollout) -> bool:
    """Repair the serving pools if they disagree with rollout `r` (the latest); True if it wrote.

    An active rollout owns the canary pool. A finished one is repaired only while the pools
    still carry its id: once `flywheel swap` or another rollout wrote them, they are theirs.
    """
    with engine.connect() as conn:
        rows = {row.pool: row for row in conn.execute(select(db.serving_pools))}
    stable, canary = rows.get(pools.STABLE), rows.get(pools.CANARY)
    if r.active:
        ok = (
            canary is not None
            and canary.version == r.candidate_version
            and math.isclose(canary.traffic_percent, r.weight)
        )
    else:
        owned = not rows or any(row.rollout_id == r.id for row in rows.values())
        if not owned:
            return False
        canary_off = canary is None or canary.version is None
        ok = canary_off and (r.state != PROMOTED or (stable is not None and stable.version == r.candidate_version))
    if ok:
        return False
    log.warning("rollout %d (%s): serving_pools disagree; rewriting them", r.id, r.state)
    apply_pools(engine, r)
    return True


# --- the controller ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One evaluation: the rollout after it, and the decision with its evidence."""

    rollout: Rollout
    step_index: int
    weight: float
    decision: Decision

    def line(self) -> str:
        r = self.rollout
        where = (
            f"rollout {r.id} (v{r.candidate_version} vs v{r.stable_version}) step {self.step_index} at {self.weight:g}%"
        )
        return f"{where}: {self.decision.action}: {self.decision.reason}"


@dataclass(frozen=True)
class StepClock:
    window_start: datetime
    """When the current step began: its opening `advance`, else the rollout's start."""
    last_decision: datetime
    """The latest decision of any kind (hold, pause, resume...), else the start."""
    holds: int
    """Holds recorded at the current step."""


def step_clock(conn: Connection, r: Rollout) -> StepClock:
    window_start = last = r.started_at
    holds = 0
    for row in conn.execute(
        select(S.c.decision, S.c.step_index, S.c.decided_at).where(S.c.rollout_id == r.id).order_by(S.c.id)
    ):
        at = _utc(row.decided_at)
        last = max(last, at)
        if row.decision == ADVANCE:
            window_start, holds = at, 0
        elif row.decision == HOLD and row.step_index == r.step_index:
            holds += 1
    return StepClock(window_start=window_start, last_decision=last, holds=holds)


def read_arm(conn: Connection, version: int, since: datetime, until: datetime) -> Arm:
    """One version's traffic among completions created in [since, until)."""
    c, ch, ev, rw = db.completions, db.completion_choices, db.events, db.rewards
    window = and_(c.c.model_version == version, c.c.created_at >= since, c.c.created_at < until)

    ranked = (
        select(
            c.c.latency_ms, func.row_number().over(order_by=c.c.latency_ms).label("rn"), func.count().over().label("n")
        )
        .where(window)
        .subquery()
    )
    n_completions, p99 = conn.execute(
        select(func.max(ranked.c.n), func.min(case((ranked.c.rn >= 0.99 * ranked.c.n, ranked.c.latency_ms))))
    ).one()
    # ln() is not portable SQL (SQLite may lack it): the log moments come from the values.
    logs = [math.log(max(float(x), 1e-3)) for x in conn.execute(select(c.c.latency_ms).where(window)).scalars()]
    log_mean = sum(logs) / len(logs) if logs else None
    log_var = sum((x - log_mean) ** 2 for x in logs) / (len(logs) - 1) if len(logs) > 1 else (0.0 if logs else None)

    per_choice = (
        select(
            ch.c.finish_reason,
            func.count(ev.c.id).label("events"),
            func.max(case((ev.c.type.in_(ACCEPT_EVENTS), 1), else_=0)).label("accepted"),
        )
        .select_from(
            c.join(ch, ch.c.completion_id == c.c.completion_id).outerjoin(
                ev, and_(ev.c.completion_id == ch.c.completion_id, ev.c.choice_index == ch.c.choice_index)
            )
        )
        .where(window)
        .group_by(ch.c.id, ch.c.finish_reason)
        .subquery()
    )
    choices, errors, shown, accepted = conn.execute(
        select(
            func.count(),
            func.coalesce(func.sum(case((per_choice.c.finish_reason.in_(ERROR_FINISH_REASONS), 1), else_=0)), 0),
            func.coalesce(func.sum(case((per_choice.c.events > 0, 1), else_=0)), 0),
            func.coalesce(func.sum(case((per_choice.c.events > 0, per_choice.c.accepted), else_=0)), 0),
        )
    ).one()

    n_rewards, total, squares = conn.execute(
        select(func.count(rw.c.id), func.sum(rw.c.reward), func.sum(rw.c.reward * rw.c.reward))
        .select_from(rw.join(c, c.c.completion_id == rw.c.completion_id))
        .where(window, rw.c.model_version == version)
    ).one()
    mean = var = None
    if n_rewards:
        mean = total / n_rewards
        var = max(0.0, (squares - n_rewards * mean * mean) / (n_rewards - 1)) if n_rewards > 1 else 0.0
    return Arm(
        completions=int(n_completions or 0),
        p99_latency_ms=float(p99) if p99 is not None else None,
        log_latency_mean=log_mean,
        log_latency_var=log_var,
        choices=int(choices),
        errors=int(errors),
        shown=int(shown),
        accepted=int(accepted),
        rewards=int(n_rewards),
        reward_mean=mean,
        reward_var=var,
    )


def tick(engine: Engine, *, now: datetime | None = None) -> Outcome | None:
    """One controller pass: repair the pools, then evaluate the running rollout if its step is due.

    Stateless: everything comes from SQL, so any process may call it at any time; it returns the
    evaluation, or None when nothing was due (or another process decided first).
    """
    now = now or _now()
    with engine.connect() as conn:
        r = latest(conn)
    if r is None:
        return None
    try:
        reconcile(engine, r)
    except RolloutError as e:
        log.warning("%s", e)
    if r.state != RUNNING:
        return None
    with engine.connect() as conn:
        clock = step_clock(conn, r)
        if (now - clock.last_decision).total_seconds() < r.interval_s:
            return None
        # At 100% stable serves nobody: compare with all of stable's traffic since one interval
        # before the rollout began (when it served everyone), so even weights [100] have a control.
        stable_since = r.started_at - timedelta(seconds=r.interval_s) if r.weight >= 100 else clock.window_start
        canary = read_arm(conn, r.candidate_version, clock.window_start, now)
        stable = read_arm(conn, r.stable_version, stable_since, now)
    d = decide(canary, stable, r.policy, holds=clock.holds, last_step=r.step_index >= len(r.weights) - 1)
    evidence = d.evidence | {
        "by": "controller",
        "reason": d.reason,
        "weight": r.weight,
        "window": {
            "canary": [clock.window_start.isoformat(), now.isoformat()],
            "stable": [stable_since.isoformat(), now.isoformat()],
        },
    }
    values: dict[str, Any] = {"reason": d.reason, "updated_at": now}
    if d.action == ADVANCE:
        values["step_index"] = r.step_index + 1
    elif d.action in (PROMOTE, ROLLBACK):
        values |= {"state": PROMOTED if d.action == PROMOTE else ROLLED_BACK, "finished_at": now}
    with engine.begin() as conn:
        if not _compare_and_set(conn, r, **values):
            return None  # an operator or another controller acted on this step first
        _insert_step(conn, r.id, r.step_index, r.weight, d.action, evidence, now)
        after = get(conn, r.id)
    assert after is not None
    if d.action != HOLD:
        try:
            apply_pools(engine, after)
        except RolloutError as e:
            log.warning("%s", e)
    return Outcome(
        rollout=after, step_index=r.step_index, weight=r.weight, decision=Decision(d.action, d.rule, d.reason, evidence)
    )


def run_controller(
    settings: RolloutSettings,
    stop: threading.Event,
    *,
    engine: Engine | None = None,
    progress: Callable[[str], None] = log.info,
    handle_signals: bool = False,
) -> None:
    """Run the controller until `stop` is set: every `rollout.poll_s`, `tick()` (and in auto mode,
    start rollouts for announced versions). Database and Kafka failures are logged and retried;
    the loop never dies of them. Usable in a thread (the demo) or as `flywheel rollout run`."""
    cfg = settings.rollout
    own_engine = engine is None
    engine = engine or db.make_engine(settings.database_url, echo=settings.database.echo)
    starter = AutoStarter(settings, engine) if cfg.auto else None
    restore = _install_signal_handlers(stop) if handle_signals else None
    progress(f"rollout controller: every {cfg.poll_s:g}s{', auto mode (' + cfg.mode + ')' if cfg.auto else ''}")

    def evaluate() -> list[str]:
        out = tick(engine)
        return [out.line()] if out is not None else []

    # The versions topic and the database fail independently: Kafka being down must not stop the
    # controller from judging the active rollout.
    passes = [("versions", starter.poll)] if starter is not None else []
    passes.append(("rollouts", evaluate))
    failing: dict[str, str] = {}
    try:
        while not stop.is_set():
            for name, work in passes:
                try:
                    for line in work():
                        progress(line)
                    if failing.pop(name, None):
                        progress(f"rollout controller: {name} recovered")
                except Exception as e:  # a database or broker hiccup, or a bug: log it, never die of it
                    what = first_line(e)
                    if failing.get(name) != what:  # once per distinct failure, not every poll
                        bug = (
                            not isinstance(e, (SQLAlchemyError, UserError))
                            and type(e).__module__.split(".")[0] != "kafka"
                        )
                        log.warning(
                            "rollout controller (%s): %s; retrying every %gs", name, what, cfg.poll_s, exc_info=bug
                        )
                    failing[name] = what
            stop.wait(cfg.poll_s)
    finally:
        if starter is not None:
            starter.close()
        if own_engine:
            engine.dispose()
        if restore:
            restore()


def _install_signal_handlers(stop: threading.Event) -> Callable[[], None] | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())
    return lambda: [signal.signal(sig, h) for sig, h in previous.items()]


# --- auto mode ------------------------------------------------------------------------------------


def record_version(engine: Engine, msg: ModelVersion) -> None:
    """Insert an announced version (feedback.schemas.ModelVersion) into model_versions unless the
    learner recorded it already (its row wins: it may have updated the gate since)."""
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    with engine.begin() as conn:
        stmt = insert(db.model_versions).values(**msg.model_dump(mode="python"))
        conn.execute(stmt.on_conflict_do_nothing(index_elements=[db.model_versions.c.version]))


def start_announced(engine: Engine, msg: ModelVersion, section: RolloutSection) -> tuple[str, Rollout | None, str]:
    """Act on one announced version: ("started", rollout, why), ("waiting", None, why) while another
    rollout is active, or ("skipped", None, why). Idempotent: a version with a rollout is skipped."""
    record_version(engine, msg)
    if not msg.gate_passed:
        return "skipped", None, f"version {msg.version} failed the gate ({msg.gate_reason or 'no reason'})"
    with engine.connect() as conn:
        if conn.execute(select(R.c.id).where(R.c.candidate_version == msg.version).limit(1)).first() is not None:
            return "skipped", None, f"version {msg.version} already has a rollout"
        stable = pools.current_stable(conn, candidate=msg.version)
        if stable is not None and msg.version <= stable:
            return "skipped", None, f"version {msg.version} is not newer than stable v{stable}"
        busy = active(conn)
        if busy is not None:
            return "waiting", None, f"version {msg.version} waits for rollout {busy.id} (v{busy.candidate_version})"
    try:
        r = start_rollout(engine, msg.version, section=section, by="auto")
    except RolloutError as e:
        if e.code == "busy":
            return "waiting", None, str(e)
        if e.code == "pools_unwritten":  # started; the controller repairs the pools
            return "started", None, str(e)
        return "skipped", None, str(e)
    return "started", r, f"rollout {r.id}: version {r.candidate_version} against v{r.stable_version} ({section.mode})"


class AutoStarter:
    """Reads flywheel.versions and starts rollouts; commits offsets only once everything read is
    handled, so a version still waiting for the active rollout is read again after a restart."""

    def __init__(self, settings: RolloutSettings, engine: Engine):
        self.settings, self.engine = settings, engine
        self.consumer = None
        self.queue: list = []  # (ModelVersion, TopicPartition, offset) read but not yet offered
        self.pending = None  # the newest gate-passed version not yet started
        self.offsets: dict = {}  # TopicPartition -> next offset to commit
        self.store = None  # the weight store announced versions must be in (opened on first use)

    def poll(self) -> list[str]:
        from kafka import TopicPartition

        from feedback import bus
        from feedback.schemas import MalformedMessage, decode

        if self.consumer is None:
            self.consumer = bus.consumer(self.settings.kafka, bus.VERSIONS, group_id=self.settings.rollout.group_id)
        for tp, records in self.consumer.poll(timeout_ms=200, max_records=500).items():
            for rec in records:
                try:
                    self.queue.append(
                        (decode(ModelVersion, rec.value), TopicPartition(rec.topic, rec.partition), rec.offset)
                    )
                except MalformedMessage as e:
                    log.warning("flywheel.versions offset %d: %s; skipped", rec.offset, e)
                    self.offsets[tp] = rec.offset + 1
        lines = []
        while self.queue:  # the newest gate-passed announcement supersedes older pending ones
            msg, tp, offset = self.queue[0]
            if not self._in_store(msg):
                lines.append(
                    f"rollout auto: version {msg.version} ({msg.uri}) is not in this weight store with that sha256; ignored"
                )
                self.queue.pop(0)
                self.offsets[tp] = offset + 1
                continue
            record_version(self.engine, msg)
            if msg.gate_passed and (self.pending is None or msg.version > self.pending.version):
                self.pending = msg
            elif not msg.gate_passed:
                lines.append(
                    f"rollout auto: version {msg.version} failed the gate ({msg.gate_reason or 'no reason'}); not rolled out"
                )
            self.queue.pop(0)
            self.offsets[tp] = offset + 1
        if self.pending is not None:
            outcome, _, why = start_announced(self.engine, self.pending, self.settings.rollout)
            if outcome != "waiting":
                lines.append(f"rollout auto: {why}")
                self.pending = None
        if self.pending is None and self.offsets:
            self._commit()
        return lines

    def _in_store(self, msg: ModelVersion) -> bool:
        """Whether the announced version is the one in this deployment's weight store (same
        manifest sha256): a topic shared with another deployment, or a store that was reset,
        must not make this controller roll out a version its replicas cannot load."""
        from learner.store import StoreError, default_store_uri, open_store

        if self.store is None:
            self.store = open_store(default_store_uri(self.settings))
        try:
            return msg.version in self.store.versions() and self.store.model_version(msg.version).sha256 == msg.sha256
        except (StoreError, ValueError) as e:  # a corrupt manifest: not rolled out either
            log.warning("version %d in the weight store: %s", msg.version, e)
            return False

    def _commit(self) -> None:
        from kafka.structs import OffsetAndMetadata

        self.consumer.commit({tp: OffsetAndMetadata(off, "", -1) for tp, off in self.offsets.items()})
        self.offsets = {}

    def close(self) -> None:
        if self.consumer is not None:
            try:
                self.consumer.close(autocommit=False)
            except Exception as e:  # closing a consumer whose broker is gone: nothing left to lose
                log.debug("closing the versions consumer: %s", e)
