"""leases for parked runs, sink fencing, per-member upgrade progress, events by upgrade

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('parks', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('first_write_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('upgrade_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('progress', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('actor', sa.String(length=250), nullable=True))
        batch_op.add_column(sa.Column('active', sa.Integer(), nullable=True))
        batch_op.create_unique_constraint('uq_upgrade_runs_active', ['active'])
    with op.batch_alter_table('members', schema=None) as batch_op:
        batch_op.add_column(sa.Column('maintenance', sa.String(length=250), nullable=True))
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('upgrade', sa.String(length=250), nullable=True))
        batch_op.create_index('ix_events_upgrade', ['upgrade'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('members', schema=None) as batch_op:
        batch_op.drop_column('maintenance')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_upgrade')
        batch_op.drop_column('upgrade')
    with op.batch_alter_table('upgrade_runs', schema=None) as batch_op:
        batch_op.drop_constraint('uq_upgrade_runs_active', type_='unique')
        batch_op.drop_column('active')
        batch_op.drop_column('actor')
        batch_op.drop_column('progress')
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_column('first_write_at')
        batch_op.drop_column('parks')
        batch_op.drop_column('lease_until')
