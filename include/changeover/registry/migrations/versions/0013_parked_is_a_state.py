"""a parked run has a state of its own, PARKED, instead of STOPPED with no end

Revision ID: 0013
Revises: 0012
"""

from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE job_runs SET state = 'PARKED' WHERE state = 'STOPPED' AND ended_at IS NULL")


def downgrade() -> None:
    op.execute("UPDATE job_runs SET state = 'STOPPED' WHERE state = 'PARKED'")
