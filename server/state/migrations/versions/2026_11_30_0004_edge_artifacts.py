"""Edge artifacts: signed INT8 exports of promoted model versions, by version, channel and format.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | Sequence[str] | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('edge_artifacts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('channel', sa.String(length=16), nullable=False),
    sa.Column('format', sa.String(length=8), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('signature', sa.String(length=128), nullable=False),
    sa.Column('manifest', sa.Text(), nullable=False),
    sa.Column('model_version_id', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['model_version_id'], ['model_versions.id'], name=op.f('fk_edge_artifacts_model_version_id_model_versions')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_edge_artifacts')),
    sa.UniqueConstraint('version', 'format', name='uq_edge_artifacts_version_format')
    )
    with op.batch_alter_table('edge_artifacts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_edge_artifacts_channel'), ['channel'], unique=False)
        batch_op.create_index(batch_op.f('ix_edge_artifacts_model_version_id'), ['model_version_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_edge_artifacts_version'), ['version'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('edge_artifacts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_edge_artifacts_version'))
        batch_op.drop_index(batch_op.f('ix_edge_artifacts_model_version_id'))
        batch_op.drop_index(batch_op.f('ix_edge_artifacts_channel'))
    op.drop_table('edge_artifacts')
