"""Round progress: the stage a running round is in and how many nodes were asked, answered, failed;
a node registered at the SuperLink is listed before it is first seen (last_seen NULL).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | Sequence[str] | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('rounds') as batch:
        batch.add_column(sa.Column('progress', sa.JSON(), nullable=True))
    with op.batch_alter_table('nodes') as batch:
        batch.alter_column('last_seen', existing_type=sa.DateTime(timezone=True), nullable=True)


def downgrade() -> None:
    op.execute("UPDATE nodes SET last_seen = first_seen WHERE last_seen IS NULL")
    with op.batch_alter_table('nodes') as batch:
        batch.alter_column('last_seen', existing_type=sa.DateTime(timezone=True), nullable=False)
    with op.batch_alter_table('rounds') as batch:
        batch.drop_column('progress')
