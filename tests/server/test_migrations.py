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


def test_head_constant_is_the_newest_migration(db_url: str) -> None:
    """``require_current`` compares with ``HEAD`` (no Alembic import when reading): it must be the head
    of the migrations folder, and a migrated database must hold it."""
    from alembic.script import ScriptDirectory

    from quorumfl.server.state.database import HEAD, require_current

    engine = create(db_url)
    assert ScriptDirectory.from_config(migration_config(engine)).get_current_head() == HEAD
    upgrade(engine)
    require_current(engine)
    with engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == HEAD
    engine.dispose()
