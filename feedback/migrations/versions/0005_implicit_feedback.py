"""implicit feedback: events.source, the text around the cursor, views that keep the two apart

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

The sink infers feedback for clients that send no events (feedback/implicit.py): from each
request, whether the previous suggestion in the same user's file was kept. Those events are
stored with `source = 'inferred'`; everything written before this revision, and every event an
editor sends, is `explicit`.

- `completions.before_cursor` / `after_cursor`: up to 1,024 characters of the file on each side
  of the cursor (NULL for rows written before), dropped with the other text after
  `sink.retention_days`; an index on `completions (user_hash, created_at)` finds a user's
  previous completion.
- `v_choice_feedback` (and `v_daily_acceptance` over it) read explicit events only, as they
  did before inferred ones existed; `v_choice_feedback_inferred` and
  `v_daily_acceptance_inferred` are the same views over inferred events, so the two can be
  compared side by side.
- `v_inferred_agreement`: one row per served choice that has both kinds, with each kind's
  outcome (`full`, `partial`, `none`: kept fully, partly, not) and whether they agree.

The analyst role (0002) gets SELECT on the new and recreated views. All changes are ADD COLUMN,
CREATE INDEX and views: no table is copied on SQLite.
"""

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

ANALYST = 'flywheel_analyst'
NEW_VIEWS = ['v_choice_feedback_inferred', 'v_daily_acceptance_inferred', 'v_inferred_agreement']


def _day(column: str) -> str:
    if op.get_bind().dialect.name == 'postgresql':
        return f"CAST({column} AT TIME ZONE 'UTC' AS DATE)"
    return f'date({column})'


def _choice_feedback(source: str | None) -> str:
    """0002's v_choice_feedback, over the events of one source (None: all of them, as in 0002)."""
    day = _day('c.created_at')
    only = f" AND e.source = '{source}'" if source else ''
    accepted_chars = (
        "SUM(CASE WHEN e.type = 'select' THEN COALESCE(e.accepted_chars, "
        "CASE WHEN e.select_kind = 'full' THEN ch.n_chars ELSE 0 END) ELSE 0 END)"
    )
    return f"""
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
            LEFT JOIN events e ON e.completion_id = ch.completion_id AND e.choice_index = ch.choice_index{only}
            GROUP BY c.completion_id, ch.choice_index, c.model_version, c.language, c.created_at,
                     c.latency_ms, ch.n_chars
        ) per_choice
    """


def _daily_acceptance(over: str) -> str:
    return f"""
        SELECT day, model_version, language,
               SUM(shown) AS shown,
               SUM(accepted) AS accepted,
               CAST(SUM(accepted) AS DOUBLE PRECISION) / NULLIF(SUM(shown), 0) AS accept_rate,
               SUM(accepted_chars) AS accepted_chars,
               SUM(dismissed) AS dismissed,
               COUNT(*) AS choices
        FROM {over}
        GROUP BY day, model_version, language
    """


def _outcome(source: str) -> str:
    """A choice's outcome by the events of one source: full, partial or none (kept fully, partly,
    not); NULL without such events. A full select is `full`; any other select or an edit `partial`;
    a dismiss or a view alone `none`."""
    def has(cond: str) -> str:
        return f"MAX(CASE WHEN e.source = '{source}' AND {cond} THEN 1 ELSE 0 END) = 1"

    return f"""CASE
            WHEN {has("e.type = 'select' AND e.select_kind = 'full'")} THEN 'full'
            WHEN {has("e.type IN ('select', 'edit')")} THEN 'partial'
            WHEN {has("e.type IN ('dismiss', 'view')")} THEN 'none'
        END"""


def _agreement() -> str:
    explicit, inferred = _outcome('explicit'), _outcome('inferred')
    return f"""
        SELECT completion_id, choice_index, model_version, language, created_at,
               explicit_outcome, inferred_outcome,
               CASE WHEN explicit_outcome = inferred_outcome THEN 1 ELSE 0 END AS agree,
               explicit_accepted_chars, inferred_accepted_chars
        FROM (
            SELECT c.completion_id, ch.choice_index, c.model_version, COALESCE(c.language, 'unknown') AS language,
                   c.created_at,
                   {explicit} AS explicit_outcome,
                   {inferred} AS inferred_outcome,
                   SUM(CASE WHEN e.source = 'explicit' AND e.type = 'select' THEN COALESCE(e.accepted_chars, 0) ELSE 0 END)
                       AS explicit_accepted_chars,
                   SUM(CASE WHEN e.source = 'inferred' AND e.type = 'select' THEN COALESCE(e.accepted_chars, 0) ELSE 0 END)
                       AS inferred_accepted_chars
            FROM completions c
            JOIN completion_choices ch ON ch.completion_id = c.completion_id
            JOIN events e ON e.completion_id = ch.completion_id AND e.choice_index = ch.choice_index
            GROUP BY c.completion_id, ch.choice_index, c.model_version, c.language, c.created_at
        ) both_kinds
        WHERE explicit_outcome IS NOT NULL AND inferred_outcome IS NOT NULL
    """


def _grant(views: list[str]) -> None:
    """SELECT on `views` for the analyst role, where it exists (0002 may have skipped it)."""
    if op.get_bind().dialect.name != 'postgresql':
        return
    grants = ' '.join(f"EXECUTE 'GRANT SELECT ON {v} TO {ANALYST}';" for v in views)
    op.execute(f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{ANALYST}') THEN
                {grants}
            END IF;
        END
        $$;
    """)


def upgrade() -> None:
    op.add_column('events', sa.Column(
        'source', sa.String(length=16), nullable=False, server_default='explicit',
        comment='explicit: sent by the editor | inferred: read by the sink from the next request (feedback/implicit.py)',
    ))
    op.add_column('completions', sa.Column(
        'before_cursor', sa.Text(), nullable=True,
        comment="the file's text before the cursor (at most 1024 characters); dropped after retention_days",
    ))
    op.add_column('completions', sa.Column(
        'after_cursor', sa.Text(), nullable=True,
        comment="the file's text after the cursor (at most 1024 characters); dropped after retention_days",
    ))
    op.create_index(op.f('ix_completions_user_hash_created_at'), 'completions', ['user_hash', 'created_at'])

    op.execute('DROP VIEW v_daily_acceptance')
    op.execute('DROP VIEW v_choice_feedback')
    op.execute(f"CREATE VIEW v_choice_feedback AS {_choice_feedback('explicit')}")
    op.execute(f"CREATE VIEW v_daily_acceptance AS {_daily_acceptance('v_choice_feedback')}")
    op.execute(f"CREATE VIEW v_choice_feedback_inferred AS {_choice_feedback('inferred')}")
    op.execute(f"CREATE VIEW v_daily_acceptance_inferred AS {_daily_acceptance('v_choice_feedback_inferred')}")
    op.execute(f'CREATE VIEW v_inferred_agreement AS {_agreement()}')
    _grant(['v_choice_feedback', 'v_daily_acceptance', *NEW_VIEWS])


def downgrade() -> None:
    for name in reversed(NEW_VIEWS):
        op.execute(f'DROP VIEW IF EXISTS {name}')
    op.execute('DROP VIEW v_daily_acceptance')
    op.execute('DROP VIEW v_choice_feedback')
    op.execute(f'CREATE VIEW v_choice_feedback AS {_choice_feedback(None)}')
    op.execute(f"CREATE VIEW v_daily_acceptance AS {_daily_acceptance('v_choice_feedback')}")
    _grant(['v_choice_feedback', 'v_daily_acceptance'])
    op.drop_index(op.f('ix_completions_user_hash_created_at'), table_name='completions')
    # SQLite drops a column in place since 3.35 (no table copy, which the views would block).
    op.drop_column('completions', 'after_cursor')
    op.drop_column('completions', 'before_cursor')
    op.drop_column('events', 'source')
