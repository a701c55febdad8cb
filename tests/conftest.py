"""Shared fixtures: state databases on SQLite and on the PostgreSQL server at 127.0.0.1:5432."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

PG_URL = os.environ.get("QUORUMFL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REQUIRE_PG = os.environ.get("QUORUMFL_REQUIRE_POSTGRES") == "1"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test touches the user's ~/.quorumfl."""
    monkeypatch.setenv("QUORUMFL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QUORUMFL_DB_URL", raising=False)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'state.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh schema in the PostgreSQL test database, dropped afterwards."""
    admin = create_engine(PG_URL)
    schema = f"qfl_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError as exc:
        admin.dispose()
        if REQUIRE_PG:
            pytest.fail(f"PostgreSQL at {PG_URL} is required (QUORUMFL_REQUIRE_POSTGRES=1) but unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {PG_URL} unreachable")
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """The same suite runs on both backends."""
    name = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(name))
