"""light jobs: the Connect server process each ran on, and its client's heartbeat, so a row whose server was
restarted or whose client died neither holds a drain nor stays RUNNING

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("light_jobs") as batch:
        batch.add_column(sa.Column("server_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("server_pid_started", sa.String(32), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("light_jobs") as batch:
        for column in ("heartbeat_at", "server_pid_started", "server_pid"):
            batch.drop_column(column)
