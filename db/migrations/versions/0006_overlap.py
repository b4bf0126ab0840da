"""overlap: the bytes of an all-reduce beside the GEMM, part of every key and map family

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

_FAMILY = ['n', 'k', 'arch', 'dtype_in', 'dtype_out', 'layout', 'groups', 'group_k', 'carveout']
_UNIQUE = ['arch', 'device', 'dtype_in', 'dtype_out', 'layout', 'm', 'n', 'k', 'groups', 'group_k', 'carveout']


def upgrade() -> None:
    with op.batch_alter_table('tuner_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('overlap', sa.BigInteger(), nullable=False, server_default='0'))
        batch_op.drop_constraint('uq_gemm_key', type_='unique')
        batch_op.create_unique_constraint('uq_gemm_key', [*_UNIQUE, 'overlap'])
        batch_op.drop_index('ix_tuner_keys_family')
        batch_op.create_index('ix_tuner_keys_family', [*_FAMILY, 'overlap', 'device', 'm'], unique=False)
    with op.batch_alter_table('tuner_m_ranges', schema=None) as batch_op:
        batch_op.add_column(sa.Column('overlap', sa.BigInteger(), nullable=False, server_default='0'))
        batch_op.drop_index('ix_tuner_m_ranges_family')
        batch_op.create_index('ix_tuner_m_ranges_family', [*_FAMILY, 'overlap', 'device', 'm_lo'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('tuner_m_ranges', schema=None) as batch_op:
        batch_op.drop_index('ix_tuner_m_ranges_family')
        batch_op.create_index('ix_tuner_m_ranges_family', [*_FAMILY, 'device', 'm_lo'], unique=False)
        batch_op.drop_column('overlap')
    with op.batch_alter_table('tuner_keys', schema=None) as batch_op:
        batch_op.drop_index('ix_tuner_keys_family')
        batch_op.create_index('ix_tuner_keys_family', [*_FAMILY, 'device', 'm'], unique=False)
        batch_op.drop_constraint('uq_gemm_key', type_='unique')
        batch_op.create_unique_constraint('uq_gemm_key', _UNIQUE)
        batch_op.drop_column('overlap')
