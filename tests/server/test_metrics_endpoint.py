"""The Prometheus endpoint (``server start --metrics-port``): served over real HTTP on loopback, it
parses with ``prometheus_client``'s own parser and its numbers are the state DB's, read with SQL."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from quorumfl.deploy.processes import free_port
from quorumfl.server.metrics_endpoint import serve_metrics
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

from .test_report import recorded  # noqa: F401  (a fixture: two real loopback runs)
from .test_rounds import federation_parts, task_identity  # noqa: F401  (fixtures)


@pytest.fixture
def scraped(recorded: tuple[str, int]) -> Iterator[tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]:  # noqa: F811
    url, _ = recorded
    port = free_port()
    server, thread = serve_metrics(Repository(connect(url)), port=port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            body = response.read().decode()
    finally:
        server.shutdown()
        thread.join(timeout=10)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    yield url, samples


def _sql(url: str, query: str) -> list[tuple[object, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(query))]
    finally:
        engine.dispose()


def test_endpoint_reports_the_state_dbs_numbers(scraped: tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]],
                                                tmp_path: Path) -> None:
    url, samples = scraped
    for status, count in _sql(url, "select status, count(*) from rounds group by status"):
        assert samples[("quorumfl_rounds_total", (("status", str(status)),))] == count
    for status, count in _sql(url, "select status, count(*) from runs group by status"):
        assert samples[("quorumfl_runs", (("status", str(status)),))] == count
    totals: dict[str, float] = {}
    for (timings,) in _sql(url, "select timings from rounds where status = 'completed'"):
        for stage, seconds in json.loads(str(timings)).items():
            totals[stage] = totals.get(stage, 0.0) + seconds
    for stage, seconds in totals.items():
        if stage != "local_train_max":
            assert samples[("quorumfl_stage_seconds_total", (("stage", stage),))] == pytest.approx(seconds)
    [(up,)] = _sql(url, "select sum(value) from metrics where name = 'uplink-bytes'")
    [(down,)] = _sql(url, "select sum(value) from metrics where name = 'downlink-bytes'")
    assert samples[("quorumfl_bytes_total", (("direction", "up"),))] == up
    assert samples[("quorumfl_bytes_total", (("direction", "down"),))] == down > 0
    [(known,)] = _sql(url, "select count(*) from nodes")
    assert samples[("quorumfl_nodes", (("state", "known"),))] == known
    [(number, selected, participants, round_id)] = _sql(
        url, "select number, selected, participants, id from rounds order by started_at desc, id desc limit 1")
    assert samples[("quorumfl_last_round_number", ())] == number
    assert samples[("quorumfl_last_round_nodes", (("state", "selected"),))] == len(json.loads(str(selected)))
    assert samples[("quorumfl_last_round_nodes", (("state", "trained"),))] == len(json.loads(str(participants)))
    [(failed,)] = _sql(url, f"select count(*) from round_failures where round_id = {round_id}")
    assert samples[("quorumfl_last_round_nodes", (("state", "failed"),))] == failed


def test_an_empty_state_db_still_scrapes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    port = free_port()
    server, thread = serve_metrics(Repository(connect(url, migrate=True)), port=port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            families = {f.name for f in text_string_to_metric_families(response.read().decode())}
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert {"quorumfl_rounds", "quorumfl_stage_seconds", "quorumfl_bytes", "quorumfl_nodes"} <= families
