"""Alembic environment: runs against the engine handed over in ``config.attributes``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from quorumfl.server.state.orm import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        url = config.get_main_option("sqlalchemy.url")
        if not url:
            raise RuntimeError("no engine or sqlalchemy.url given to the QuorumFL migrations")
        engine = create_engine(url)
    with engine.begin() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        context.run_migrations()


run_migrations_online()
