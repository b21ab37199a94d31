"""SQL tables (SQLAlchemy Core), engines and migrations.

Every table Flywheel keeps is defined here, whichever process writes it. Unique keys carry idempotency: `completion_id`,
`(completion_id, choice_index)`, `event_id`, `version`. Events have no foreign key to
completions on purpose: an event may arrive before its completion record.

The sink keeps its bookkeeping here too: `pending_events` (events waiting for their
completion), `dead_letters` (what could not be stored, with its Kafka coordinates; unique
on them, so a replay adds nothing) and `reward_due` (rewards to compute when a feedback
window closes). Analyst views (`v_*`) are created by migration 0002.

Alembic owns the schema (`feedback/migrations`); `upgrade()` runs it. The tables below are
the single description both the migrations and the code read.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    false,
    func,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, DisconnectionError, NoSuchModuleError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.pool import NullPool

from feedback.core.errors import UserError, first_line
from feedback.core.files import private_dir, private_file

# Explicit constraint names: migrations can then drop or alter them on every backend.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
metadata = MetaData(naming_convention=NAMING)

TS = DateTime(timezone=True)
# Auto-incrementing surrogate keys: BIGINT on PostgreSQL, INTEGER (the rowid) on SQLite.
Id = BigInteger().with_variant(Integer(), "sqlite")

# `events.source`: an editor sent the event, or the sink inferred it from the user's next request
# in the same file. Where a choice has explicit events, its inferred ones are ignored (reward, arms).
EXPLICIT, INFERRED = "explicit", "inferred"

completions = Table(
    "completions",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("completion_id", String(64), nullable=False, unique=True),
    Column("model_version", Integer, nullable=False, index=True),
    Column("user_hash", String(128), nullable=False),
    Column("session_id", String(128)),
    Column("language", String(64)),
    Column("filepath", String(1024)),
    Column("prompt_token_ids", JSON, nullable=False),
    Column("prompt_text", Text, comment="dropped after retention_days; token ids stay"),
    Column("summary_ids", JSON, nullable=False),
    Column("n_choices", Integer, nullable=False),
    Column("latency_ms", Float, nullable=False),
    Column("created_at", TS, nullable=False, index=True),
    Column("ingested_at", TS, nullable=False, server_default=func.now()),
    Column(
        "pinned",
        Boolean,
        nullable=False,
        server_default=false(),
        comment="served for a request that pinned its version (model: name@vN); kept out of rollout arms and training",
    ),
    Column(
        "before_cursor",
        Text,
        comment="the file's text before the cursor (at most 1024 characters); dropped after retention_days",
    ),
    Column(
        "after_cursor",
        Text,
        comment="the file's text after the cursor (at most 1024 characters); dropped after retention_days",
    ),
    # The sink's implicit feedback finds a user's previous completion in the same file by it.
    Index(None, "user_hash", "created_at"),
)

# A choice the engine did not finish ('abort'; 'error' should an engine report it): an error of
# what was served, as the rollout controller and the dashboard count it. A request that failed
# outright left no record (it is in Prometheus: flywheel_completion_errors_total).
ERROR_FINISH_REASONS = ("abort", "error")

completion_choices = Table(
    "completion_choices",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("completion_id", String(64), ForeignKey("completions.completion_id", ondelete="CASCADE"), nullable=False),
    Column("choice_index", Integer, nullable=False),
    Column("token_ids", JSON, nullable=False),
    Column("logprobs", JSON, nullable=False, comment="behaviour policy, one per token"),
    Column("routing", JSON, comment="serving engine's expert ids per layer, when exposed"),
    Column("text", Text, comment="dropped after retention_days; token ids stay"),
    Column("n_chars", Integer, nullable=False),
    Column("finish_reason", String(16)),
    UniqueConstraint("completion_id", "choice_index"),
)

events = Table(
    "events",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("event_id", String(36), nullable=False, unique=True),
    Column("completion_id", String(64), nullable=False, index=True),
    Column("choice_index", Integer, nullable=False),
    Column("type", String(16), nullable=False),
    Column("select_kind", String(8)),
    Column("accepted_chars", Integer),
    Column("kept_text", Text),
    Column("view_id", String(128)),
    Column("elapsed_ms", Integer),
    Column("created_at", TS, nullable=False, index=True),
    Column("ingested_at", TS, nullable=False, server_default=func.now()),
    Column(
        "source",
        String(16),
        nullable=False,
        server_default=EXPLICIT,
        comment="explicit: sent by the editor | inferred: read by the sink from the next request (feedback/implicit.py)",
    ),
)

rewards = Table(
    "rewards",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("completion_id", String(64), nullable=False),
    Column("choice_index", Integer, nullable=False),
    Column("model_version", Integer, nullable=False, index=True),
    Column("reward", Float, nullable=False),
    Column("components", JSON, nullable=False, comment="how the reward was computed"),
    Column("computed_at", TS, nullable=False, server_default=func.now()),
    Column(
        "outcome",
        String(16),
        comment="withheld | no_suggestion | edit | select | dismiss | ignored | unseen (feedback/reward.py)",
    ),
    UniqueConstraint("completion_id", "choice_index"),
)

# The sink's own bookkeeping (feedback/sink/loop.py). Kafka coordinates are named kafka_* so that
# analysts need not quote the reserved words `offset` and `partition`.

pending_events = Table(
    "pending_events",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("event_id", String(36), nullable=False, unique=True),
    Column("completion_id", String(64), nullable=False, index=True),
    Column(
        "payload",
        LargeBinary,
        nullable=False,
        comment="the Kafka message value, decoded again when its completion arrives",
    ),
    Column("kafka_topic", String(255), nullable=False),
    Column("kafka_partition", Integer, nullable=False),
    Column("kafka_offset", BigInteger, nullable=False),
    Column(
        "held_at",
        TS,
        nullable=False,
        index=True,
        comment="when the sink first held it; dead-lettered after the grace period",
    ),
    comment="events whose completion record has not arrived yet",
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("reason", String(32), nullable=False, index=True, comment="malformed | unknown_completion | rejected"),
    Column("error", Text, nullable=False),
    Column("kafka_topic", String(255), nullable=False),
    Column("kafka_partition", Integer, nullable=False),
    Column("kafka_offset", BigInteger, nullable=False),
    Column("key", Text),
    Column("payload", LargeBinary, comment="the raw message value; dropped after retention_days"),
    Column("completion_id", String(64), index=True),
    Column("event_id", String(36)),
    Column("dead_at", TS, nullable=False),
    UniqueConstraint("kafka_topic", "kafka_partition", "kafka_offset"),
    comment="messages the sink could not store, never dropped silently",
)

reward_due = Table(
    "reward_due",
    metadata,
    Column("completion_id", String(64), primary_key=True),
    Column(
        "due_at", TS, nullable=False, index=True, comment="when its feedback window closes (or now, for a late event)"
    ),
    comment="completions whose reward is still to be computed",
)

model_versions = Table(
    "model_versions",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("parent", Integer),
    Column("kind", String(8), nullable=False),
    Column("uri", Text, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("full_size_bytes", BigInteger, nullable=False),
    Column("gate_passed", Boolean, nullable=False),
    Column("gate_reason", Text),
    Column("metrics", JSON, nullable=False),
    Column("created_at", TS, nullable=False),
)

# The states of a rollout (`rollouts.state`), spelled once: the controller (ops/rollout) writes
# them, and feedback/pools.current_stable reads what a finished one left stable.
RUNNING, PAUSED, PROMOTED, ROLLED_BACK, ABORTED = "running", "paused", "promoted", "rolled_back", "aborted"
ROLLOUT_STATES = (RUNNING, PAUSED, PROMOTED, ROLLED_BACK, ABORTED)
ACTIVE_ROLLOUT_STATES = (RUNNING, PAUSED)
"""An active rollout owns the canary pool; at most one is active at a time."""

rollouts = Table(
    "rollouts",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("candidate_version", Integer, nullable=False, index=True),
    Column("stable_version", Integer, nullable=False),
    Column("state", String(16), nullable=False, comment=" | ".join(ROLLOUT_STATES)),
    Column("step_index", Integer, nullable=False),
    Column("weights", JSON, nullable=False, comment="canary traffic share per step, percent"),
    Column("interval_s", Float, nullable=False),
    Column("thresholds", JSON, nullable=False),
    Column("min_samples", Integer, nullable=False),
    Column("reason", Text),
    Column("started_at", TS, nullable=False, server_default=func.now()),
    Column("updated_at", TS, nullable=False, server_default=func.now()),
    Column("finished_at", TS),
)

rollout_steps = Table(
    "rollout_steps",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("rollout_id", Id, ForeignKey("rollouts.id", ondelete="CASCADE"), nullable=False),
    Column("step_index", Integer, nullable=False),
    Column("weight", Float, nullable=False),
    Column(
        "decision", String(16), nullable=False, comment="advance | hold | promote | rollback | pause | resume | abort"
    ),
    Column("evidence", JSON, nullable=False, comment="the metrics and test results behind the decision"),
    Column("decided_at", TS, nullable=False, server_default=func.now()),
    Index(None, "rollout_id", "step_index"),
)


# Serving topology (migration 0003): which version each replica pool should serve and the
# canary's traffic share. The rollout controller (or `flywheel swap`) writes it; serving
# replicas and the ingress poll it (feedback/pools.py), so the state lives in one place and
# survives restarts of every process.
serving_pools = Table(
    "serving_pools",
    metadata,
    Column("pool", String(32), primary_key=True, comment="stable | canary"),
    Column("version", Integer, nullable=True, comment="target model version; NULL: the pool serves no users"),
    Column("traffic_percent", Float, nullable=False, comment="share of users routed here (stable: the rest)"),
    Column("rollout_id", Id, comment="the rollout that set it, if any"),
    Column("updated_at", TS, nullable=False, server_default=func.now()),
)

# One row per hot swap a replica attempted (serving/hotswap.py), for the dashboard and ops.
swap_events = Table(
    "swap_events",
    metadata,
    Column("id", Id, primary_key=True, autoincrement=True),
    Column("pool", String(32), nullable=False),
    Column("replica", String(128), nullable=False),
    Column("from_version", Integer, nullable=False),
    Column("to_version", Integer, nullable=False),
    Column("ok", Boolean, nullable=False),
    Column("pause_s", Float, nullable=False),
    Column("prepare_s", Float, nullable=False),
    Column("tensors_reloaded", Integer, nullable=False),
    Column("fetched_bytes", BigInteger, nullable=False),
    Column("error", Text),
    Column("at", TS, nullable=False, server_default=func.now(), index=True),
    # where the pause went (the wait for in-flight requests, the reload), the worker's staging of
    # the file before it, and the in-flight requests restarted on the new version (migration 0006)
    Column("drain_s", Float),
    Column("reload_s", Float),
    Column("stage_s", Float),
    Column("restarted", Integer),
)


# --- engines and migrations -------------------------------------------------------------------


def upsert_insert(bind, table: Table):
    """`INSERT` for `table` in the dialect of `bind` (an Engine or Connection), so the caller can add
    `ON CONFLICT DO NOTHING / DO UPDATE` (`.on_conflict_do_nothing()`, `.on_conflict_do_update()`):
    both dialects Flywheel supports spell it the same way."""
    name = bind.dialect.name
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise ValueError(f"Flywheel supports SQLite and PostgreSQL, not {name}")
    return insert(table)


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for `url`; SQLite gets WAL and a busy timeout so the sink and readers coexist.

    A URL that does not parse, names another database or a driver that is not installed is a
    UserError whose message shows the URL with its password masked (UserError masks it even
    where the URL is too malformed for SQLAlchemy to render)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as e:  # ValueError: a port that is not a number
        why = "" if isinstance(e, ArgumentError) else f" ({first_line(e, with_type=False)})"
        # Too malformed to know its parts: whatever sits between a ':' and an '@' may be a password.
        masked = re.sub(r":[^:@/\s]*@", ":***@", url)
        raise UserError(
            f"bad database URL {masked!r}{why}: expected e.g. sqlite:///path.db or postgresql+psycopg://..."
        ) from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise UserError(f"bad database URL {shown}: Flywheel supports SQLite and PostgreSQL")
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3 is the driver we ship
    try:
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
                # Owner-only: completions, prompts and feedback. SQLite gives the -wal and -shm
                # files it creates the database file's mode.
                path = Path(parsed.database).expanduser()
                private_dir(path.parent)
                private_file(path)
            engine = create_engine(parsed, echo=echo, poolclass=NullPool, connect_args={"timeout": 30})
            event.listen(engine, "connect", _sqlite_pragmas)
            return engine
        return create_engine(parsed, echo=echo, pool_pre_ping=True)
    except (NoSuchModuleError, ImportError, ArgumentError, TypeError) as e:
        raise UserError(f"bad database URL {shown}: {first_line(e, with_type=False)}") from None


@functools.cache
def shared_engine(url: str) -> Engine:
    """One engine (and its connection pool) per database URL for the life of the process: what
    long-lived servers use, so routes and pollers do not open a pool per request."""
    return make_engine(url)


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _alembic_config(engine: Engine):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    cfg.attributes["engine"] = engine
    return cfg


_UPGRADING = threading.Lock()
"""Alembic keeps the running migration's context in module globals: two threads of one process
migrating at once (the demo's sink and learner) break each other (KeyError: 'config')."""


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the Alembic migrations up to `revision` (idempotent: a second run does nothing)."""
    from alembic import command

    try:
        with _UPGRADING, connect(engine) as conn, conn.begin():
            cfg = _alembic_config(engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    except OperationalError as e:  # the connection lost midway
        raise _unreachable(engine, e) from None


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    try:
        with connect(engine) as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except OperationalError as e:
        raise _unreachable(engine, e) from None


def connect(engine: Engine) -> Connection:
    """A connection, or a UserError naming the database (password masked) and why it refused:
    unreachable, wrong password, an unknown connection option; every one happens before any SQL."""
    try:
        return engine.connect()
    except DBAPIError as e:
        raise _unreachable(engine, e) from None


def _unreachable(engine: Engine, e: Exception) -> UserError:
    return UserError(
        f"database {engine.url.render_as_string(hide_password=True)} is unreachable: {first_line(e, with_type=False)}"
    )


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config(None)).get_current_head()  # type: ignore[arg-type]


def database_unavailable(e: BaseException) -> bool:
    """True when the database could not do any work (connection refused or lost, server shutting
    down, database locked, disk full): whoever called waits and tries again (the sink keeps its
    batch, its offsets uncommitted; the learner keeps its state). Anything else (OverflowError,
    DataError, IntegrityError, a ValueError from decoding, PostgreSQL refusing a NUL character...)
    is a refusal of the data itself: the sink sets the message aside as a dead letter and goes on,
    so one message can never stop it."""
    if isinstance(e, (DisconnectionError, PoolTimeout)):
        return True
    if isinstance(e, DBAPIError) and e.connection_invalidated:
        return True
    if isinstance(e, OperationalError):
        sqlstate = getattr(e.orig, "sqlstate", None) or ""
        return sqlstate[:2] not in _DATA_SQLSTATE_CLASSES
    return False


# PostgreSQL reports these as OperationalError, yet they depend on the data written, not on the
# server's state: 54, program_limit_exceeded (a value too large for an index, say).
_DATA_SQLSTATE_CLASSES = ("54",)
