"""TensorBoard scalars (run config ``tensorboard-dir``): the event file, read back with TensorBoard's
own event reader, holds the state DB's numbers round by round (read independently with SQL), and a
failing run still leaves a readable event file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from quorumfl.server.board import run_observed

from .test_rounds import (  # noqa: F401  (fixtures)
    LoopbackGrid,
    _contexts,
    _federation,
    federation_parts,
    nan_update,
    silent,
    task_identity,
)


def _events(folder: Path) -> dict[str, dict[int, float]]:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def test_event_file_holds_the_state_dbs_series(tmp_path: Path, federation_parts: dict[str, Path]) -> None:  # noqa: F811
    contexts = _contexts(federation_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts, {ids[3]: nan_update, ids[5]: silent})
    board = tmp_path / "board"
    federation, _ = _federation(tmp_path, grid, **{"round-timeout": 1.0, "num-rounds": 2, "tensorboard-dir": str(board)})
    run_id = run_observed(federation)
    assert [p.name for p in board.iterdir()] == [f"run-{run_id}"]
    series = _events(board / f"run-{run_id}")

    engine = create_engine(f"sqlite:///{tmp_path / 'state.db'}")
    with engine.connect() as conn:
        rounds = conn.execute(text("select number, timings, participants from rounds where run_id = :r"), {"r": run_id}).all()
        metrics = conn.execute(text("select round, node_id, name, value from metrics where run_id = :r"), {"r": run_id}).all()
        names = dict(conn.execute(text("select node_id, department from nodes")).all())
    engine.dispose()
    assert len(rounds) == 2
    for number, timings, participants in rounds:
        for name, value in ((n, v) for r, node, n, v in metrics if r == number and node is None):
            tag = f"final/{name}" if name.startswith("final-") else f"metric/{name}"  # the run's final model
            assert series[tag][number] == pytest.approx(value, rel=1e-6)
        for stage, seconds in json.loads(timings).items():
            if stage != "local_train_max":
                assert series[f"stage-seconds/{stage}"][number] == pytest.approx(seconds, rel=1e-6)
        up = sum(v for r, node, n, v in metrics if r == number and n == "uplink-bytes")
        assert series["bytes/up"][number] == pytest.approx(up)
        assert series["bytes/down"][number] > 0
        assert series["participation/trained"][number] == len(json.loads(participants))
        assert series["participation/rejected"][number] == 1  # the NaN update
        assert series["participation/dropped"][number] == 1  # the silent node
    finals = [(node, n, v) for r, node, n, v in metrics if node is not None and n.startswith("final-")]
    assert finals
    for node, name, value in finals:
        department = names.get(node) or str(node)
        assert series[f"final/{department}/{name.removeprefix('final-')}"][2] == pytest.approx(value, rel=1e-6)


def test_a_failed_run_still_closes_its_event_file(tmp_path: Path, federation_parts: dict[str, Path]) -> None:  # noqa: F811
    contexts = _contexts(federation_parts)
    grid = LoopbackGrid(contexts, {node: silent for node in contexts})  # nobody answers: no round completes
    board = tmp_path / "board"
    federation, repo = _federation(tmp_path, grid, **{"round-timeout": 0.5, "num-rounds": 1, "tensorboard-dir": str(board)})
    with pytest.raises(Exception, match="none of the 1 round"):
        run_observed(federation)
    [folder] = list(board.iterdir())
    series = _events(folder)
    assert not any(tag.startswith("metric/") for tag in series)  # the failed round wrote no figures
    assert repo.list_runs()[-1].status == "failed"
