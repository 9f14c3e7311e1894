"""savepoint leases: a savepoint being built is held by its builder's lease, renewed while it works

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('savepoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('savepoints', schema=None) as batch_op:
        batch_op.drop_column('lease_until')
