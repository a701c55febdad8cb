"""Hyper-parameter searches: each trial's values, its run, its figures per round and its final figure.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 09:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | Sequence[str] | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'search_trials',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('study', sa.String(length=64), nullable=False),
        sa.Column('number', sa.Integer(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('params', sa.JSON(), nullable=False),
        sa.Column('space', sa.JSON(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=True),
        sa.Column('metric', sa.String(length=64), nullable=True),
        sa.Column('higher_is_better', sa.Boolean(), nullable=False),
        sa.Column('figures', sa.JSON(), nullable=False),
        sa.Column('value', sa.Float(), nullable=True),
        sa.Column('notes', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_search_trials_run_id_runs'),
                                ondelete='SET NULL'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_search_trials')),
        sa.UniqueConstraint('study', 'number', name='uq_search_trials_study_number'),
    )
    with op.batch_alter_table('search_trials') as batch:
        batch.create_index(batch.f('ix_search_trials_study'), ['study'], unique=False)
        batch.create_index(batch.f('ix_search_trials_run_id'), ['run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('search_trials') as batch:
        batch.drop_index(batch.f('ix_search_trials_run_id'))
        batch.drop_index(batch.f('ix_search_trials_study'))
    op.drop_table('search_trials')
