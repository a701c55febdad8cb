"""Engines, the default database location, and Alembic upgrades.

Default: a SQLite file ``quorumfl.db`` under the QuorumFL home (``$QUORUMFL_HOME`` or
``~/.quorumfl``); any SQLAlchemy URL works (``$QUORUMFL_DB_URL`` or ``--db``). SQLite runs in WAL
mode so the CLI can read while the ServerApp writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event, inspect, make_url, text
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from quorumfl.core.files import default_home
from quorumfl.errors import ConfigError, StateError

if TYPE_CHECKING:  # Alembic is imported only to migrate, the ORM only by what uses sessions: reading
    # commands start faster without them
    from alembic.config import Config
    from sqlalchemy.orm import Session, sessionmaker

__all__ = ["HEAD", "connect", "default_url", "migration_config", "reader", "require_current", "upgrade"]

MIGRATIONS = Path(__file__).parent / "migrations"
# The newest migration's revision: what a current database's alembic_version holds. Kept here so that
# checking a database needs no Alembic import; tests/server/test_migrations.py checks it is the head
# of the migrations folder.
HEAD = "0006"


def default_url(home: Path | None = None) -> str:
    if url := os.environ.get("QUORUMFL_DB_URL"):
        return url
    return f"sqlite:///{(home or default_home()) / 'quorumfl.db'}"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def create(url: str, *, create_missing: bool = True) -> Engine:
    """An engine for ``url``; pragmas set. A SQLite file's parent folders are created, unless
    ``create_missing`` is false: then a missing SQLite file is refused (nothing is created)."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"database URL '{url}' is not a valid SQLAlchemy URL ({exc})") from exc
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            path = Path(parsed.database).expanduser()
            if create_missing:
                path.parent.mkdir(parents=True, exist_ok=True)
            elif not path.is_file():
                raise StateError(f"no state database at {path}; check --home / --db / QUORUMFL_DB_URL, or create it "
                                 "by starting the server ('quorumfl server start') or 'quorumfl db upgrade'")
        kwargs["connect_args"] = {"timeout": 30}
    try:
        engine = create_engine(parsed, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise ConfigError(f"database URL '{url}': {exc}") from exc
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def migration_config(engine: Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision``."""
    from alembic import command

    try:
        command.upgrade(migration_config(engine), revision)
    except SQLAlchemyError as exc:
        raise StateError(f"cannot migrate the state database at {engine.url!r} ({_first_line(exc)}); check --db / "
                         "QUORUMFL_DB_URL and that the database server is running") from exc


def _first_line(exc: SQLAlchemyError) -> str:
    """The driver's own message, first line only (SQLAlchemy appends the SQL and a link)."""
    cause = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def require_current(engine: Engine) -> None:
    """Fail with a clear error when the database is unreachable or not at the newest migration."""
    try:
        with engine.connect() as conn:
            current = (conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
                       if inspect(conn).has_table("alembic_version") else None)
    except SQLAlchemyError as exc:
        raise StateError(
            f"cannot reach the state database at {engine.url!r} ({_first_line(exc)}); "
            "check --db / QUORUMFL_DB_URL and that the database server is running"
        ) from exc
    head = HEAD
    if current != head:
        raise StateError(
            f"the state database at {engine.url!r} is at migration {current}, expected {head}; "
            "run 'quorumfl db upgrade'"
        )


def connect(url: str | None = None, *, migrate: bool = False) -> sessionmaker[Session]:
    """A session factory for ``url`` (default: ``default_url()``), migrated (created if missing) or
    checked (a missing SQLite file is refused: reading never creates a database)."""
    from sqlalchemy.orm import sessionmaker

    if migrate:
        engine = create(url or default_url())
        upgrade(engine)
    else:
        engine = reader(url)
    return sessionmaker(engine, expire_on_commit=False)


def reader(url: str | None = None) -> Engine:
    """An engine for reading ``url`` with Core: checked as ``connect`` checks (nothing is created)."""
    engine = create(url or default_url(), create_missing=False)
    require_current(engine)
    return engine
