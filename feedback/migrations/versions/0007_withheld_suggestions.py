"""withheld suggestions: v_version_rewards counts them apart

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05

Serving's confidence gate (`model.min_confidence`, learner/confidence.py) withholds a suggestion
the model is unsure of: the editor gets an empty completion, the choice is stored with
`finish_reason = 'withheld'` and its reward row with `outcome = 'withheld'` (reward 0; the
learner does not train on it). `v_version_rewards` leaves those out of `mean_reward_shown`, as it
does unseen ones, and counts them in a new last column, `withheld`. Views only: no table changes.
"""

from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

ANALYST = 'flywheel_analyst'


def _version_rewards(withheld: bool) -> str:
    hidden = "'unseen', 'no_suggestion', 'withheld'" if withheld else "'unseen', 'no_suggestion'"
    extra = ",\n               SUM(CASE WHEN outcome = 'withheld' THEN 1 ELSE 0 END) AS withheld" if withheld else ""
    return f"""
        SELECT model_version,
               COUNT(*) AS rewarded,
               AVG(reward) AS mean_reward,
               AVG(CASE WHEN outcome NOT IN ({hidden}) THEN reward END) AS mean_reward_shown,
               SUM(reward) AS total_reward,
               MIN(reward) AS min_reward,
               MAX(reward) AS max_reward,
               SUM(CASE WHEN outcome IN ('select', 'edit') THEN 1 ELSE 0 END) AS accepted,
               SUM(CASE WHEN outcome = 'edit' THEN 1 ELSE 0 END) AS edited,
               SUM(CASE WHEN outcome = 'dismiss' THEN 1 ELSE 0 END) AS dismissed,
               SUM(CASE WHEN outcome = 'ignored' THEN 1 ELSE 0 END) AS ignored,
               SUM(CASE WHEN outcome = 'no_suggestion' THEN 1 ELSE 0 END) AS no_suggestion,
               SUM(CASE WHEN outcome = 'unseen' THEN 1 ELSE 0 END) AS unseen,
               MAX(computed_at) AS last_computed_at{extra}
        FROM rewards
        GROUP BY model_version
    """


def _recreate(withheld: bool) -> None:
    op.execute('DROP VIEW v_version_rewards')
    op.execute(f'CREATE VIEW v_version_rewards AS {_version_rewards(withheld)}')
    if op.get_bind().dialect.name == 'postgresql':  # the analyst role (0002), where it exists
        op.execute(f"""
            DO $$
            BEGIN
                IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{ANALYST}') THEN
                    EXECUTE 'GRANT SELECT ON v_version_rewards TO {ANALYST}';
                END IF;
            END
            $$;
        """)


def upgrade() -> None:
    _recreate(withheld=True)


def downgrade() -> None:
    _recreate(withheld=False)
