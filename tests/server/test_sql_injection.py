"""SQL through run-config values and department names: stored as data, never run.

The admin types run-config values (``-c key=value``, a TOML file) and departments pick their names;
the server stores both with each run and node. Here every string key of the run config, a node's
department and a lookup by name carry SQL meant to break out of a literal (quotes, comments,
stacked statements, PostgreSQL's dollar quoting). On SQLite and PostgreSQL each value reads back
byte for byte, the lookups find nothing they should not, and every table and row is still there.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import inspect

from quorumfl.errors import NotFoundError
from quorumfl.server.config import RunConfig
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

PAYLOADS = [
    "x'; DROP TABLE runs; --",
    "x\"; DROP TABLE nodes; --",
    "' OR '1'='1",
    "1; DELETE FROM rounds",
    "$$; DROP TABLE runs; $$",
    "x') ON CONFLICT DO NOTHING; DROP TABLE model_versions; --",
    "\\'; DROP TABLE runs; --",
    "%' AND 1=1 --",
]
TEXT_KEYS = [name for name, (_, kind, _) in RunConfig.declared().items() if kind is str and name != "roster"]


@pytest.fixture
def repo(db_url: str) -> Repository:
    return Repository(connect(db_url, migrate=True))


def _tables(repo: Repository) -> set[str]:
    bind = repo.sessions.kw["bind"]
    return set(inspect(bind).get_table_names())


def test_sql_in_every_text_run_config_key_and_department_is_stored_as_data(repo: Repository) -> None:
    tables = _tables(repo)
    assert {"runs", "nodes", "rounds"} <= tables
    for payload in PAYLOADS:
        config = {**RunConfig.defaults(), **dict.fromkeys(TEXT_KEYS, payload)}
        run = repo.create_run(flower_run_id=None, config=config, strategy="fedavg", num_rounds=1)
        assert {k: repo.get_run(run.id).config[k] for k in TEXT_KEYS} == dict.fromkeys(TEXT_KEYS, payload)
    for i, payload in enumerate(PAYLOADS):
        repo.touch_node(1000 + i, department=payload)
        assert [n.node_id for n in repo.find_nodes(payload)] == [1000 + i]
    assert [n.department for n in sorted(repo.list_nodes(), key=lambda n: n.node_id)] == PAYLOADS
    with pytest.raises(NotFoundError):
        repo.find_nodes("' OR '1'='1' --")
    assert _tables(repo) == tables
    assert len(repo.list_runs()) == len(PAYLOADS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=60))
def test_any_text_in_a_run_config_value_reads_back_unchanged(repo: Repository, value: str) -> None:
    config = {**RunConfig.defaults(), "selection-key": value, "task-schema": value}
    run = repo.create_run(flower_run_id=None, config=config, strategy="fedavg", num_rounds=1)
    stored = repo.get_run(run.id).config
    assert (stored["selection-key"], stored["task-schema"]) == (value, value)
