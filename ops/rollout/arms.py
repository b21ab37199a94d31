"""One version's traffic in a time window, read from the sink's tables as a `stats.Arm`.

The definitions match the analyst views (`v_choice_feedback`, `v_version_rewards`,
`v_latency`): a choice is shown when it has any event, accepted on a `select` or `edit`, an
error when the engine aborted it.
"""

from __future__ import annotations

import math
from datetime import datetime

from sqlalchemy import and_, case, func, select
from sqlalchemy.engine import Connection

from feedback import db
from ops.rollout.stats import Arm

ERROR_FINISH_REASONS = ("abort", "error")
ACCEPT_EVENTS = ("select", "edit")


def read_arm(conn: Connection, *, version: int, since: datetime, until: datetime) -> Arm:
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
