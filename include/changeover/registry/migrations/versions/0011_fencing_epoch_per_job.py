"""a fencing epoch per job, raised at every change of ownership, and the epoch of each run

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('epoch', sa.BigInteger(), nullable=False, server_default='0'))
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('epoch', sa.BigInteger(), nullable=True))
    # Runs before this handed their run id to users' functions as the epoch: the new epochs start above them.
    op.execute("UPDATE job_runs SET epoch = id")
    op.execute("UPDATE jobs SET epoch = COALESCE((SELECT MAX(r.id) FROM job_runs r WHERE r.job = jobs.name), 0)")


def downgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_column('epoch')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('epoch')
