"""sink bookkeeping (pending events, dead letters, reward queue), rewards.outcome, analyst views, analyst role

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

The views are written once for both backends; only the day of a timestamp differs (SQLite
stores timestamps as UTC text, PostgreSQL as timestamptz). Latency percentiles use the
nearest-rank definition (the smallest value with at least p of the rows at or below it)
through window functions, so SQLite, which has no percentile function, and PostgreSQL give
the same numbers.

On SQLite, a later migration that rebuilds a table these views read (batch mode copies the
table and renames it) must drop the views first and create them again afterwards.

On PostgreSQL this also creates `flywheel_analyst`, a NOLOGIN group role with SELECT on
every table and view (and, through default privileges, on tables that later migrations
create as the same user). Grant it to a login role: `GRANT flywheel_analyst TO alice;`.
The migrating user needs CREATEROLE; without it the role is skipped with a warning.
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
TS = sa.DateTime(timezone=True)
ANALYST = 'flywheel_analyst'
VIEWS = ['v_daily_acceptance', 'v_version_rewards', 'v_latency', 'v_suggestion_rate', 'v_choice_feedback']


def _day(column: str) -> str:
    if op.get_bind().dialect.name == 'postgresql':
        return f"CAST({column} AT TIME ZONE 'UTC' AS DATE)"
    return f'date({column})'


def _views() -> dict[str, str]:
    day = _day('c.created_at')
    accepted_chars = (
        "SUM(CASE WHEN e.type = 'select' THEN COALESCE(e.accepted_chars, "
        "CASE WHEN e.select_kind = 'full' THEN ch.n_chars ELSE 0 END) ELSE 0 END)"
    )
    return {
        # One row per served choice with its feedback summarised; the other views build on it.
        'v_choice_feedback': f"""
            SELECT completion_id, choice_index, model_version, language, day, created_at, latency_ms, n_chars,
                   suggested, shown, accepted, dismissed,
                   CASE WHEN accepted_chars > n_chars THEN n_chars ELSE accepted_chars END AS accepted_chars
            FROM (
                SELECT c.completion_id, ch.choice_index, c.model_version,
                       COALESCE(c.language, 'unknown') AS language, {day} AS day, c.created_at, c.latency_ms,
                       ch.n_chars,
                       CASE WHEN ch.n_chars > 0 THEN 1 ELSE 0 END AS suggested,
                       CASE WHEN COUNT(e.id) > 0 THEN 1 ELSE 0 END AS shown,
                       MAX(CASE WHEN e.type IN ('select', 'edit') THEN 1 ELSE 0 END) AS accepted,
                       MAX(CASE WHEN e.type = 'dismiss' THEN 1 ELSE 0 END) AS dismissed,
                       {accepted_chars} AS accepted_chars
                FROM completions c
                JOIN completion_choices ch ON ch.completion_id = c.completion_id
                LEFT JOIN events e ON e.completion_id = ch.completion_id AND e.choice_index = ch.choice_index
                GROUP BY c.completion_id, ch.choice_index, c.model_version, c.language, c.created_at,
                         c.latency_ms, ch.n_chars
            ) per_choice
        """,
        'v_daily_acceptance': """
            SELECT day, model_version, language,
                   SUM(shown) AS shown,
                   SUM(accepted) AS accepted,
                   CAST(SUM(accepted) AS DOUBLE PRECISION) / NULLIF(SUM(shown), 0) AS accept_rate,
                   SUM(accepted_chars) AS accepted_chars,
                   SUM(dismissed) AS dismissed,
                   COUNT(*) AS choices
            FROM v_choice_feedback
            GROUP BY day, model_version, language
        """,
        'v_version_rewards': """
            SELECT model_version,
                   COUNT(*) AS rewarded,
                   AVG(reward) AS mean_reward,
                   AVG(CASE WHEN outcome NOT IN ('unseen', 'no_suggestion') THEN reward END) AS mean_reward_shown,
                   SUM(reward) AS total_reward,
                   MIN(reward) AS min_reward,
                   MAX(reward) AS max_reward,
                   SUM(CASE WHEN outcome IN ('select', 'edit') THEN 1 ELSE 0 END) AS accepted,
                   SUM(CASE WHEN outcome = 'edit' THEN 1 ELSE 0 END) AS edited,
                   SUM(CASE WHEN outcome = 'dismiss' THEN 1 ELSE 0 END) AS dismissed,
                   SUM(CASE WHEN outcome = 'ignored' THEN 1 ELSE 0 END) AS ignored,
                   SUM(CASE WHEN outcome = 'no_suggestion' THEN 1 ELSE 0 END) AS no_suggestion,
                   SUM(CASE WHEN outcome = 'unseen' THEN 1 ELSE 0 END) AS unseen,
                   MAX(computed_at) AS last_computed_at
            FROM rewards
            GROUP BY model_version
        """,
        'v_latency': f"""
            SELECT day, model_version,
                   MAX(n) AS requests,
                   AVG(latency_ms) AS mean_ms,
                   MIN(CASE WHEN rn >= 0.50 * n THEN latency_ms END) AS p50_ms,
                   MIN(CASE WHEN rn >= 0.90 * n THEN latency_ms END) AS p90_ms,
                   MIN(CASE WHEN rn >= 0.99 * n THEN latency_ms END) AS p99_ms,
                   MAX(latency_ms) AS max_ms
            FROM (
                SELECT {day} AS day, c.model_version, c.latency_ms,
                       ROW_NUMBER() OVER (PARTITION BY {day}, c.model_version ORDER BY c.latency_ms) AS rn,
                       COUNT(*) OVER (PARTITION BY {day}, c.model_version) AS n
                FROM completions c
            ) ranked
            GROUP BY day, model_version
        """,
        'v_suggestion_rate': f"""
            SELECT day, model_version, language,
                   COUNT(*) AS requests,
                   SUM(any_suggestion) AS suggested,
                   CAST(SUM(any_suggestion) AS DOUBLE PRECISION) / COUNT(*) AS suggestion_rate
            FROM (
                SELECT {day} AS day, c.model_version, COALESCE(c.language, 'unknown') AS language,
                       MAX(CASE WHEN ch.n_chars > 0 THEN 1 ELSE 0 END) AS any_suggestion
                FROM completions c
                JOIN completion_choices ch ON ch.completion_id = c.completion_id
                GROUP BY c.completion_id, c.created_at, c.model_version, c.language
            ) per_request
            GROUP BY day, model_version, language
        """,
    }


def upgrade() -> None:
    op.create_table('pending_events',
    sa.Column('id', Id, autoincrement=True, nullable=False),
    sa.Column('event_id', sa.String(length=36), nullable=False),
    sa.Column('completion_id', sa.String(length=64), nullable=False),
    sa.Column('payload', sa.LargeBinary(), nullable=False, comment='the Kafka message value, decoded again when its completion arrives'),
    sa.Column('kafka_topic', sa.String(length=255), nullable=False),
    sa.Column('kafka_partition', sa.Integer(), nullable=False),
    sa.Column('kafka_offset', sa.BigInteger(), nullable=False),
    sa.Column('held_at', TS, nullable=False, comment='when the sink first held it; dead-lettered after the grace period'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_pending_events')),
    sa.UniqueConstraint('event_id', name=op.f('uq_pending_events_event_id')),
    comment='events whose completion record has not arrived yet'
    )
    op.create_index(op.f('ix_pending_events_completion_id'), 'pending_events', ['completion_id'], unique=False)
    op.create_index(op.f('ix_pending_events_held_at'), 'pending_events', ['held_at'], unique=False)

    op.create_table('dead_letters',
    sa.Column('id', Id, autoincrement=True, nullable=False),
    sa.Column('reason', sa.String(length=32), nullable=False, comment='malformed | unknown_completion | rejected'),
    sa.Column('error', sa.Text(), nullable=False),
    sa.Column('kafka_topic', sa.String(length=255), nullable=False),
    sa.Column('kafka_partition', sa.Integer(), nullable=False),
    sa.Column('kafka_offset', sa.BigInteger(), nullable=False),
    sa.Column('key', sa.Text(), nullable=True),
    sa.Column('payload', sa.LargeBinary(), nullable=True, comment='the raw message value; dropped after retention_days'),
    sa.Column('completion_id', sa.String(length=64), nullable=True),
    sa.Column('event_id', sa.String(length=36), nullable=True),
    sa.Column('dead_at', TS, nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dead_letters')),
    sa.UniqueConstraint('kafka_topic', 'kafka_partition', 'kafka_offset', name=op.f('uq_dead_letters_kafka_topic_kafka_partition_kafka_offset')),
    comment='messages the sink could not store, never dropped silently'
    )
    op.create_index(op.f('ix_dead_letters_completion_id'), 'dead_letters', ['completion_id'], unique=False)
    op.create_index(op.f('ix_dead_letters_reason'), 'dead_letters', ['reason'], unique=False)

    op.create_table('reward_due',
    sa.Column('completion_id', sa.String(length=64), nullable=False),
    sa.Column('due_at', TS, nullable=False, comment='when its feedback window closes (or now, for a late event)'),
    sa.PrimaryKeyConstraint('completion_id', name=op.f('pk_reward_due')),
    comment='completions whose reward is still to be computed'
    )
    op.create_index(op.f('ix_reward_due_due_at'), 'reward_due', ['due_at'], unique=False)

    # ADD COLUMN is native on both backends: no table rebuild.
    op.add_column('rewards', sa.Column('outcome', sa.String(length=16), nullable=True,
                                       comment='no_suggestion | edit | select | dismiss | ignored | unseen (feedback/reward.py)'))

    for name, sql in _views().items():
        op.execute(f'CREATE VIEW {name} AS {sql}')

    if op.get_bind().dialect.name == 'postgresql':
        _create_analyst_role()


def _create_analyst_role() -> None:
    op.execute(f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{ANALYST}') THEN
                IF NOT (SELECT rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user) THEN
                    RAISE WARNING 'flywheel: % lacks CREATEROLE; skipping the read-only role {ANALYST}', current_user;
                    RETURN;
                END IF;
                BEGIN
                    CREATE ROLE {ANALYST} NOLOGIN;
                EXCEPTION WHEN duplicate_object OR unique_violation THEN
                    NULL;  -- created concurrently by a migration of another database
                END;
            END IF;
            EXECUTE format('GRANT USAGE ON SCHEMA %I TO {ANALYST}', current_schema());
            EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO {ANALYST}', current_schema());
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT ON TABLES TO {ANALYST}', current_schema());
        END
        $$;
    """)


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(f"""
            DO $$
            BEGIN
                IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{ANALYST}') THEN
                    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I REVOKE SELECT ON TABLES FROM {ANALYST}', current_schema());
                    EXECUTE format('REVOKE SELECT ON ALL TABLES IN SCHEMA %I FROM {ANALYST}', current_schema());
                    EXECUTE format('REVOKE USAGE ON SCHEMA %I FROM {ANALYST}', current_schema());
                END IF;
            END
            $$;
        """)  # the role itself is cluster-wide and may serve other databases: it stays
    for name in VIEWS:
        op.execute(f'DROP VIEW IF EXISTS {name}')
    with op.batch_alter_table('rewards', schema=None) as batch_op:
        batch_op.drop_column('outcome')
    op.drop_index(op.f('ix_reward_due_due_at'), table_name='reward_due')
    op.drop_table('reward_due')
    op.drop_index(op.f('ix_dead_letters_reason'), table_name='dead_letters')
    op.drop_index(op.f('ix_dead_letters_completion_id'), table_name='dead_letters')
    op.drop_table('dead_letters')
    op.drop_index(op.f('ix_pending_events_held_at'), table_name='pending_events')
    op.drop_index(op.f('ix_pending_events_completion_id'), table_name='pending_events')
    op.drop_table('pending_events')
