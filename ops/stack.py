"""The local stack: `flywheel up | down | status`.

`up` starts what Flywheel runs itself (a single-node Kafka broker unless an external
cluster is configured), creates the topics, and migrates the database. `down` stops only
what `up` started. `status` reports each part's health.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from feedback import bus, db
from feedback.core.config import FlywheelSettings
from feedback.core.errors import UserError
from ops import kafka_broker


@dataclass
class UpResult:
    broker_pid: int | None
    created_topics: list[str]
    database: str
    revision: str | None


def up(s: FlywheelSettings, progress: Callable[[str], None]) -> UpResult:
    pid = None
    if s.kafka.managed:
        pid = kafka_broker.start(s, progress)
        paths = kafka_broker.BrokerPaths.of(s)

        def alive() -> None:
            if reason := kafka_broker.broker_exited_early(paths, pid):
                paths.pid.unlink(missing_ok=True)
                raise UserError(f"Kafka broker exited during start-up: {reason} (log: {paths.log})")

        progress(f"waiting for Kafka on {s.kafka.bootstrap}")
        if s.kafka.local_listener == "sasl_ssl":
            # Only the broker's own login exists until it sets the configured user's.
            bus.wait_until_ready(kafka_broker.broker_login(s), s.kafka.start_timeout_s, alive)
            progress(f"setting the SCRAM login of Kafka user {s.kafka.sasl_username}")
            kafka_broker.set_client_login(s, s.kafka.start_timeout_s)
        bus.wait_until_ready(s.kafka, s.kafka.start_timeout_s, alive)
    else:
        progress(f"checking Kafka cluster at {s.kafka.bootstrap}")
        bus.wait_until_ready(s.kafka, min(s.kafka.start_timeout_s, 15.0))
    progress("creating topics")
    created = bus.ensure_topics(s.kafka)
    progress("migrating the database")
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    revision = db.current_revision(engine)
    engine.dispose()
    return UpResult(pid, created, engine.url.render_as_string(hide_password=True), revision)


def down(s: FlywheelSettings) -> int | None:
    """Stop the broker `up` started; an external cluster is never touched."""
    return kafka_broker.stop(s) if s.kafka.managed else None


@dataclass
class Status:
    kafka_bootstrap: str
    kafka_managed: bool
    broker_pid: int | None
    kafka_healthy: bool
    kafka_error: str | None
    topics: list[bus.TopicInfo] = field(default_factory=list)
    database: str = ""
    db_revision: str | None = None
    db_head: str = ""
    db_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.kafka_healthy and self.db_error is None and self.db_revision == self.db_head


def status(s: FlywheelSettings) -> Status:
    pid = kafka_broker.recorded_pid(kafka_broker.BrokerPaths.of(s)) if s.kafka.managed else None
    st = Status(s.kafka.bootstrap, s.kafka.managed, pid, kafka_healthy=False, kafka_error=None)
    if s.kafka.managed and pid is None:
        st.kafka_error = "not running (start it with `flywheel up`)"
    else:
        try:
            st.topics = bus.describe_topics(s.kafka)
            st.kafka_healthy = True
        except UserError as e:
            st.kafka_error = str(e)
    engine = db.make_engine(s.database_url)
    st.database = engine.url.render_as_string(hide_password=True)
    st.db_head = db.head_revision()
    try:
        st.db_revision = db.current_revision(engine)
    except UserError as e:
        st.db_error = str(e)
    engine.dispose()
    return st
