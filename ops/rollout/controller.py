"""The controller: one stateless pass (`tick`) over the latest rollout, and the loop that runs it.

A pass repairs the serving pools (topology.reconcile), then, when the running rollout's step
is due, reads both arms for the step's window (arms.py), asks `stats.decide` and commits the
decision with a compare-and-set, so any number of controllers may run. `run_controller` calls
it every `rollout.poll_s` (after auto mode's catch-up from SQL; the versions topic is read by a
thread of its own) and survives database and broker failures; it runs in a thread (the demo) or as `flywheel rollout run`.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from feedback import db
from feedback.core.clock import as_utc, utcnow
from feedback.core.errors import UserError, first_line
from feedback.db import PROMOTED, ROLLED_BACK, RUNNING
from ops.rollout.arms import read_arm
from ops.rollout.auto import AutoStarter
from ops.rollout.rows import Rollout, RolloutError, compare_and_set, get, insert_step, latest
from ops.rollout.settings import RolloutSettings
from ops.rollout.stats import ADVANCE, HOLD, PROMOTE, ROLLBACK, Decision, decide
from ops.rollout.topology import apply_pools, reconcile

log = logging.getLogger("flywheel.rollout")

S = db.rollout_steps


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
        at = as_utc(row.decided_at)
        last = max(last, at)
        if row.decision == ADVANCE:
            window_start, holds = at, 0
        elif row.decision == HOLD and row.step_index == r.step_index:
            holds += 1
    return StepClock(window_start=window_start, last_decision=last, holds=holds)


def tick(engine: Engine, *, now: datetime | None = None) -> Outcome | None:
    """One controller pass: repair the pools, then evaluate the running rollout if its step is due.

    Stateless: everything comes from SQL, so any process may call it at any time; it returns the
    evaluation, or None when nothing was due (or another process decided first).
    """
    now = now or utcnow()
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
        cap = r.policy.max_per_user
        canary = read_arm(conn, version=r.candidate_version, since=clock.window_start, until=now, max_per_user=cap)
        stable = read_arm(conn, version=r.stable_version, since=stable_since, until=now, max_per_user=cap)
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
        if not compare_and_set(conn, r, **values):
            return None  # an operator or another controller acted on this step first
        insert_step(
            conn,
            rollout_id=r.id,
            step_index=r.step_index,
            weight=r.weight,
            decision=d.action,
            evidence=evidence,
            at=now,
        )
        after = get(conn, rollout_id=r.id)
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
    start rollouts for announced versions, read by a thread of its own, and for versions whose
    announcement never came). Database and Kafka failures are logged and retried; the loop never
    dies of them. Usable in a thread (the demo) or as `flywheel rollout run`."""
    cfg = settings.rollout
    own_engine = engine is None
    engine = engine or db.make_engine(settings.database_url, echo=settings.database.echo)
    starter = AutoStarter(settings, engine) if cfg.auto else None
    restore = _install_signal_handlers(stop) if handle_signals else None
    progress(f"rollout controller: every {cfg.poll_s:g}s{', auto mode (' + cfg.mode + ')' if cfg.auto else ''}")

    def evaluate() -> list[str]:
        out = tick(engine)
        return [out.line()] if out is not None else []

    # The versions topic and the database fail independently, and a Kafka client can hang where
    # it cannot fail: the consumer runs in a thread of its own, so nothing it does stops the
    # controller from judging the active rollout or from taking up versions from SQL.
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    consuming = None
    if starter is not None:
        consuming = threading.Thread(
            target=_each_poll,
            args=([("versions", starter.poll)], stop, cfg.poll_s, lines.put),
            name="rollout-versions",
            daemon=True,
        )
        consuming.start()
    passes = [("unannounced versions", starter.catch_up)] if starter is not None else []
    passes.append(("rollouts", evaluate))

    try:
        _each_poll(passes, stop, cfg.poll_s, progress, before=lambda: _drain(lines, progress))
    finally:
        if consuming is not None:
            consuming.join(timeout=cfg.poll_s + 5)
            if not consuming.is_alive():  # a consumer stuck inside kafka-python is left to the process's exit
                starter.close()
        _drain(lines, progress)
        if own_engine:
            engine.dispose()
        if restore:
            restore()


def _drain(lines: queue.SimpleQueue, progress: Callable[[str], None]) -> None:
    """Say what the versions thread has said since the last pass."""
    while not lines.empty():
        progress(lines.get())


def _each_poll(
    passes: list[tuple[str, Callable[[], list[str]]]],
    stop: threading.Event,
    poll_s: float,
    say: Callable[[str], None],
    before: Callable[[], None] = lambda: None,
) -> None:
    """Run each pass every `poll_s` until `stop`, saying what it returns. A failing pass (a database
    or broker hiccup, or a bug) is logged once per distinct failure and tried again; never fatal."""
    failing: dict[str, str] = {}
    while not stop.is_set():
        before()
        for name, work in passes:
            try:
                for line in work():
                    say(line)
                if failing.pop(name, None):
                    say(f"rollout controller: {name} recovered")
            except Exception as e:
                what = first_line(e)
                if failing.get(name) != what:  # once per distinct failure, not every poll
                    bug = (
                        not isinstance(e, (SQLAlchemyError, UserError)) and type(e).__module__.split(".")[0] != "kafka"
                    )
                    log.warning("rollout controller (%s): %s; retrying every %gs", name, what, poll_s, exc_info=bug)
                failing[name] = what
        stop.wait(poll_s)


def _install_signal_handlers(stop: threading.Event) -> Callable[[], None] | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())
    return lambda: [signal.signal(sig, h) for sig, h in previous.items()]
