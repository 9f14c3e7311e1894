"""job code artifacts and entry kinds, declared sinks per run, ledger epochs; the (string, long) result table goes

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
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('code', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('entry', sa.String(length=16), nullable=False, server_default='build'))
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sinks', sa.JSON(), nullable=True))
    with op.batch_alter_table('sink_ledger', schema=None) as batch_op:
        batch_op.add_column(sa.Column('run_id', sa.BigInteger(), nullable=True))
    op.drop_table('stage_results')
    # Its ledger described the rows just dropped: kept, it would make the new sinks skip those batches.
    op.execute("DELETE FROM sink_ledger")


def downgrade() -> None:
    op.create_table('stage_results',
                    sa.Column('job', sa.String(length=100), nullable=False),
                    sa.Column('stage', sa.String(length=100), nullable=False),
                    sa.Column('result_key', sa.String(length=300), nullable=False),
                    sa.Column('value', sa.BigInteger(), nullable=False),
                    sa.Column('batch_id', sa.BigInteger(), nullable=False),
                    sa.PrimaryKeyConstraint('job', 'stage', 'result_key'))
    with op.batch_alter_table('sink_ledger', schema=None) as batch_op:
        batch_op.drop_column('run_id')
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_column('sinks')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('entry')
        batch_op.drop_column('code')
