"""Alembic: upgrade from empty matches the ORM exactly; downgrade removes everything."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from quorumfl.server.state.database import create, migration_config, upgrade
from quorumfl.server.state.orm import Base


def test_upgrade_from_empty_matches_models(db_url: str) -> None:
    engine = create(db_url)
    upgrade(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    engine.dispose()


def test_downgrade_to_base_and_up_again(db_url: str) -> None:
    engine = create(db_url)
    upgrade(engine)
    command.downgrade(migration_config(engine), "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(engine)
    assert "runs" in inspect(engine).get_table_names()
    engine.dispose()
