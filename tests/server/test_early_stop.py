"""Stopping early: a run stops after ``early-stop-patience`` rounds without a better round figure,
records where, ends ``completed`` (not partial) and says so; the rule against a numpy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumfl.errors import ConfigError
from quorumfl.server.config import AUTO_PATIENCE, AUTO_ROUNDS, RunConfig, load_run_config_file
from quorumfl.server.early_stop import EARLY_STOP, EarlyStop, round_figure
from quorumfl.server.services import run_closing, run_summaries, run_summary
from quorumfl.server.state.repository import RunStatus

from .test_rounds import LoopbackGrid, _contexts, _federation, federation_parts, task_identity  # noqa: F401


def _reference_stop(values: list[float], patience: int) -> int | None:
    """The index after which a run stops: the first i whose best so far came ``patience`` or more
    figures earlier (numpy: running maximum, first index where it was reached)."""
    running = np.maximum.accumulate(np.asarray(values))
    for i in range(len(values)):
        first_best = int(np.flatnonzero(np.asarray(values[: i + 1]) == running[i])[0])
        if i - first_best >= patience:
            return i
    return None


@given(st.lists(st.integers(0, 6).map(float), min_size=1, max_size=25), st.integers(1, 5))
def test_the_stop_comes_where_the_reference_says(values: list[float], patience: int) -> None:
    stop = EarlyStop(patience, higher_is_better=True)
    stopped = next((i for i, v in enumerate(values) if stop.update(v)), None)
    assert stopped == _reference_stop(values, patience)
    lower = EarlyStop(patience, higher_is_better=False)  # MAE: the same rule on the negated figures
    assert next((i for i, v in enumerate(values) if lower.update(-v)), None) == stopped


def test_failed_rounds_and_patience_zero_never_stop() -> None:
    stop = EarlyStop(2, higher_is_better=True)
    assert not any(stop.update(v) for v in [0.5, None, float("nan"), None])
    assert not any(EarlyStop(0, higher_is_better=True).update(0.1) for _ in range(10))
    assert round_figure({"federated-mae": 3.0}, "mae") == 3.0 and round_figure({"accuracy": 0.7}, "accuracy") == 0.7
    assert round_figure({"train-loss": 0.3}, "accuracy") is None


def test_a_run_that_stops_improving_stops_and_says_so(tmp_path: Path, federation_parts: dict[str, Path]) -> None:  # noqa: F811
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    # a learning rate too small to change what the model predicts: no round improves on the first
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{
        "num-rounds": 10, "early-stop-patience": 2, "learning-rate": 1e-9, "local-baseline": False,
        "finetune-epochs": 0})
    run = repo.get_run(federation.run())
    assert run.status == RunStatus.COMPLETED and len(run.rounds) == 3  # round 1, then 2 without a better figure
    assert [m.round for m in repo.metrics(run.id, name=EARLY_STOP)] == [3]
    summary = run_summary(repo, run)
    assert summary["stopped_early_after"] == 3 and summary["rounds_completed"] == 3
    assert run_summaries(repo.engine) == [summary]
    assert "stopped early: no better accuracy in 2 rounds" in run_closing(repo, run, 1.0)


def test_auto_rounds_run_until_the_figure_stops_improving(tmp_path: Path, federation_parts: dict[str, Path]) -> None:  # noqa: F811
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{
        "num-rounds": "auto", "learning-rate": 1e-9, "local-baseline": False, "finetune-epochs": 0})
    run = repo.get_run(federation.run())
    assert run.status == RunStatus.COMPLETED and run.num_rounds == AUTO_ROUNDS
    assert len(run.rounds) == 1 + AUTO_PATIENCE  # round 1, then AUTO_PATIENCE without a better figure
    assert [m.round for m in repo.metrics(run.id, name=EARLY_STOP)] == [1 + AUTO_PATIENCE]


def test_auto_rounds_are_written_out_as_numbers_before_anything_is_sent(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[run]\nnum-rounds = "auto"\n')
    assert load_run_config_file(path) == {"num-rounds": AUTO_ROUNDS, "early-stop-patience": AUTO_PATIENCE}
    path.write_text('[run]\nnum-rounds = "auto"\nearly-stop-patience = 5\n')
    assert load_run_config_file(path) == {"num-rounds": AUTO_ROUNDS, "early-stop-patience": 5}
    config = RunConfig.from_mapping({"num-rounds": "auto"})
    assert (config.num_rounds, config.early_stop_patience) == (AUTO_ROUNDS, AUTO_PATIENCE)
    path.write_text('[run]\nnum-rounds = "many"\n')
    with pytest.raises(ConfigError, match="num-rounds"):
        load_run_config_file(path)
