"""index keys by family (every field but device and M, then those two)

Revision ID: 0002
Revises: 0001
"""

from alembic import op


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

_COLUMNS = ['n', 'k', 'arch', 'dtype_in', 'dtype_out', 'layout', 'groups', 'group_k', 'carveout', 'device', 'm']


def upgrade() -> None:
    with op.batch_alter_table('tuner_keys', schema=None) as batch_op:
        batch_op.create_index('ix_tuner_keys_family', _COLUMNS, unique=False)


def downgrade() -> None:
    with op.batch_alter_table('tuner_keys', schema=None) as batch_op:
        batch_op.drop_index('ix_tuner_keys_family')
