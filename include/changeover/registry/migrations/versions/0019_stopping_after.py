"""stopping_after per run: the batch a run stopping for a move stops after, per stage, once that batch has begun

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_runs") as batch:
        batch.add_column(sa.Column("stopping_after", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_runs") as batch:
        batch.drop_column("stopping_after")
