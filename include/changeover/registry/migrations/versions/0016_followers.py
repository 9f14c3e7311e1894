"""zero-downtime moves: when a standby was given a checkpoint of its own to follow its predecessor read-only

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_runs") as batch:
        batch.add_column(sa.Column("following_since", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_runs") as batch:
        batch.drop_column("following_since")
