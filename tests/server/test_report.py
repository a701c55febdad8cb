"""``quorumfl runs report``: the JSON form's numbers are the state DB's, read back independently with
SQL; the HTML page has every section, embeds its figures (no network) and is replaced whole.

The run comes from the real round loop on the loopback grid (honest, NaN-sending, erroring and silent
nodes), then an admin rollback and a second run, so the report sees failures, rejections, bytes
and a rollback as the server records them."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image
from sqlalchemy import create_engine, text

from quorumfl.server.department_record import department_record
from quorumfl.server.report import participation_state
from quorumfl.server.state.artifacts import ArtifactRecords, NewArtifact
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

from .test_cli_truth import cli
from .test_rounds import (  # noqa: F401  (fixtures)
    LoopbackGrid,
    _contexts,
    _federation,
    error_reply,
    federation_parts,
    nan_update,
    silent,
    task_identity,
)


@pytest.fixture
def recorded(tmp_path: Path, federation_parts: dict[str, Path]) -> tuple[str, int]:  # noqa: F811
    contexts = _contexts(federation_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts, {ids[3]: nan_update, ids[4]: error_reply, ids[5]: silent})
    federation, repo = _federation(tmp_path, grid, **{"round-timeout": 1.0, "num-rounds": 2})
    first = federation.run()
    # the admin rolls the head back to round 1's model; the next run starts from it
    versions = repo.list_model_versions(run_id=first)
    repo.rollback(versions[0].id)
    federation, _ = _federation(tmp_path, LoopbackGrid(contexts), **{"num-rounds": 1, "start-from": "head"})
    second = federation.run()
    assert first != second
    return f"sqlite:///{tmp_path / 'state.db'}", second


def _sql(url: str, query: str, **params: object) -> list[tuple[object, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(query), params)]
    finally:
        engine.dispose()


def test_json_report_numbers_are_the_state_dbs(recorded: tuple[str, int], monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = recorded
    code, out, err = cli(monkeypatch, capsys, "--db", url, "runs", "report", "1", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    names = dict(_sql(url, "select node_id, department from nodes"))

    # per round: every global metric, the stage timings, the bytes
    for rnd in data["rounds"]:
        round_id, timings = _sql(url, "select id, timings from rounds where run_id = 1 and number = :n",
                                 n=rnd["round"])[0]
        stored = json.loads(str(timings))
        assert rnd["stages_s"] == {k: v for k, v in stored.items() if k != "local_train_max"}
        assert rnd["slowest_training_s"] == stored["local_train_max"]
        metrics = dict(_sql(url, "select name, value from metrics where run_id = 1 and round = :n and node_id is null",
                            n=rnd["round"]))
        final = {k: metrics.pop(k) for k in list(metrics) if k.startswith("final-")}  # the run's final model
        assert rnd["metrics"] == pytest.approx(metrics)
        assert all(data["final"][k] == v for k, v in final.items())
        assert rnd["downlink_bytes"] == metrics["downlink-bytes"] > 0
        [(uplink,)] = _sql(url, "select sum(value) from metrics where run_id = 1 and round = :n and name = 'uplink-bytes'",
                           n=rnd["round"])
        assert rnd["uplink_bytes"] == uplink
        failures = _sql(url, "select node_id, stage, reason from round_failures where round_id = :r", r=round_id)
        assert sorted((f["node"], f["stage"], f["reason"]) for f in rnd["failures"]) == sorted(
            (names.get(int(str(n))) or str(n), s, r) for n, s, r in failures)

    # the participation map: every selected node has the state its record gives, round by round
    cells = data["participation"]["nodes"]
    for number, selected, participants in _sql(url, "select number, selected, participants from rounds where run_id = 1"):
        for node in json.loads(str(selected)):
            state = cells[names.get(node) or str(node)][str(number)]
            assert (state == "trained") == (node in json.loads(str(participants)))
    states = {s for row in cells.values() for s in row.values()}
    assert {"trained", "rejected", "dropped"} <= states  # NaN update rejected; error and silence dropped

    # departments' final metrics
    finals = _sql(url, "select node_id, name, value from metrics where run_id = 1 and name like 'final-%' "
                       "and node_id is not null")
    assert len(finals) > 0
    for node, name, value in finals:
        [row] = [d for d in data["departments"] if d["node_id"] == str(node)]
        assert row[str(name).removeprefix("final-")] == value

    # update monitoring: each accepted update's norm, cosine and flag
    norms = _sql(url, "select round, node_id, value from metrics where run_id = 1 and name = 'update-norm'")
    assert len(norms) == len(data["monitoring"]) > 0
    for number, node, value in norms:
        [row] = [m for m in data["monitoring"] if m["round"] == number and m["department"] == (names.get(int(str(node))) or str(node))]
        assert row["norm"] == value and isinstance(row["flagged"], bool)

    # model versions of the run
    versions = _sql(url, "select id, round, parent_id from model_versions where run_id = 1 order by id")
    assert [(v["version"], v["round"], v["parent"]) for v in data["versions"]] == versions


def test_a_rollback_shows_in_the_next_run(recorded: tuple[str, int], monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    url, second = recorded
    code, out, err = cli(monkeypatch, capsys, "--db", url, "runs", "report", str(second), "--format", "json")
    assert code == 0, err
    [version] = json.loads(out)["versions"]
    [(round_one,)] = _sql(url, "select id from model_versions where run_id = 1 and round = 1")
    assert version["parent"] == round_one  # started from the rolled-back head, not run 1's last model


def test_html_report_has_every_section_and_works_offline(recorded: tuple[str, int], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = recorded
    out = tmp_path / "reports"
    code, _, err = cli(monkeypatch, capsys, "--db", url, "runs", "report", "1", "--out", str(out))
    assert code == 0, err
    page = (out / "run-1.html").read_text(encoding="utf-8")
    for section in ("summary", "metric", "departments", "stages", "participation", "bytes", "privacy", "monitoring",
                    "versions"):
        assert f'<section id="{section}">' in page, section
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched from the network
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 5  # metric, stages, participation, bytes, update norms (no DP in this run: no ε figure)
    for encoded in images:
        with Image.open(io.BytesIO(base64.b64decode(encoded))) as image:
            assert image.format == "PNG" and image.width > 100
    assert list(out.iterdir()) == [out / "run-1.html"]  # no partial file left behind


def test_report_input_errors_are_one_line(recorded: tuple[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = recorded
    a_file = tmp_path / "taken"
    a_file.write_text("keep me")
    code, _, err = cli(monkeypatch, capsys, "--db", url, "runs", "report", "1", "--out", str(a_file))
    assert code != 0 and "--out" in err and "is a file" in err and len(err.strip().splitlines()) == 1
    assert a_file.read_text() == "keep me"
    code, _, err = cli(monkeypatch, capsys, "--db", url, "runs", "report", "77", "--format", "json")
    assert code != 0 and "77" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("stage", "reason", "state"), [
    ("late", "not among the first 3 replies (over-selection)", "late"),
    ("deadline", "no reply within the round deadline (30s)", "late"),
    ("aggregate", "'w' contains 2 non-finite value(s)", "rejected"),
    ("rejected", "train: reply answers no open request", "rejected"),
    ("dp-budget", "refused: ε would exceed the budget", "refused"),
    ("train", "no reply within the train deadline (30s)", "dropped"),
    ("secagg-unmask", "node error 1: gone", "dropped"),
])
def test_participation_states(stage: str, reason: str, state: str) -> None:
    assert participation_state(stage, reason) == state


def test_compare_overlays_runs_and_names_what_differs(recorded: tuple[str, int], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    url, second = recorded
    code, out, err = cli(monkeypatch, capsys, "--db", url, "runs", "compare", "1", str(second), "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert [r["run"]["id"] for r in data["runs"]] == [1, second]
    assert data["config_differences"]["num-rounds"] == [2, 1]
    assert data["config_differences"]["start-from"] == ["fresh", "head"]
    assert "seed" not in data["config_differences"]  # the same in both
    code, _, err = cli(monkeypatch, capsys, "--db", url, "runs", "compare", "1", str(second), "--out", str(tmp_path))
    assert code == 0, err
    page = (tmp_path / f"compare-1-{second}.html").read_text(encoding="utf-8")
    assert all(f'<section id="{s}">' in page for s in ("metric", "summary", "config"))
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 1
    code, _, err = cli(monkeypatch, capsys, "--db", url, "runs", "compare", "1", "--format", "json")
    assert code != 0 and "at least two runs" in err


def test_department_record_follows_its_updates_into_versions_and_edge_channels(
        recorded: tuple[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    url, second = recorded
    repo = Repository(connect(url))
    [(silent_id,)] = _sql(url, "select distinct node_id from round_failures where reason like 'no reply%'")
    run_two = repo.list_model_versions(run_id=second)[0]
    ArtifactRecords(repo.sessions).add(version=1, channel="stable", model_version_id=run_two.id, items=[
        NewArtifact(format="onnx", size_bytes=10, sha256="ab" * 32, signature="cd" * 64, manifest="{}", path="/x")])

    code, out, err = cli(monkeypatch, capsys, "--db", url, "nodes", "report", "tax-office", "--format", "json")
    assert code == 0, err
    record = json.loads(out)
    [(tax_id,)] = _sql(url, "select node_id from nodes where department = 'tax-office'")
    took = {(run["run"], r["round"]) for run in record["runs"] for r in run["rounds"] if r["took_part"]}
    expected = {(run, number) for run, number, participants in
                _sql(url, "select run_id, number, participants from rounds") if int(str(tax_id)) in json.loads(str(participants))}
    assert took == expected == {(1, 1), (1, 2), (second, 1)}
    made = {v for run, number in took for (v,) in _sql(url, "select id from model_versions where run_id = :r and round = :n",
                                                           r=run, n=number)}
    assert set(record["contributed_versions"]) == made
    assert [(p["channel"], p["model_version"]) for p in record["published"]] == [("stable", run_two.id)]
    assert all(run["secure_aggregation"] == "none" for run in record["runs"])

    # the node silent through run 1: its rounds there are failures, its updates reach run 2's version only
    silent = department_record(repo, str(silent_id))
    first = next(run for run in silent["runs"] if run["run"] == 1)
    assert [(r["took_part"], [f["state"] for f in r["failures"]]) for r in first["rounds"]] == [(False, ["dropped"])] * 2
    assert silent["contributed_versions"] == [run_two.id]
    assert [p["model_version"] for p in silent["published"]] == [run_two.id]

    code, _, err = cli(monkeypatch, capsys, "--db", url, "nodes", "report", "tax-office", "--out", str(tmp_path))
    assert code == 0, err
    page = (tmp_path / "department-tax-office.html").read_text(encoding="utf-8")
    assert all(f'<section id="{s}">' in page for s in ("summary", "rounds", "versions", "published"))
    code, _, err = cli(monkeypatch, capsys, "--db", url, "nodes", "report", "no-such-dept", "--format", "json")
    assert code != 0 and "no-such-dept" in err and len(err.strip().splitlines()) == 1
