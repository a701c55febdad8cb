"""privacy ledger: noise plans (the σ found for a target ε, read back by later rounds)

Revision ID: 0002_noise_plans
Revises: 0001_privacy_ledger
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_noise_plans"
down_revision = "0001_privacy_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "privacy_noise_plans",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("target_epsilon", sa.Float(), nullable=False),
        sa.Column("delta", sa.Float(), nullable=False),
        sa.Column("sample_rate", sa.Float(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("noise_multiplier", sa.Float(), nullable=False),
        sa.UniqueConstraint("target_epsilon", "delta", "sample_rate", "steps", name="uq_noise_plan"),
    )


def downgrade() -> None:
    op.drop_table("privacy_noise_plans")
