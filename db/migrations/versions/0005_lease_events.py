"""lease events: the history of who took, took over, released or lost each lease

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tuner_lease_events',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=512), nullable=False),
        sa.Column('owner', sa.String(length=128), nullable=False),
        sa.Column('event', sa.String(length=16), nullable=False),
        sa.Column('previous', sa.String(length=128), nullable=True),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_tuner_lease_events_name', 'tuner_lease_events', ['name'])


def downgrade() -> None:
    op.drop_index('ix_tuner_lease_events_name', table_name='tuner_lease_events')
    op.drop_table('tuner_lease_events')
