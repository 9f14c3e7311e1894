"""light jobs: a Spark Connect server per member that serves them, and a row per light job while it runs

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("members") as batch:
        batch.add_column(sa.Column("light_jobs", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("connect_port", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("connect_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("connect_pid_started", sa.String(32), nullable=True))
    op.create_table(
        "light_jobs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tag", sa.String(100), nullable=False, unique=True),
        sa.Column("member", sa.String(100), nullable=False, index=True),
        sa.Column("spark_version", sa.String(32), nullable=False),
        sa.Column("server", sa.String(200), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("user_id", sa.String(100), nullable=False),
        sa.Column("statement", sa.Text(), nullable=True),
        sa.Column("block_shutdown", sa.Boolean(), nullable=False),
        sa.Column("shutdown_timeout", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("actor", sa.String(250), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("light_jobs")
    with op.batch_alter_table("members") as batch:
        for column in ("connect_pid_started", "connect_pid", "connect_port", "light_jobs"):
            batch.drop_column(column)
