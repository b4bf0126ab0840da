"""M ranges: per family (a key without M), which choice serves each M interval, with its evidence

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

_FAMILY = ['n', 'k', 'arch', 'dtype_in', 'dtype_out', 'layout', 'groups', 'group_k', 'carveout', 'device', 'm_lo']


def upgrade() -> None:
    op.create_table(
        'tuner_m_ranges',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('arch', sa.String(length=16), nullable=False),
        sa.Column('device', sa.String(length=128), nullable=False),
        sa.Column('dtype_in', sa.String(length=8), nullable=False),
        sa.Column('dtype_out', sa.String(length=8), nullable=False),
        sa.Column('layout', sa.String(length=4), nullable=False),
        sa.Column('n', sa.Integer(), nullable=False),
        sa.Column('k', sa.Integer(), nullable=False),
        sa.Column('groups', sa.Integer(), nullable=False),
        sa.Column('group_k', sa.String(length=256), nullable=False),
        sa.Column('carveout', sa.Integer(), nullable=False),
        sa.Column('env_id', sa.Integer(), nullable=False),
        sa.Column('m_lo', sa.Integer(), nullable=False),
        sa.Column('m_hi', sa.Integer(), nullable=False),
        sa.Column('config_name', sa.String(length=160), nullable=False),
        sa.Column('scheduler', sa.String(length=32), nullable=False),
        sa.Column('config', sa.JSON(), nullable=True),
        sa.Column('evidence', sa.JSON(), nullable=False),
        sa.Column('source', sa.String(length=16), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['env_id'], ['tuner_environments.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_tuner_m_ranges_family', 'tuner_m_ranges', _FAMILY, unique=False)


def downgrade() -> None:
    op.drop_index('ix_tuner_m_ranges_family', table_name='tuner_m_ranges')
    op.drop_table('tuner_m_ranges')
