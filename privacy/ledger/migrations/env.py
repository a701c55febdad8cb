"""Alembic environment of the privacy ledger: runs against the engine handed over in ``config.attributes``."""

from __future__ import annotations

from alembic import context

from quorumfl.privacy.ledger.orm import Base

config = context.config


def run_migrations_online() -> None:
    engine = config.attributes["engine"]
    with engine.begin() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True,
                          compare_type=True, version_table="privacy_ledger_version")
        context.run_migrations()


run_migrations_online()
