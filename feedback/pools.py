"""Which version each replica pool serves, and how users split between them: state in SQL.

Serving runs two pools of model replicas (Ray Serve deployments): `stable`, which serves
everyone by default, and `canary`, which serves the users a rollout assigns to it. The
target state lives in the `serving_pools` table, written by whoever decides (the rollout
controller, `flywheel swap`) and polled by the processes that act on it:

  - each replica swaps itself in place to its pool's target version (serving/hotswap.py);
  - the ingress routes users to the canary at `traffic_percent`, sticky by user hash
    (serving/routing.py), once the canary replicas report the target version.

Keeping it in the database (not in a process) means a controller, ingress or replica can
restart and pick up where things stood, and the same code runs on a cluster whose nodes
share only the database and the weight store. A pool without a row serves the version it
was deployed with.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine

from feedback import db

STABLE, CANARY = "stable", "canary"
POOLS = (STABLE, CANARY)


@dataclass(frozen=True)
class Routes:
    """The target state: stable's version (None: as deployed), the canary's version and share."""

    stable: int | None = None
    canary: int | None = None
    canary_percent: float = 0.0

    def target(self, pool: str) -> int | None:
        return self.stable if pool == STABLE else self.canary


def read(engine: Engine) -> Routes:
    with engine.connect() as conn:
        rows = {r.pool: r for r in conn.execute(select(db.serving_pools))}
    stable, canary = rows.get(STABLE), rows.get(CANARY)
    return Routes(
        stable=stable.version if stable else None,
        canary=canary.version if canary else None,
        canary_percent=canary.traffic_percent if canary and canary.version is not None else 0.0,
    )


def current_stable(conn: Connection, *, candidate: int | None = None) -> int | None:
    """The version that serves users by default, the one everything is compared with: the stable
    pool's target, else what the latest finished rollout left stable, else the version of the
    newest completion served (other than `candidate`), else the newest gate-passed version older
    than `candidate` in model_versions. None on a fresh deployment."""
    target = conn.execute(select(db.serving_pools.c.version).where(db.serving_pools.c.pool == STABLE)).scalar()
    if target is not None:
        return target
    r = db.rollouts.c
    last = conn.execute(select(r.state, r.candidate_version, r.stable_version).order_by(r.id.desc()).limit(1)).first()
    if last is not None and last.state not in db.ACTIVE_ROLLOUT_STATES:
        return last.candidate_version if last.state == db.PROMOTED else last.stable_version
    c = db.completions.c
    served = conn.execute(select(c.model_version).order_by(c.created_at.desc()).limit(1)).scalar()
    if served is not None and served != candidate:
        return served
    mv = db.model_versions.c
    q = select(mv.version).where(mv.gate_passed.is_(True)).order_by(mv.version.desc()).limit(1)
    return conn.execute(q.where(mv.version < candidate) if candidate is not None else q).scalar()


def versions_in_use(conn: Connection, *, now: datetime, served_within: timedelta = timedelta(days=1)) -> set[int]:
    """Every version serving needs the weight store to keep: each pool's target, the current
    stable version, both versions of an active rollout, and what each replica serves (the version
    of its latest swap attempt, `to_version` if it succeeded, else `from_version`) among replicas
    that logged a swap within `served_within` (older entries are replicas long gone)."""
    out: set[int] = set()
    out.update(v for v in conn.execute(select(db.serving_pools.c.version)).scalars() if v is not None)
    stable = current_stable(conn)
    if stable is not None:
        out.add(stable)
    r = db.rollouts.c
    for row in conn.execute(select(r.candidate_version, r.stable_version).where(r.state.in_(db.ACTIVE_ROLLOUT_STATES))):
        out.update((row.candidate_version, row.stable_version))
    e = db.swap_events.c
    newest = (
        select(e.replica, func.max(e.id).label("id")).where(e.at >= now - served_within).group_by(e.replica).subquery()
    )
    for row in conn.execute(select(e.ok, e.from_version, e.to_version).join(newest, newest.c.id == e.id)):
        out.add(row.to_version if row.ok else row.from_version)
    return out


def _upsert(conn, pool: str, version: int | None, percent: float, rollout_id: int | None) -> None:
    row = {
        "pool": pool,
        "version": version,
        "traffic_percent": percent,
        "rollout_id": rollout_id,
        "updated_at": datetime.now(UTC),
    }
    stmt = db.upsert_insert(conn, db.serving_pools).values(**row)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[db.serving_pools.c.pool], set_={k: stmt.excluded[k] for k in row if k != "pool"}
        )
    )


def set_canary(engine: Engine, version: int, percent: float, *, rollout_id: int | None = None) -> None:
    """Point the canary pool at `version` with `percent` of users (0 <= percent <= 100)."""
    if not 0 <= percent <= 100:
        raise ValueError(f"canary traffic must be within [0, 100] percent, got {percent}")
    with engine.begin() as conn:
        _upsert(conn, CANARY, version, percent, rollout_id)
        stable = conn.execute(select(db.serving_pools.c.version).where(db.serving_pools.c.pool == STABLE)).scalar()
        _upsert(conn, STABLE, stable, 100 - percent, rollout_id)


def set_stable(engine: Engine, version: int, *, rollout_id: int | None = None) -> None:
    """Every user to the stable pool, which serves `version`; the canary serves no one."""
    with engine.begin() as conn:
        _upsert(conn, STABLE, version, 100.0, rollout_id)
        _upsert(conn, CANARY, None, 0.0, rollout_id)


def clear_canary(engine: Engine, *, rollout_id: int | None = None) -> None:
    """Every user back to the stable pool (a rollback); stable's version is unchanged."""
    with engine.begin() as conn:
        stable = conn.execute(select(db.serving_pools.c.version).where(db.serving_pools.c.pool == STABLE)).scalar()
        _upsert(conn, STABLE, stable, 100.0, rollout_id)
        _upsert(conn, CANARY, None, 0.0, rollout_id)


def record_swap(engine: Engine, *, pool: str, replica: str, report: dict) -> None:
    """Log one swap attempt (a serving.hotswap.SwapReport as a dict) in `swap_events`."""
    plan = report.get("plan") or {}
    with engine.begin() as conn:
        conn.execute(
            db.swap_events.insert().values(
                pool=pool,
                replica=replica,
                from_version=report["from_version"],
                to_version=report["target"],
                ok=bool(report["ok"]),
                pause_s=float(report.get("pause_s") or 0.0),
                prepare_s=float(report.get("prepare_s") or 0.0),
                tensors_reloaded=int(report.get("tensors_reloaded") or 0),
                fetched_bytes=int(plan.get("nbytes") or 0),
                error=report.get("error"),
                at=datetime.now(UTC),
                drain_s=report.get("drain_s"),
                reload_s=report.get("reload_s"),
                stage_s=report.get("stage_s"),
                restarted=report.get("restarted"),
            )
        )
