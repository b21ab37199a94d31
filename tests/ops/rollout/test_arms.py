"""One arm's traffic read from SQL (arms.read_arm), against rows whose counts are known."""

import math
from datetime import timedelta

import pytest
from sqlalchemy import insert

from feedback import db
from ops.rollout.arms import read_arm
from tests.ops.rollout.traffic import CANDIDATE, STABLE, T0, serve


def latencies(engine, version, values, *, at=T0):
    """Completions of `version` with these latencies (ms), one a second from `at`, no choices."""
    rows = [
        dict(
            completion_id=f"lat{version}-{at.isoformat()}-{i}",
            model_version=version,
            user_hash="u",
            prompt_token_ids=[1],
            summary_ids=[],
            n_choices=1,
            latency_ms=float(v),
            created_at=at + timedelta(seconds=i),
        )
        for i, v in enumerate(values)
    ]
    with engine.begin() as conn:
        conn.execute(insert(db.completions), rows)


def test_p99_is_the_nearest_rank_and_the_log_moments_come_from_the_window(engine):
    """The p99 as v_latency computes it: the smallest value with 99% of the values at or below it."""
    latencies(engine, STABLE, range(1, 101))
    latencies(engine, CANDIDATE, [7.0, 3.0, 10.0, 1.0, 2.0, 4.0, 9.0, 5.0, 6.0, 8.0])
    latencies(engine, CANDIDATE, [5000.0], at=T0 + timedelta(seconds=200))  # outside the window
    until = T0 + timedelta(seconds=200)
    with engine.connect() as conn:
        stable = read_arm(conn, version=STABLE, since=T0, until=until)
        canary = read_arm(conn, version=CANDIDATE, since=T0, until=until)
        empty = read_arm(conn, version=99, since=T0, until=until)
    assert (stable.completions, stable.p99_latency_ms) == (100, 99.0)
    assert (canary.completions, canary.p99_latency_ms) == (10, 10.0)
    logs = [math.log(v) for v in range(1, 11)]
    mean = sum(logs) / len(logs)
    assert canary.log_latency_mean == pytest.approx(mean)
    assert canary.log_latency_var == pytest.approx(sum((x - mean) ** 2 for x in logs) / 9)
    assert (empty.completions, empty.p99_latency_ms, empty.log_latency_mean, empty.choices) == (0, None, None, 0)


def test_choices_feedback_and_rewards(sqlite_engine):
    serve(sqlite_engine, STABLE, 200, start=T0, accept=0.4, errors=0.1)
    with sqlite_engine.connect() as conn:
        arm = read_arm(conn, version=STABLE, since=T0, until=T0 + timedelta(minutes=1))
    assert (arm.choices, arm.shown, arm.accepted, arm.errors, arm.rewards) == (200, 200, 80, 20, 200)
    assert arm.choices_shown == 200
    assert arm.reward_mean == pytest.approx(0.4 * 0.75 + 0.6 * -0.25)


def test_suggestion_rate_counts_shown_among_each_users_capped_choices(engine):
    """`choices_shown` is a share of `choices`: the shown ones among each user's first
    max_per_user choices, not each user's first max_per_user shown ones."""
    serve(engine, CANDIDATE, 100, start=T0, accept=0.1, shown=0.3)  # 100 users, 30% shown
    serve(engine, CANDIDATE, 20, start=T0, accept=0.0, shown=0.0, user="ana")  # ana's first 20: none shown
    serve(engine, CANDIDATE, 40, start=T0 + timedelta(seconds=55), accept=0.0, user="ana")  # then 40 shown
    with engine.connect() as conn:
        arm = read_arm(conn, version=CANDIDATE, since=T0, until=T0 + timedelta(minutes=2), max_per_user=20)
    assert (arm.choices, arm.choices_shown) == (120, 30)  # ana adds 20 choices, none of them shown
    assert (arm.shown, arm.capped_shown) == (50, 20)  # her first 20 shown ones are later choices


def test_pinned_completions_are_left_out_and_counted(engine):
    """A client that pins `flywheel@vN` chose the arm itself: none of its traffic is evidence."""
    serve(engine, CANDIDATE, 100, start=T0, accept=0.2)
    serve(engine, CANDIDATE, 500, start=T0, accept=1.0, user="mallory", pinned=True)
    with engine.connect() as conn:
        arm = read_arm(conn, version=CANDIDATE, since=T0, until=T0 + timedelta(minutes=1))
    assert (arm.completions, arm.choices, arm.shown, arm.accepted, arm.rewards) == (100, 100, 100, 20, 100)
    assert arm.pinned == 500 and arm.reward_mean == pytest.approx(0.2 * 0.75 + 0.8 * -0.25)


def test_each_user_contributes_at_most_max_per_user_samples_their_earliest(engine):
    serve(engine, CANDIDATE, 100, start=T0, accept=0.2)  # 100 users, one completion each
    serve(engine, CANDIDATE, 30, start=T0, accept=0.0, user="ana")  # ana's first 30: ignored
    serve(engine, CANDIDATE, 60, start=T0 + timedelta(seconds=55), accept=1.0, user="ana")  # then 60 accepts
    until = T0 + timedelta(minutes=2)
    with engine.connect() as conn:
        free = read_arm(conn, version=CANDIDATE, since=T0, until=until)
        capped = read_arm(conn, version=CANDIDATE, since=T0, until=until, max_per_user=20)
    assert (free.shown, free.accepted, free.rewards, free.capped_shown) == (190, 80, 190, 0)
    # ana's earliest 20, all ignored, count; her 70 later ones do not
    counts = (capped.completions, capped.choices, capped.shown, capped.accepted, capped.rewards)
    assert counts == (120, 120, 120, 20, 120)
    assert (capped.capped_shown, capped.capped_rewards) == (70, 70)
    assert capped.reward_mean == pytest.approx((20 * 0.75 - 80 * 0.25 - 20 * 0.25) / 120)


def test_an_inferred_event_counts_only_where_no_explicit_one_exists(engine):
    """Implicit feedback (events.source = 'inferred') fills in for clients that send no events; the
    editor's own events win where both exist."""
    rows, events = [], []
    for i, (explicit, inferred) in enumerate(
        [(None, "select"), (None, "dismiss"), ("dismiss", "select"), ("select", "dismiss"), ("view", None)]
    ):
        cid = f"inf-{i}"
        rows.append(
            dict(
                completion_id=cid,
                model_version=CANDIDATE,
                user_hash=f"u{i}",
                prompt_token_ids=[1],
                summary_ids=[],
                n_choices=1,
                latency_ms=10.0,
                created_at=T0 + timedelta(seconds=i),
            )
        )
        for source, kind in (("explicit", explicit), ("inferred", inferred)):
            if kind is not None:
                events.append(
                    dict(
                        event_id=f"{cid}-{source}",
                        completion_id=cid,
                        choice_index=0,
                        type=kind,
                        created_at=T0 + timedelta(seconds=i),
                        source=source,
                    )
                )
    choices = [
        dict(completion_id=r["completion_id"], choice_index=0, token_ids=[5], logprobs=[-0.1], n_chars=3) for r in rows
    ]
    with engine.begin() as conn:
        conn.execute(insert(db.completions), rows)
        conn.execute(insert(db.completion_choices), choices)
        conn.execute(insert(db.events), events)
    with engine.connect() as conn:
        arm = read_arm(conn, version=CANDIDATE, since=T0, until=T0 + timedelta(minutes=1))
    # Accepted: inf-0 (inferred alone) and inf-3 (explicit select beats an inferred dismiss);
    # not inf-2, whose explicit dismiss beats the inferred select.
    assert (arm.choices, arm.shown, arm.accepted) == (5, 5, 2)
