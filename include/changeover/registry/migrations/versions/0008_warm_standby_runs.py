"""warm standby runs: a successor launched before its predecessor stops, and when it was ready

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('standby_of', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('ready_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index('ix_job_runs_standby_of', ['standby_of'])


def downgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_index('ix_job_runs_standby_of')
        batch_op.drop_column('ready_at')
        batch_op.drop_column('standby_of')
