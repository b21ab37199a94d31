"""Auto mode: roll out the versions the learner announces on flywheel.versions.

The controller consumes `flywheel.versions` in the consumer group `rollout.group_id`, so a
restarted controller resumes where it left off, and rolls out the newest announced version
that passed the learner's gate, is newer than stable and has no rollout yet; a version
announced while another rollout runs waits for it to finish (a newer announcement supersedes
it). Mode `all` skips the canary: the version becomes stable at once (recorded as a promoted
rollout).
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from feedback import db, pools
from feedback.schemas import ModelVersion
from ops.rollout.commands import start_rollout
from ops.rollout.rows import Rollout, RolloutError, active
from ops.rollout.settings import RolloutSection, RolloutSettings

log = logging.getLogger("flywheel.rollout")

R = db.rollouts


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
