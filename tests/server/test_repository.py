"""One repository suite, run on SQLite and on the PostgreSQL server (fixture ``db_url``)."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from quorumfl.errors import NotFoundError, RunStoppedError, StateError
from quorumfl.server.state.database import connect, create, require_current
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

BIG_ID = 2**64 - 5  # Flower ids are unsigned 64-bit


@pytest.fixture
def repo(db_url: str) -> Repository:
    return Repository(connect(db_url, migrate=True))


def test_run_lifecycle(repo: Repository) -> None:
    run = repo.create_run(flower_run_id=BIG_ID, config={"num-rounds": 2}, strategy="fedprox", num_rounds=2)
    rnd = repo.start_round(run.id, 1, [BIG_ID - 1, 7])
    repo.add_failure(rnd.id, 7, stage="train", reason="no reply within the round timeout (5s)")
    repo.finish_round(rnd.id, RoundStatus.COMPLETED, participants=[BIG_ID - 1], timings={"train": 1.5, "aggregate": 0.01})
    repo.add_metrics(run.id, 1, {"accuracy": 0.9})
    repo.add_metrics(run.id, 1, {"train-loss": 0.2}, node_id=BIG_ID - 1)
    repo.finish_run(run.id, RunStatus.COMPLETED)

    by_flower = repo.get_run(BIG_ID)
    by_ours = repo.get_run(run.id)
    assert by_flower.id == by_ours.id == run.id
    assert by_ours.status == RunStatus.COMPLETED and by_ours.finished_at is not None
    assert by_ours.config == {"num-rounds": 2}
    [stored] = by_ours.rounds
    assert stored.participants == [BIG_ID - 1] and stored.selected == [BIG_ID - 1, 7]
    assert stored.timings == {"train": 1.5, "aggregate": 0.01}
    assert [(f.node_id, f.stage) for f in stored.failures] == [(7, "train")]
    metrics = {(m.node_id, m.name): m.value for m in repo.metrics(run.id)}
    assert metrics == {(None, "accuracy"): 0.9, (BIG_ID - 1, "train-loss"): 0.2}


def test_restarted_round_keeps_the_aborted_attempt(repo: Repository) -> None:
    run = repo.create_run(flower_run_id=None, config={}, strategy="fedavg", num_rounds=2)
    repo.start_round(run.id, 1, [1])
    assert repo.abort_running_rounds(run.id, "server stopped") == 1
    repo.start_round(run.id, 1, [1, 2])  # redo after a stop
    repo.start_round(run.id, 1, [1, 2])  # a crash left attempt 2 running: it is aborted now
    rounds = repo.get_run(run.id).rounds
    assert [(r.number, r.attempt, r.status) for r in rounds] == [
        (1, 1, RoundStatus.ABORTED), (1, 2, RoundStatus.ABORTED), (1, 3, RoundStatus.RUNNING)
    ]
    assert rounds[0].error == "server stopped"


def test_a_stopped_run_starts_no_new_round(repo: Repository) -> None:
    """An admin's stop recorded while the ServerApp is between rounds: its next start_round writes nothing."""
    run = repo.create_run(flower_run_id=None, config={}, strategy="fedavg", num_rounds=3)
    repo.start_round(run.id, 1, [1])
    repo.finish_run(run.id, RunStatus.STOPPED, error="stopped by the admin")
    assert repo.abort_running_rounds(run.id, "run stopped by the admin") == 1
    with pytest.raises(RunStoppedError, match="round 2 is not started"):
        repo.start_round(run.id, 2, [1])
    assert [(r.number, r.status) for r in repo.get_run(run.id).rounds] == [(1, RoundStatus.ABORTED)]


@pytest.mark.parametrize("serverapp_first", [True, False])
def test_a_round_the_stop_made_fail_is_recorded_aborted_in_either_order(repo: Repository, serverapp_first: bool) -> None:
    """'runs stop' stops the run at the SuperLink, then records it. The ServerApp's round, whose node
    tasks the stop ended, fails either before that record or after it: both orders leave it aborted
    (with its failure in the reason), while a round that failed before the stop stays failed."""
    run = repo.create_run(flower_run_id=None, config={}, strategy="fedavg", num_rounds=5)
    genuine = repo.start_round(run.id, 1, [1, 2])
    repo.finish_round(genuine.id, RoundStatus.FAILED, participants=[1], timings={}, error="1 valid update")
    done = repo.start_round(run.id, 2, [1, 2])
    repo.finish_round(done.id, RoundStatus.COMPLETED, participants=[1, 2], timings={})
    open_round = repo.start_round(run.id, 3, [1, 2])
    failed_since = repo.unfinished_from(run.id)  # 'runs stop' reads this before it stops the run at the SuperLink

    def serverapp_fails() -> None:
        repo.finish_round(open_round.id, RoundStatus.FAILED, participants=[], timings={}, error="0 valid updates")

    if serverapp_first:
        serverapp_fails()
    repo.finish_run(run.id, RunStatus.STOPPED, error="run stopped by the admin")
    repo.abort_running_rounds(run.id, "run stopped by the admin", failed_since=failed_since)
    if not serverapp_first:
        serverapp_fails()
    rounds = repo.get_run(run.id).rounds
    assert [(r.number, r.status) for r in rounds] == [
        (1, RoundStatus.FAILED), (2, RoundStatus.COMPLETED), (3, RoundStatus.ABORTED)
    ]
    assert rounds[0].error == "1 valid update"
    assert rounds[2].error == "run stopped by the admin; the round had failed: 0 valid updates"


def test_unfinished_from_is_past_the_last_round_when_none_is_running(repo: Repository) -> None:
    run = repo.create_run(flower_run_id=None, config={}, strategy="fedavg", num_rounds=3)
    assert repo.unfinished_from(run.id) == 1  # no round yet: any round id
    first = repo.start_round(run.id, 1, [1])
    assert repo.unfinished_from(run.id) == first.id
    repo.finish_round(first.id, RoundStatus.FAILED, participants=[], timings={}, error="no quorum")
    mark = repo.unfinished_from(run.id)
    assert mark == first.id + 1
    repo.finish_run(run.id, RunStatus.STOPPED, error="stopped by the admin")
    assert repo.abort_running_rounds(run.id, "run stopped by the admin", failed_since=mark) == 0
    assert repo.get_run(run.id).rounds[0].status == RoundStatus.FAILED


def test_nodes_registry(repo: Repository) -> None:
    repo.touch_node(BIG_ID, department="tax-office")
    repo.touch_node(5, department="parks")
    repo.touch_node(BIG_ID)  # heartbeat without department keeps the name
    assert {n.node_id: n.department for n in repo.list_nodes()} == {BIG_ID: "tax-office", 5: "parks"}
    repo.set_enabled("tax-office", False)
    assert repo.disabled_node_ids() == {BIG_ID}
    repo.set_enabled(str(BIG_ID), True)
    assert repo.disabled_node_ids() == set()
    with pytest.raises(NotFoundError, match="no node with id or department 'library'"):
        repo.set_enabled("library", False)


def test_model_versions_heads_and_rollback(repo: Repository) -> None:
    run = repo.create_run(flower_run_id=1, config={}, strategy="fedavg", num_rounds=2)
    common = {"architecture": "mlp:1x8x8:10", "size_bytes": 10, "metrics": {"accuracy": 0.5}}
    v1 = repo.add_model_version(run_id=run.id, round_number=1, parent_id=None, path="/m/1", sha256="a" * 64, **common)
    v2 = repo.add_model_version(run_id=run.id, round_number=2, parent_id=v1.id, path="/m/2", sha256="b" * 64, **common)
    assert repo.heads() == {"mlp:1x8x8:10": v2.id}
    head = repo.head_version("mlp:1x8x8:10")
    assert head is not None and head.parent_id == v1.id
    repo.rollback(v1.id)
    assert repo.heads() == {"mlp:1x8x8:10": v1.id}
    assert [v.id for v in repo.list_model_versions(run_id=run.id)] == [v1.id, v2.id]
    assert repo.head_version("cnn:1x8x8:10") is None
    with pytest.raises(NotFoundError, match="model version 999"):
        repo.rollback(999)


def test_missing_run(repo: Repository) -> None:
    with pytest.raises(NotFoundError, match="run 42 does not exist"):
        repo.get_run(42)


def test_schema_comes_from_migrations(db_url: str) -> None:
    engine = create(db_url)
    with pytest.raises(StateError, match="quorumfl db upgrade"):
        require_current(engine)
    connect(db_url, migrate=True)
    require_current(engine)
    tables = set(inspect(engine).get_table_names())
    assert {"runs", "rounds", "round_failures", "nodes", "metrics", "model_versions", "model_heads", "alembic_version"} <= tables
    engine.dispose()


def test_unreachable_database_is_a_clear_error() -> None:
    with pytest.raises(StateError, match="cannot reach the state database"):
        connect("postgresql+psycopg://nobody@127.0.0.1:1/none")


def test_the_core_run_listing_reads_what_the_orm_reads(repo: Repository) -> None:
    """``runs list`` reads with Core and reflected tables (no ORM import): on both backends it gives
    each run's summary exactly as the ORM path does, ids past 2^63 and JSON configs included."""
    from quorumfl.server.services import run_summaries, run_summary

    for number, flower_id in enumerate((BIG_ID, 7, None)):
        run = repo.create_run(flower_run_id=flower_id, config={"num-rounds": 2, "secure-aggregation": "masking"},
                              strategy="fedavg", num_rounds=2)
        for r in range(1, number + 2):
            rnd = repo.start_round(run.id, r, [1, 2])
            repo.finish_round(rnd.id, RoundStatus.COMPLETED, participants=[1, 2], timings={"train": 1.0})
            repo.add_metrics(run.id, r, {"accuracy": 0.5 + r / 10, "loss": 1.0 / r})
            repo.add_metrics(run.id, r, {"accuracy": 0.1}, node_id=BIG_ID)
        if number < 2:
            repo.finish_run(run.id, RunStatus.COMPLETED)
    expected = [run_summary(repo, repo.get_run(r.id)) for r in repo.list_runs()]
    assert run_summaries(repo.engine) == expected
    assert [row["flower_run_id"] for row in expected] == [str(BIG_ID), "7", None]
    assert [row["rounds_completed"] for row in expected] == [1, 2, 3]
