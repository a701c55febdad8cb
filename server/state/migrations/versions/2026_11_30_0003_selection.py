"""Client selection: selector state kept across runs, and each round's choice and reward.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 06:30:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('selector_states',
    sa.Column('key', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('rounds', sa.Integer(), nullable=False),
    sa.Column('state', sa.JSON(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_selector_states'))
    )
    op.create_table('selection_records',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('round', sa.Integer(), nullable=False),
    sa.Column('policy', sa.String(length=16), nullable=False),
    sa.Column('choices', sa.JSON(), nullable=False),
    sa.Column('outcomes', sa.JSON(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=False),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_selection_records_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_selection_records')),
    sa.UniqueConstraint('run_id', 'round', name='uq_selection_records_run_round')
    )
    with op.batch_alter_table('selection_records', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_selection_records_run_id'), ['run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('selection_records', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_selection_records_run_id'))
    op.drop_table('selection_records')
    op.drop_table('selector_states')
