"""initial schema

Revision ID: 0001
Revises: 
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('tuner_environments',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('backend', sa.String(length=16), nullable=False),
    sa.Column('arch', sa.String(length=16), nullable=False),
    sa.Column('device', sa.String(length=128), nullable=False),
    sa.Column('versions', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('fingerprint')
    )
    op.create_table('tuner_keys',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('arch', sa.String(length=16), nullable=False),
    sa.Column('device', sa.String(length=128), nullable=False),
    sa.Column('dtype_in', sa.String(length=8), nullable=False),
    sa.Column('dtype_out', sa.String(length=8), nullable=False),
    sa.Column('layout', sa.String(length=4), nullable=False),
    sa.Column('m', sa.Integer(), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('k', sa.Integer(), nullable=False),
    sa.Column('groups', sa.Integer(), nullable=False),
    sa.Column('group_k', sa.String(length=256), nullable=False),
    sa.Column('carveout', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('arch', 'device', 'dtype_in', 'dtype_out', 'layout', 'm', 'n', 'k', 'groups', 'group_k', 'carveout', name='uq_gemm_key')
    )
    with op.batch_alter_table('tuner_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tuner_keys_m'), ['m'], unique=False)

    op.create_table('tuner_trials',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('key_id', sa.Integer(), nullable=False),
    sa.Column('env_id', sa.Integer(), nullable=False),
    sa.Column('config_name', sa.String(length=160), nullable=False),
    sa.Column('scheduler', sa.String(length=32), nullable=False),
    sa.Column('config', sa.JSON(), nullable=True),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('ms', sa.Float(), nullable=True),
    sa.Column('rel_err', sa.Float(), nullable=True),
    sa.Column('error', sa.String(length=1000), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['env_id'], ['tuner_environments.id'], ),
    sa.ForeignKeyConstraint(['key_id'], ['tuner_keys.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('tuner_trials', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tuner_trials_key_id'), ['key_id'], unique=False)

    op.create_table('tuner_winners',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('key_id', sa.Integer(), nullable=False),
    sa.Column('env_id', sa.Integer(), nullable=False),
    sa.Column('config_name', sa.String(length=160), nullable=False),
    sa.Column('scheduler', sa.String(length=32), nullable=False),
    sa.Column('config', sa.JSON(), nullable=True),
    sa.Column('ms', sa.Float(), nullable=False),
    sa.Column('baseline_ms', sa.Float(), nullable=False),
    sa.Column('speedup', sa.Float(), nullable=False),
    sa.Column('best_by_scheduler', sa.JSON(), nullable=False),
    sa.Column('trials', sa.Integer(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['env_id'], ['tuner_environments.id'], ),
    sa.ForeignKeyConstraint(['key_id'], ['tuner_keys.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_id')
    )


def downgrade() -> None:
    op.drop_table('tuner_winners')
    with op.batch_alter_table('tuner_trials', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tuner_trials_key_id'))

    op.drop_table('tuner_trials')
    with op.batch_alter_table('tuner_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tuner_keys_m'))

    op.drop_table('tuner_keys')
    op.drop_table('tuner_environments')
