"""Auto mode: roll out the versions the learner announces on flywheel.versions.

An announcement is only a notification ("look at version N"): the learner records every
version in model_versions before it announces it, and that row is the truth about the
version (its gate result, its sha256). A version is rolled out only when this deployment's
model_versions has it, it passed the gate there, and its sha256 is the announced one, so an
announcement from another deployment sharing the topic never rolls out here, even one that
reuses a version number.

The controller consumes `flywheel.versions` in the consumer group `rollout.group_id`, so a
restarted controller resumes where it left off, and rolls out the newest announced version
that qualifies, is newer than stable and has no rollout yet; a version announced while
another rollout runs waits for it to finish (a newer announcement supersedes it). Mode `all`
skips the canary: the version becomes stable at once (recorded as a promoted rollout).

The announcement is the fast path, not the only one: `AutoStarter.catch_up` reads model_versions
itself and starts the newest version that qualifies once it has waited `rollout.unannounced_after_s`
without a rollout (newer than stable and than every rollout's candidate, so a version an
announcement superseded stays superseded). A lost announcement delays a rollout, never stops it.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.engine import Engine, Row

from feedback import db, pools
from feedback.core.clock import as_utc, utcnow
from feedback.schemas import MalformedMessage, ModelVersion, decode
from ops.rollout.commands import start_rollout
from ops.rollout.rows import Rollout, RolloutError, active, latest, recorded_version
from ops.rollout.settings import RolloutSection, RolloutSettings

log = logging.getLogger("flywheel.rollout")


def refusal(msg: ModelVersion, recorded: Row | None) -> str | None:
    """Why the announced version must not be rolled out, judged on this deployment's record of
    it (`recorded`: its model_versions row, None if there is none); None if it may be."""
    if recorded is None:
        return f"version {msg.version} ({msg.uri}) is not in this deployment's model_versions; ignored"
    if recorded.sha256 != msg.sha256:
        return (
            f"version {msg.version} ({msg.uri}) is not the one in this deployment's model_versions "
            f"(sha256 {msg.sha256[:12]}, recorded {recorded.sha256[:12]}); ignored"
        )
    if not recorded.gate_passed:
        return f"version {msg.version} failed the gate ({recorded.gate_reason or 'no reason'}); not rolled out"
    return None


def start_announced(engine: Engine, msg: ModelVersion, section: RolloutSection) -> tuple[str, Rollout | None, str]:
    """Act on one announced version: ("started", rollout, why), ("waiting", None, why) while another
    rollout is active, or ("skipped", None, why). Idempotent: a version with a rollout is skipped."""
    with engine.connect() as conn:
        why = refusal(msg, recorded_version(conn, version=msg.version))
        if why is not None:
            return "skipped", None, why
        if latest(conn, version=msg.version) is not None:
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
    """Reads flywheel.versions and starts rollouts for the announced versions that qualify; commits
    offsets only once everything read is handled, so a version still waiting for the active
    rollout is read again after a restart."""

    def __init__(self, settings: RolloutSettings, engine: Engine):
        self.settings, self.engine = settings, engine
        self.consumer = None
        self.queue: list = []  # (ModelVersion, TopicPartition, offset) read but not yet offered
        self.pending = None  # the newest announcement that qualified, not yet started
        self.offsets: dict = {}  # TopicPartition -> next offset to commit
        self.caught_up: set[int] = set()  # versions catch_up acted on
        self.lock = threading.Lock()  # poll (the controller's versions thread) and catch_up (its loop)

    def poll(self) -> list[str]:
        # Late: kafka-python loads only where auto mode runs, not for every `flywheel rollout` command.
        from kafka import TopicPartition

        from feedback import bus

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
        with self.lock:
            return self._offer()

    def _offer(self) -> list[str]:
        lines = []
        while self.queue:  # the newest qualifying announcement supersedes older pending ones
            msg, tp, offset = self.queue[0]
            with self.engine.connect() as conn:
                why = refusal(msg, recorded_version(conn, version=msg.version))
            if why is not None:
                lines.append(f"rollout auto: {why}")
            elif self.pending is None or msg.version > self.pending.version:
                self.pending = msg
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

    def catch_up(self) -> list[str]:
        """Start the newest recorded version that qualifies, once it has waited `rollout.unannounced_after_s`
        without a rollout, as if announced (see the module docstring); reads SQL only, so it works
        while the broker is away."""
        with self.lock:
            return self._catch_up()

    def _catch_up(self) -> list[str]:
        if self.pending is not None:  # an announcement is being acted on
            return []
        cfg = self.settings.rollout
        mv, r = db.model_versions.c, db.rollouts.c
        with self.engine.connect() as conn:
            known = (pools.current_stable(conn), conn.execute(select(func.max(r.candidate_version))).scalar())
            floor = max((v for v in known if v is not None), default=-1)  # v0 counts: no `or`
            row = conn.execute(
                select(db.model_versions)
                .where(mv.version > floor, mv.gate_passed.is_(True))
                .order_by(mv.version.desc())
                .limit(1)
            ).first()
        # The newest only: while its announcement may still come, it supersedes the older ones.
        if row is None or row.version in self.caught_up:
            return []
        if as_utc(row.created_at) > utcnow() - timedelta(seconds=cfg.unannounced_after_s):
            return []
        msg = ModelVersion(
            version=row.version, parent=row.parent, kind=row.kind, uri=row.uri, sha256=row.sha256, gate_passed=True
        )
        outcome, _, why = start_announced(self.engine, msg, cfg)
        if outcome == "waiting":
            return []
        self.caught_up.add(row.version)  # started, or refused for good: not again every poll
        return [f"rollout auto: {why} (recorded {cfg.unannounced_after_s:g}+ s ago without an announcement acted on)"]

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
