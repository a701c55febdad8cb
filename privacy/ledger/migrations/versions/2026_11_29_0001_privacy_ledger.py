"""privacy ledger: spends and refusals

Revision ID: 0001_privacy_ledger
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_privacy_ledger"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "privacy_spend",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("noise_multiplier", sa.Float(), nullable=False),
        sa.Column("sample_rate", sa.Float(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("delta", sa.Float(), nullable=False),
        sa.Column("epsilon_total", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("run", "round", name="uq_spend_run_round"),
    )
    op.create_index("ix_privacy_spend_run", "privacy_spend", ["run"])
    op.create_table(
        "privacy_refusals",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("epsilon_would_be", sa.Float(), nullable=False),
        sa.Column("budget", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_privacy_refusals_run", "privacy_refusals", ["run"])


def downgrade() -> None:
    op.drop_index("ix_privacy_refusals_run", "privacy_refusals")
    op.drop_table("privacy_refusals")
    op.drop_index("ix_privacy_spend_run", "privacy_spend")
    op.drop_table("privacy_spend")
