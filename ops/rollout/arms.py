"""One version's traffic in a time window, read from the sink's tables as a `stats.Arm`.

The definitions match the analyst views (`v_choice_feedback`, `v_version_rewards`,
`v_latency`): a choice is shown when it has any event, accepted on a `select` or `edit`, an
error when the engine aborted it. Events the sink inferred from the next request
(`events.source = 'inferred'`, feedback/implicit.py) count for a choice only when it has no
explicit event: the editor's own word wins, whichever arrived first.

Evidence one client cannot forge. An editor token can post any number of events for the
completions it was served, so two rules keep a single client from deciding a rollout:
  - pinned completions (the request named its version, `model: flywheel@vN`) are left out:
    their client chose the arm, the router did not;
  - with `max_per_user`, each user (`user_hash`, keyed to the editor token: serving/routing.py)
    contributes at most that many completions, choices, shown choices and rewards to the arm:
    the earliest in the window, so the same rows give the same arm on every read.
What was left out is counted in the arm (`pinned`, `capped_shown`, `capped_rewards`), so the
decision's evidence shows it.
"""

from __future__ import annotations

import math
from datetime import datetime

from sqlalchemy import and_, case, func, select, true
from sqlalchemy.engine import Connection

from feedback import db
from ops.rollout.stats import Arm

ERROR_FINISH_REASONS = db.ERROR_FINISH_REASONS
ACCEPT_EVENTS = ("select", "edit")


def read_arm(
    conn: Connection, *, version: int, since: datetime, until: datetime, max_per_user: int | None = None
) -> Arm:
    """One version's unpinned traffic among completions created in [since, until), at most
    `max_per_user` of each kind of sample per user (None: no cap)."""
    c, ch, ev, rw = db.completions, db.completion_choices, db.events, db.rewards
    in_window = and_(c.c.model_version == version, c.c.created_at >= since, c.c.created_at < until)
    window = and_(in_window, c.c.pinned.is_(False))

    def within_cap(rank):
        return rank <= max_per_user if max_per_user is not None else true()

    pinned = conn.execute(select(func.count()).select_from(c).where(in_window, c.c.pinned.is_(True))).scalar()

    # Completions, the user's first `cap` of them: latency.
    per_user = func.row_number().over(partition_by=c.c.user_hash, order_by=(c.c.created_at, c.c.id))
    comps = select(c.c.latency_ms, per_user.label("urn")).where(window).subquery()
    kept = select(comps.c.latency_ms).where(within_cap(comps.c.urn)).subquery()
    ranked = select(
        kept.c.latency_ms,
        func.row_number().over(order_by=kept.c.latency_ms).label("rn"),
        func.count().over().label("n"),
    ).subquery()
    n_completions, p99 = conn.execute(
        select(func.max(ranked.c.n), func.min(case((ranked.c.rn >= 0.99 * ranked.c.n, ranked.c.latency_ms))))
    ).one()
    # ln() is not portable SQL (SQLite may lack it): the log moments come from the values.
    logs = [math.log(max(float(x), 1e-3)) for x in conn.execute(select(kept.c.latency_ms)).scalars()]
    log_mean = sum(logs) / len(logs) if logs else None
    log_var = sum((x - log_mean) ** 2 for x in logs) / (len(logs) - 1) if len(logs) > 1 else (0.0 if logs else None)

    # Choices with their feedback; each user's first `cap` choices, and first `cap` shown ones.
    explicit = ev.c.source == db.EXPLICIT
    n_explicit = func.sum(case((explicit, 1), else_=0))
    accepted_by = func.max(case((and_(explicit, ev.c.type.in_(ACCEPT_EVENTS)), 1), else_=0))
    accepted_inferred = func.max(case((and_(~explicit, ev.c.type.in_(ACCEPT_EVENTS)), 1), else_=0))
    per_choice = (
        select(
            c.c.user_hash,
            c.c.created_at,
            c.c.id,
            ch.c.choice_index,
            ch.c.finish_reason,
            case((func.count(ev.c.id) > 0, 1), else_=0).label("shown"),
            case((n_explicit > 0, accepted_by), else_=func.coalesce(accepted_inferred, 0)).label("accepted"),
        )
        .select_from(
            c.join(ch, ch.c.completion_id == c.c.completion_id).outerjoin(
                ev, and_(ev.c.completion_id == ch.c.completion_id, ev.c.choice_index == ch.c.choice_index)
            )
        )
        .where(window)
        .group_by(c.c.id, c.c.user_hash, c.c.created_at, ch.c.id, ch.c.choice_index, ch.c.finish_reason)
        .subquery()
    )
    order = (per_choice.c.created_at, per_choice.c.id, per_choice.c.choice_index)
    ranked_choices = select(
        per_choice,
        func.row_number().over(partition_by=per_choice.c.user_hash, order_by=order).label("urn"),
        func.row_number().over(partition_by=(per_choice.c.user_hash, per_choice.c.shown), order_by=order).label("srn"),
    ).subquery()
    q = ranked_choices.c
    shown_kept = and_(q.shown == 1, within_cap(q.srn))
    choices, choices_shown, errors, shown, accepted, shown_all = conn.execute(
        select(
            func.coalesce(func.sum(case((within_cap(q.urn), 1), else_=0)), 0),
            func.coalesce(func.sum(case((and_(within_cap(q.urn), q.shown == 1), 1), else_=0)), 0),
            func.coalesce(
                func.sum(case((and_(within_cap(q.urn), q.finish_reason.in_(ERROR_FINISH_REASONS)), 1), else_=0)), 0
            ),
            func.coalesce(func.sum(case((shown_kept, 1), else_=0)), 0),
            func.coalesce(func.sum(case((shown_kept, q.accepted), else_=0)), 0),
            func.coalesce(func.sum(q.shown), 0),
        )
    ).one()

    # Rewards, each user's first `cap`.
    per_user_reward = func.row_number().over(
        partition_by=c.c.user_hash, order_by=(c.c.created_at, c.c.id, rw.c.choice_index)
    )
    rewards = (
        select(rw.c.reward, per_user_reward.label("urn"))
        .select_from(rw.join(c, c.c.completion_id == rw.c.completion_id))
        .where(window, rw.c.model_version == version)
        .subquery()
    )
    n_rewards, total, squares, n_all_rewards = conn.execute(
        select(
            func.coalesce(func.sum(case((within_cap(rewards.c.urn), 1), else_=0)), 0),
            func.sum(case((within_cap(rewards.c.urn), rewards.c.reward))),
            func.sum(case((within_cap(rewards.c.urn), rewards.c.reward * rewards.c.reward))),
            func.count(),
        )
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
        choices_shown=int(choices_shown),
        shown=int(shown),
        accepted=int(accepted),
        rewards=int(n_rewards),
        reward_mean=mean,
        reward_var=var,
        pinned=int(pinned or 0),
        capped_shown=int(shown_all) - int(shown),
        capped_rewards=int(n_all_rewards) - int(n_rewards),
    )
