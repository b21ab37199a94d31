"""The dashboard's numbers: SQL (on SQLite and PostgreSQL) to JSON-ready data.

    dashboard_data(engine) -> dict   how each version does, the pools, the rollout, swaps, volume

Time series are bucketed in SQL by whole seconds since the epoch; the bucket grows with the
span of the data (a minute for a short demo, a day for months) so a chart has at most
~`MAX_BUCKETS` points. Timestamps come out as ISO 8601 strings in UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import case, desc, func, select, text
from sqlalchemy.engine import Connection, Engine

from feedback import db
from feedback.core.clock import as_utc

MAX_BUCKETS = 96
NICE_BUCKETS_S = (60, 300, 900, 3600, 6 * 3600, 86400, 7 * 86400)
MAX_SWAPS = 500  # the most recent swap events plotted
RECENT_ROLLOUTS = 10


def dashboard_data(engine: Engine, *, bucket_s: int | None = None) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data (timestamps are ISO 8601 strings in UTC)."""
    with engine.connect() as conn:
        c = db.completions.c
        first, last = conn.execute(select(func.min(c.created_at), func.max(c.created_at))).one()
        bucket_s = bucket_s or pick_bucket(first, last)
        dialect = conn.dialect.name
        bucket = lambda column: _bucket_sql(dialect, column, bucket_s)  # noqa: E731
        swaps = _swaps(conn)
        return {
            "generated_at": _iso(datetime.now(UTC)),
            "bucket_s": bucket_s,
            "span": {"first": _iso(first), "last": _iso(last)},
            "totals": _totals(conn),
            "pools": _pools(conn),
            "versions": _versions(conn),
            "acceptance": _acceptance(conn, bucket),
            "reward": _reward(conn, bucket),
            "latency": _latency(conn, bucket),
            "volume": _volume(conn, bucket),
            "rollout": _current_rollout(conn),
            "rollouts": _recent_rollouts(conn),
            "swaps": swaps,
            "swap_summary": summarise_swaps(swaps),
        }


def pick_bucket(first: datetime | None, last: datetime | None) -> int:
    """The smallest nice bucket (seconds) that keeps the span within MAX_BUCKETS points."""
    if first is None or last is None:
        return NICE_BUCKETS_S[0]
    span = (as_utc(last) - as_utc(first)).total_seconds()
    return next((b for b in NICE_BUCKETS_S if span / b <= MAX_BUCKETS), NICE_BUCKETS_S[-1])


def _bucket_sql(dialect: str, column: str, bucket_s: int) -> str:
    """SQL for the start of `column`'s bucket, in whole seconds since the epoch (UTC)."""
    assert isinstance(bucket_s, int) and bucket_s > 0  # inlined into SQL
    if dialect == "postgresql":
        return f"CAST(FLOOR(EXTRACT(EPOCH FROM {column}) / {bucket_s}) AS BIGINT) * {bucket_s}"
    # SQLite keeps timestamps as UTC text; integer division floors for positive numbers
    return f"(CAST(strftime('%s', {column}) AS INTEGER) / {bucket_s}) * {bucket_s}"


def _totals(conn: Connection) -> dict[str, int]:
    count = lambda t: conn.execute(select(func.count()).select_from(t)).scalar_one()  # noqa: E731
    inferred = select(func.count()).select_from(db.events).where(db.events.c.source == db.INFERRED)
    return {
        "completions": count(db.completions),
        "events": count(db.events),
        "inferred_events": conn.execute(inferred).scalar_one(),
        "rewards": count(db.rewards),
        "versions": count(db.model_versions),
        "swaps": count(db.swap_events),
    }


def _pools(conn: Connection) -> list[dict]:
    p = db.serving_pools.c
    rows = conn.execute(
        select(p.pool, p.version, p.traffic_percent, p.rollout_id, p.updated_at).order_by(p.pool)
    ).mappings()
    return [_plain_row(r) for r in rows]


def _versions(conn: Connection) -> list[dict]:
    """One row per version seen anywhere: registry facts (sizes, gate) and served feedback."""
    mv = db.model_versions.c
    registry = {
        r["version"]: _plain_row(r)
        for r in conn.execute(
            select(
                mv.version,
                mv.parent,
                mv.kind,
                mv.size_bytes,
                mv.full_size_bytes,
                mv.gate_passed,
                mv.gate_reason,
                mv.created_at,
            )
        ).mappings()
    }
    served = {
        r.model_version: r
        for r in conn.execute(
            text(
                "SELECT model_version, COUNT(DISTINCT completion_id) AS completions, SUM(shown) AS shown, SUM(accepted) AS accepted "
                "FROM v_choice_feedback GROUP BY model_version"
            )
        )
    }
    rewarded = {
        r.model_version: r
        for r in conn.execute(text("SELECT model_version, rewarded, mean_reward FROM v_version_rewards"))
    }
    out = []
    for v in sorted(set(registry) | set(served) | set(rewarded)):
        row = registry.get(v) or {
            "version": v,
            "parent": None,
            "kind": None,
            "size_bytes": None,
            "full_size_bytes": None,
            "gate_passed": None,
            "gate_reason": None,
            "created_at": None,
        }
        s, r = served.get(v), rewarded.get(v)
        shown, accepted = int(s.shown or 0) if s else 0, int(s.accepted or 0) if s else 0
        out.append(
            row
            | {
                "completions": int(s.completions) if s else 0,
                "shown": shown,
                "accepted": accepted,
                "accept_rate": accepted / shown if shown else None,
                "rewarded": int(r.rewarded) if r else 0,
                "mean_reward": float(r.mean_reward) if r and r.mean_reward is not None else None,
            }
        )
    return out


def _acceptance(conn: Connection, bucket) -> list[dict]:
    """Accept rate per version and time bucket: accepted choices over shown choices."""
    rows = conn.execute(
        text(f"""
        SELECT ts, model_version, SUM(shown) AS shown, SUM(accepted) AS accepted
        FROM (SELECT {bucket("created_at")} AS ts, model_version, shown, accepted FROM v_choice_feedback) b
        GROUP BY ts, model_version ORDER BY ts, model_version
    """)
    )
    return [
        {
            "t": _iso_epoch(r.ts),
            "version": r.model_version,
            "shown": int(r.shown),
            "accepted": int(r.accepted),
            "accept_rate": int(r.accepted) / int(r.shown) if r.shown else None,
        }
        for r in rows
    ]


def _reward(conn: Connection, bucket) -> list[dict]:
    """Mean reward per version, bucketed by when the rewarded completion was served."""
    rows = conn.execute(
        text(f"""
        SELECT ts, model_version, COUNT(*) AS rewarded, AVG(reward) AS mean_reward
        FROM (SELECT {bucket("c.created_at")} AS ts, r.model_version, r.reward
              FROM rewards r JOIN completions c ON c.completion_id = r.completion_id) b
        GROUP BY ts, model_version ORDER BY ts, model_version
    """)
    )
    return [
        {
            "t": _iso_epoch(r.ts),
            "version": r.model_version,
            "rewarded": int(r.rewarded),
            "mean_reward": float(r.mean_reward),
        }
        for r in rows
    ]


def _latency(conn: Connection, bucket) -> list[dict]:
    """Per version and time bucket: completion latency p50 and p99 (nearest rank, as v_latency),
    and the error rate of the choices served (db.ERROR_FINISH_REASONS; outright failures left no
    record, they are in Prometheus)."""
    latency = conn.execute(
        text(f"""
        SELECT ts, model_version, MAX(n) AS completions,
               MIN(CASE WHEN rn >= 0.50 * n THEN latency_ms END) AS p50_ms,
               MIN(CASE WHEN rn >= 0.99 * n THEN latency_ms END) AS p99_ms
        FROM (SELECT ts, model_version, latency_ms,
                     ROW_NUMBER() OVER (PARTITION BY ts, model_version ORDER BY latency_ms) AS rn,
                     COUNT(*) OVER (PARTITION BY ts, model_version) AS n
              FROM (SELECT {bucket("created_at")} AS ts, model_version, latency_ms FROM completions) b) ranked
        GROUP BY ts, model_version ORDER BY ts, model_version
    """)
    )
    reasons = ", ".join(f"'{r}'" for r in db.ERROR_FINISH_REASONS)  # constants, inlined
    errors = {
        (r.ts, r.model_version): (int(r.choices), int(r.errors))
        for r in conn.execute(
            text(f"""
            SELECT ts, model_version, COUNT(*) AS choices, SUM(failed) AS errors
            FROM (SELECT {bucket("c.created_at")} AS ts, c.model_version,
                         CASE WHEN ch.finish_reason IN ({reasons}) THEN 1 ELSE 0 END AS failed
                  FROM completions c JOIN completion_choices ch ON ch.completion_id = c.completion_id) b
            GROUP BY ts, model_version
        """)
        )
    }
    out = []
    for r in latency:
        choices, failed_n = errors.get((r.ts, r.model_version), (0, 0))
        out.append(
            {
                "t": _iso_epoch(r.ts),
                "version": r.model_version,
                "completions": int(r.completions),
                "p50_ms": float(r.p50_ms),
                "p99_ms": float(r.p99_ms),
                "choices": choices,
                "errors": failed_n,
                "error_rate": failed_n / choices if choices else None,
            }
        )
    return out


def _volume(conn: Connection, bucket) -> dict[str, list[dict]]:
    completions = conn.execute(
        text(f"""
        SELECT ts, COUNT(*) AS n FROM (SELECT {bucket("created_at")} AS ts FROM completions) b GROUP BY ts ORDER BY ts
    """)
    )
    # by source too: an inferred select is the sink's reading of the next request, not a click
    events = conn.execute(
        text(f"""
        SELECT ts, type, source, COUNT(*) AS n FROM (SELECT {bucket("created_at")} AS ts, type, source FROM events) b
        GROUP BY ts, type, source ORDER BY ts, type, source
    """)
    )
    return {
        "completions": [{"t": _iso_epoch(r.ts), "n": int(r.n)} for r in completions],
        "events": [{"t": _iso_epoch(r.ts), "type": r.type, "source": r.source, "n": int(r.n)} for r in events],
    }


def _current_rollout(conn: Connection) -> dict | None:
    """The running (or paused) rollout, else the latest one, with every step decided so far."""
    ro, st = db.rollouts.c, db.rollout_steps.c
    active = case((ro.state.in_(("running", "paused")), 0), else_=1)
    row = conn.execute(select(db.rollouts).order_by(active, desc(ro.id)).limit(1)).mappings().first()
    if row is None:
        return None
    steps = conn.execute(
        select(st.step_index, st.weight, st.decision, st.evidence, st.decided_at)
        .where(st.rollout_id == row["id"])
        .order_by(st.decided_at, st.id)
    ).mappings()
    return _plain_row(row) | {"active": row["state"] in ("running", "paused"), "steps": [_plain_row(s) for s in steps]}


def _recent_rollouts(conn: Connection) -> list[dict]:
    ro = db.rollouts.c
    cols = (
        ro.id,
        ro.candidate_version,
        ro.stable_version,
        ro.state,
        ro.step_index,
        ro.reason,
        ro.started_at,
        ro.finished_at,
    )
    return [_plain_row(r) for r in conn.execute(select(*cols).order_by(desc(ro.id)).limit(RECENT_ROLLOUTS)).mappings()]


def _swaps(conn: Connection) -> list[dict]:
    sw = db.swap_events.c
    cols = (
        sw.at,
        sw.pool,
        sw.replica,
        sw.from_version,
        sw.to_version,
        sw.ok,
        sw.pause_s,
        sw.prepare_s,
        sw.tensors_reloaded,
        sw.fetched_bytes,
        sw.error,
    )
    rows = conn.execute(select(*cols).order_by(desc(sw.at), desc(sw.id)).limit(MAX_SWAPS)).mappings()
    return [_plain_row(r) for r in reversed(list(rows))]


def summarise_swaps(swaps: list[dict]) -> list[dict]:
    """Per target version: swaps, failures, median and worst pause of the successful ones."""
    out = []
    for v in sorted({s["to_version"] for s in swaps}):
        mine = [s for s in swaps if s["to_version"] == v]
        pauses = sorted(s["pause_s"] for s in mine if s["ok"])
        out.append(
            {
                "to_version": v,
                "swaps": len(mine),
                "failed": sum(not s["ok"] for s in mine),
                "p50_pause_s": pauses[(len(pauses) - 1) // 2] if pauses else None,  # nearest rank, as the SQL views
                "max_pause_s": pauses[-1] if pauses else None,
            }
        )
    return out


def _iso(t: datetime | None) -> str | None:
    return None if t is None else as_utc(t).isoformat()


def _iso_epoch(seconds: Any) -> str:
    return datetime.fromtimestamp(int(seconds), UTC).isoformat()


def _plain_row(row) -> dict:
    return {k: _iso(v) if isinstance(v, datetime) else v for k, v in dict(row).items()}
