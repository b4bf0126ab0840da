"""leases: which process tunes a unit of work (a family) until when

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tuner_leases',
        sa.Column('name', sa.String(length=512), nullable=False),
        sa.Column('owner', sa.String(length=128), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )


def downgrade() -> None:
    op.drop_table('tuner_leases')
