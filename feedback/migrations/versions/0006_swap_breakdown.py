"""swap_events: where a swap's pause went (drain, reload), the staging before it, restarted requests

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

A swap's pause is the wait for in-flight requests (`drain_s`) and the reload (`reload_s`);
before the pause the vLLM worker reads, checks and parses the swap file while serving goes on
(`stage_s`); `restarted` counts the in-flight requests the swap aborted to run again on the new
version (serving/hotswap.py). All NULL for rows written before this revision. ADD COLUMN only:
no table is copied on SQLite.
"""

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

COLUMNS = ('drain_s', 'reload_s', 'stage_s', 'restarted')


def upgrade() -> None:
    op.add_column('swap_events', sa.Column('drain_s', sa.Float(), nullable=True))
    op.add_column('swap_events', sa.Column('reload_s', sa.Float(), nullable=True))
    op.add_column('swap_events', sa.Column('stage_s', sa.Float(), nullable=True))
    op.add_column('swap_events', sa.Column('restarted', sa.Integer(), nullable=True))


def downgrade() -> None:
    # SQLite drops a column in place since 3.35 (no table copy)
    for name in reversed(COLUMNS):
        op.drop_column('swap_events', name)
