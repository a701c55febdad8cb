"""Key ceremonies and threshold decryptions (threshold CKKS audit trail).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 16:30:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('key_ceremonies',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('key_id', sa.String(length=32), nullable=True),
    sa.Column('threshold', sa.Integer(), nullable=True),
    sa.Column('members', sa.JSON(), nullable=False),
    sa.Column('holders', sa.JSON(), nullable=False),
    sa.Column('params', sa.JSON(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('requested_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_key_ceremonies_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_key_ceremonies'))
    )
    with op.batch_alter_table('key_ceremonies', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_key_ceremonies_run_id'), ['run_id'], unique=False)

    op.create_table('decryptions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('round_id', sa.Integer(), nullable=False),
    sa.Column('key_id', sa.String(length=32), nullable=False),
    sa.Column('contributors', sa.JSON(), nullable=False),
    sa.Column('decryptors', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['round_id'], ['rounds.id'], name=op.f('fk_decryptions_round_id_rounds'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_decryptions'))
    )
    with op.batch_alter_table('decryptions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_decryptions_round_id'), ['round_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('decryptions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_decryptions_round_id'))
    op.drop_table('decryptions')
    with op.batch_alter_table('key_ceremonies', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_key_ceremonies_run_id'))
    op.drop_table('key_ceremonies')
