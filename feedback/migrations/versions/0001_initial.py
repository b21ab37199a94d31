"""initial schema: completions, events, rewards, versions, rollouts

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-30
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('completions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('completion_id', sa.String(length=64), nullable=False),
    sa.Column('model_version', sa.Integer(), nullable=False),
    sa.Column('user_hash', sa.String(length=128), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=True),
    sa.Column('language', sa.String(length=64), nullable=True),
    sa.Column('filepath', sa.String(length=1024), nullable=True),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=False),
    sa.Column('prompt_text', sa.Text(), nullable=True, comment='dropped after retention_days; token ids stay'),
    sa.Column('summary_ids', sa.JSON(), nullable=False),
    sa.Column('n_choices', sa.Integer(), nullable=False),
    sa.Column('latency_ms', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ingested_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_completions')),
    sa.UniqueConstraint('completion_id', name=op.f('uq_completions_completion_id'))
    )
    with op.batch_alter_table('completions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_completions_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_completions_model_version'), ['model_version'], unique=False)

    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('event_id', sa.String(length=36), nullable=False),
    sa.Column('completion_id', sa.String(length=64), nullable=False),
    sa.Column('choice_index', sa.Integer(), nullable=False),
    sa.Column('type', sa.String(length=16), nullable=False),
    sa.Column('select_kind', sa.String(length=8), nullable=True),
    sa.Column('accepted_chars', sa.Integer(), nullable=True),
    sa.Column('kept_text', sa.Text(), nullable=True),
    sa.Column('view_id', sa.String(length=128), nullable=True),
    sa.Column('elapsed_ms', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ingested_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events')),
    sa.UniqueConstraint('event_id', name=op.f('uq_events_event_id'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_completion_id'), ['completion_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_created_at'), ['created_at'], unique=False)

    op.create_table('model_versions',
    sa.Column('version', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('parent', sa.Integer(), nullable=True),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('full_size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('gate_passed', sa.Boolean(), nullable=False),
    sa.Column('gate_reason', sa.Text(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('version', name=op.f('pk_model_versions'))
    )
    op.create_table('rewards',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('completion_id', sa.String(length=64), nullable=False),
    sa.Column('choice_index', sa.Integer(), nullable=False),
    sa.Column('model_version', sa.Integer(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=False),
    sa.Column('components', sa.JSON(), nullable=False, comment='how the reward was computed'),
    sa.Column('computed_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rewards')),
    sa.UniqueConstraint('completion_id', 'choice_index', name=op.f('uq_rewards_completion_id_choice_index'))
    )
    with op.batch_alter_table('rewards', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rewards_model_version'), ['model_version'], unique=False)

    op.create_table('rollouts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('candidate_version', sa.Integer(), nullable=False),
    sa.Column('stable_version', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False, comment='running | paused | promoted | rolled_back | aborted'),
    sa.Column('step_index', sa.Integer(), nullable=False),
    sa.Column('weights', sa.JSON(), nullable=False, comment='canary traffic share per step, percent'),
    sa.Column('interval_s', sa.Float(), nullable=False),
    sa.Column('thresholds', sa.JSON(), nullable=False),
    sa.Column('min_samples', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rollouts'))
    )
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rollouts_candidate_version'), ['candidate_version'], unique=False)

    op.create_table('completion_choices',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('completion_id', sa.String(length=64), nullable=False),
    sa.Column('choice_index', sa.Integer(), nullable=False),
    sa.Column('token_ids', sa.JSON(), nullable=False),
    sa.Column('logprobs', sa.JSON(), nullable=False, comment='behaviour policy, one per token'),
    sa.Column('routing', sa.JSON(), nullable=True, comment="serving engine's expert ids per layer, when exposed"),
    sa.Column('text', sa.Text(), nullable=True, comment='dropped after retention_days; token ids stay'),
    sa.Column('n_chars', sa.Integer(), nullable=False),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.ForeignKeyConstraint(['completion_id'], ['completions.completion_id'], name=op.f('fk_completion_choices_completion_id_completions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_completion_choices')),
    sa.UniqueConstraint('completion_id', 'choice_index', name=op.f('uq_completion_choices_completion_id_choice_index'))
    )
    op.create_table('rollout_steps',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('rollout_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('step_index', sa.Integer(), nullable=False),
    sa.Column('weight', sa.Float(), nullable=False),
    sa.Column('decision', sa.String(length=16), nullable=False, comment='advance | hold | promote | rollback | pause | resume | abort'),
    sa.Column('evidence', sa.JSON(), nullable=False, comment='the metrics and test results behind the decision'),
    sa.Column('decided_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollouts.id'], name=op.f('fk_rollout_steps_rollout_id_rollouts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rollout_steps'))
    )
    with op.batch_alter_table('rollout_steps', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rollout_steps_rollout_id_step_index'), ['rollout_id', 'step_index'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('rollout_steps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rollout_steps_rollout_id_step_index'))

    op.drop_table('rollout_steps')
    op.drop_table('completion_choices')
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rollouts_candidate_version'))

    op.drop_table('rollouts')
    with op.batch_alter_table('rewards', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rewards_model_version'))

    op.drop_table('rewards')
    op.drop_table('model_versions')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_created_at'))
        batch_op.drop_index(batch_op.f('ix_events_completion_id'))

    op.drop_table('events')
    with op.batch_alter_table('completions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_completions_model_version'))
        batch_op.drop_index(batch_op.f('ix_completions_created_at'))

    op.drop_table('completions')
