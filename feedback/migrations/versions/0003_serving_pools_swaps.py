"""serving topology (serving_pools) and the hot-swap log (swap_events)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

`serving_pools` holds the version each replica pool (stable, canary) should serve and the
canary's traffic share; replicas and the ingress poll it (feedback/pools.py). It starts with
no rows: a pool without a row serves the version it was deployed with. `swap_events` logs
every swap a replica attempted. The analyst role's default privileges (0002) grant SELECT
on both.
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table('serving_pools',
    sa.Column('pool', sa.String(length=32), nullable=False, comment='stable | canary'),
    sa.Column('version', sa.Integer(), nullable=True, comment='target model version; NULL: the pool serves no users'),
    sa.Column('traffic_percent', sa.Float(), nullable=False, comment='share of users routed here (stable: the rest)'),
    sa.Column('rollout_id', Id, nullable=True, comment='the rollout that set it, if any'),
    sa.Column('updated_at', TS, server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('pool', name=op.f('pk_serving_pools'))
    )
    op.create_table('swap_events',
    sa.Column('id', Id, autoincrement=True, nullable=False),
    sa.Column('pool', sa.String(length=32), nullable=False),
    sa.Column('replica', sa.String(length=128), nullable=False),
    sa.Column('from_version', sa.Integer(), nullable=False),
    sa.Column('to_version', sa.Integer(), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('pause_s', sa.Float(), nullable=False),
    sa.Column('prepare_s', sa.Float(), nullable=False),
    sa.Column('tensors_reloaded', sa.Integer(), nullable=False),
    sa.Column('fetched_bytes', sa.BigInteger(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('at', TS, server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_swap_events'))
    )
    with op.batch_alter_table('swap_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_swap_events_at'), ['at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('swap_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_swap_events_at'))
    op.drop_table('swap_events')
    op.drop_table('serving_pools')
