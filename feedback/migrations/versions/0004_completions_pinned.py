"""completions.pinned: a completion served for a request that pinned its version

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10

A request for `model: flywheel@vN` chooses its version itself, so its feedback is evidence
one client can aim at a version: the rollout controller and the learner leave such
completions out (ops/rollout/arms.py, learner/train/learn.py). Rows written before this
revision were not marked; they count as unpinned. A plain ADD COLUMN (no table copy), so the
analyst views over `completions` stay as they are on SQLite too.
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        'completions',
        sa.Column(
            'pinned',
            sa.Boolean(),
            nullable=False,
            server_default=sa.false(),
            comment='served for a request that pinned its version (model: name@vN); kept out of rollout arms and training',
        ),
    )


def downgrade() -> None:
    # SQLite drops a column in place since 3.35 (no table copy, which the views would block).
    op.drop_column('completions', 'pinned')
