"""Synthetic versions and traffic for the rollout tests: rows where the sink would write them.

Three versions (stable, a candidate, one that failed the gate) in model_versions, and
`serve()` to add completions with their choices, events and rewards at chosen times, so that
a test that drives the controller with an explicit clock knows each step's window exactly.
"""

import hashlib
from datetime import UTC, datetime, timedelta

from sqlalchemy import insert

from feedback import db, pools
from ops.rollout import commands, rows
from ops.rollout.settings import RolloutSection

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
STABLE, CANDIDATE, GATE_FAILED = 1, 2, 3
SECTION = RolloutSection(weights=[5, 25, 50, 100], interval_s=60, min_samples=100, max_holds=2)


def sha256_of(version: int) -> str:
    """The manifest digest record_versions gives `version`."""
    return hashlib.sha256(str(version).encode()).hexdigest()


def record_versions(engine, versions=((STABLE, True), (CANDIDATE, True), (GATE_FAILED, False))):
    """(version, gate passed) pairs into model_versions, as the learner records them."""
    with engine.begin() as conn:
        for v, passed in versions:
            conn.execute(
                insert(db.model_versions).values(
                    version=v,
                    parent=None,
                    kind="full",
                    uri=f"file:///w/v{v}",
                    sha256=sha256_of(v),
                    size_bytes=1,
                    full_size_bytes=1,
                    gate_passed=passed,
                    gate_reason=None if passed else "reward hacking suspected",
                    metrics={},
                    created_at=T0 - timedelta(days=1),
                )
            )


_serial = iter(range(10**9))


def serve(
    engine,
    version,
    n,
    *,
    start,
    span_s=50.0,
    accept=0.4,
    errors=0.0,
    latency_ms=50.0,
    user=None,
    pinned=False,
    shown=1.0,
):
    """`n` served single-choice completions of `version` in [start, start + span_s): the first
    `shown` share of every 100 shown (a `view`; all by default), the first `accept` share of every
    100 also selected (so `accept` <= `shown`), `errors` share aborted; each
    with the reward the sink would give it (0.75 accepted, -0.25 ignored). Each completion comes
    from a user of its own, or all from `user`; `pinned`: the requests named the version."""
    comps, choices, events, rewards = [], [], [], []
    for i in range(n):
        serial = next(_serial)
        cid = f"c{version}-{serial}"
        at = start + timedelta(seconds=span_s * i / n)
        accepted = (i % 100) < accept * 100
        comps.append(
            dict(
                completion_id=cid,
                model_version=version,
                user_hash=user or f"u{serial}",
                prompt_token_ids=[1],
                summary_ids=[],
                n_choices=1,
                latency_ms=latency_ms + i % 10,
                created_at=at,
                pinned=pinned,
            )
        )
        choices.append(
            dict(
                completion_id=cid,
                choice_index=0,
                token_ids=[5],
                logprobs=[-0.1],
                n_chars=4,
                text="x = 1",
                finish_reason="abort" if (i % 100) < errors * 100 else "stop",
            )
        )
        if (i % 100) < shown * 100:
            events.append(dict(event_id=f"{cid}-v", completion_id=cid, choice_index=0, type="view", created_at=at))
        if accepted:
            events.append(
                dict(
                    event_id=f"{cid}-s",
                    completion_id=cid,
                    choice_index=0,
                    type="select",
                    select_kind="full",
                    created_at=at,
                )
            )
        rewards.append(
            dict(
                completion_id=cid,
                choice_index=0,
                model_version=version,
                reward=0.75 if accepted else -0.25,
                components={},
                outcome="select" if accepted else "ignored",
            )
        )
    with engine.begin() as conn:
        conn.execute(insert(db.completions), comps)
        conn.execute(insert(db.completion_choices), choices)
        if events:
            conn.execute(insert(db.events), events)
        conn.execute(insert(db.rewards), rewards)


def both_arms(engine, start, weight, *, total=4000, canary_accept=0.4, stable_accept=0.4, **canary_kw):
    n_canary = max(int(total * weight / 100), 0)
    serve(engine, CANDIDATE, n_canary, start=start, accept=canary_accept, **canary_kw)
    serve(engine, STABLE, total - n_canary, start=start, accept=stable_accept)


def steps_of(engine, rollout_id):
    with engine.connect() as conn:
        return rows.steps(conn, rollout_id=rollout_id)


def start(engine, section=SECTION, **kw):
    pools.set_stable(engine, STABLE)  # what serving runs before the rollout
    return commands.start_rollout(engine, CANDIDATE, section=section, now=T0, **kw)
