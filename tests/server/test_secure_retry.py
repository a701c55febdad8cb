"""A masked round that fails is retried from the same model: what the contribution ledger lets through.

Signed federation of six in-process nodes (registered keys, the run's roster), t = 4. A node admits
a second contribution from the same global model with another participant set only when it never
consented to unmasking the slot its first input went into (by signing its view in a consistency
stage, or by answering its unmask request when nobody dropped and there was none): nothing of that
input can have been unmasked, and the node releases the slot for good. Once it has consented, the
retry is refused (the server could hold the first sum and subtract the second).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Message, RecordDict

from quorumfl.aggregation.secagg.messages import UnmaskRequest
from quorumfl.client.app import app
from quorumfl.errors import FederationError, SecureAggregationError
from quorumfl.privacy.contributions import ContributionLedger, slot_key
from quorumfl.protocol.secure_wire import (
    CONFIRM,
    SECAGG,
    UNMASK,
    decode_mask_request,
    encode_unmask_request,
)
from quorumfl.server.state.repository import RoundStatus

from .test_department_names import signed_nodes
from .test_rounds import (
    LoopbackGrid,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)

NAMES = ["tax-office", "urban-planning", "public-works", "housing", "transport", "libraries"]
MASKING = {"secure-aggregation": "masking", "secagg-threshold": 0.6, "round-timeout": 1.0, "secagg-stage-timeout": 1.0,
           "num-rounds": 2}


def _first_round_then_one_node_leaves(grid: LoopbackGrid, stage: str, lost: set[int], leaver: int) -> None:
    """Lose the replies of ``lost`` to round 1's ``stage`` messages; ``leaver`` leaves the federation
    then, so round 2 names another participant set, from the same model."""
    trains = {"n": 0}

    def drop(sent: list[Message], replies: list[Message]) -> list[Message]:
        kind = sent[0].metadata.message_type if sent else ""
        trains["n"] += kind == "train"
        if trains["n"] == 1 and kind == stage:
            grid.nodes.pop(leaver, None)
            return [r for r in replies if r.metadata.src_node_id not in lost]
        return replies

    grid.drop = drop


def test_a_round_that_failed_before_confirmation_is_retried_with_another_set(tmp_path: Path) -> None:
    contexts, roster = signed_nodes(tmp_path, names=NAMES)
    ids = list(contexts)
    grid = LoopbackGrid(dict(contexts))
    # Round 1: three masked inputs are lost (3 < t = 4): no view is confirmed, nothing is unmasked.
    _first_round_then_one_node_leaves(grid, "train", set(ids[:3]), ids[5])
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster})
    run = repo.get_run(federation.run())

    first, second = run.rounds
    assert first.status == RoundStatus.FAILED and "quorum" in (first.error or "")
    # Round 2 trains from the same model with five of the six: every node admits it.
    assert second.status == RoundStatus.COMPLETED and sorted(second.participants) == ids[:5]
    kinds = [m.metadata.message_type for m in grid.sent]
    # Round 1 never reached a consistency stage, and round 2 had no dropout, so it needed none.
    assert kinds.count(CONFIRM) == 0 and kinds.count(UNMASK) == 5

    # The slot of round 1 is released on the nodes whose input went into it: never confirmed from now
    # on, by the ledger and by the node's protocol state alike.
    round_1 = next(m for m in grid.sent if m.metadata.message_type == "train")
    request = decode_mask_request(round_1.content.config_records[SECAGG], node=round_1.metadata.dst_node_id)[0]
    node = ids[3]  # its round-1 input arrived
    view = UnmaskRequest(epoch=request.epoch, slot=request.slot, groups=((tuple(ids[3:]), tuple(ids[:3])),))
    late = Message(content=RecordDict({SECAGG: encode_unmask_request(view)}), dst_node_id=node, message_type=CONFIRM)
    with pytest.raises(SecureAggregationError, match="older than slot"):
        app(late, contexts[node])


def test_a_retry_after_the_node_confirmed_is_refused(tmp_path: Path) -> None:
    contexts, roster = signed_nodes(tmp_path, names=NAMES)
    ids = list(contexts)
    grid = LoopbackGrid(dict(contexts))
    # Round 1: nobody dropped, so there is no consistency stage; every node answers the unmask request,
    # then every reply is lost: the round fails after the point where the server could have had the sum.
    _first_round_then_one_node_leaves(grid, UNMASK, set(ids), ids[5])
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster})
    with pytest.raises(FederationError, match="none of the 2 round"):
        federation.run()
    [summary] = repo.list_runs()

    first, second = repo.get_run(summary.id).rounds
    assert first.status == RoundStatus.FAILED and "shares needed" in (first.error or "")
    assert second.status == RoundStatus.FAILED
    reasons = {f.node_id: f.reason for f in second.failures}
    assert sorted(reasons) == ids[:5]
    assert all("confirmed that round's survivors" in r and "subtract the two sums" in r for r in reasons.values())


def test_the_ledger_releases_only_unconfirmed_slots_and_never_confirms_a_released_one(tmp_path: Path) -> None:
    ledger = ContributionLedger(tmp_path)
    first, second, third = slot_key(b"e" * 16, 0), slot_key(b"e" * 16, 1), slot_key(b"f" * 16, 0)
    ledger.admit("d" * 64, [1, 2, 3, 4], run="7", round_number=1, slot=first)
    ledger.admit("d" * 64, [1, 2, 3], run="7", round_number=2, slot=second)  # first never confirmed: released
    with pytest.raises(SecureAggregationError, match="never confirm"):
        ledger.confirm(first)
    ledger.confirm(second)
    with pytest.raises(SecureAggregationError, match="confirmed that round's survivors"):
        ledger.admit("d" * 64, [1, 2], run="7", round_number=3, slot=third)
    ledger.admit("d" * 64, [1, 2, 3], run="7", round_number=3, slot=third)  # the same set again: admitted
    with pytest.raises(SecureAggregationError, match="no input of it"):
        ledger.confirm(slot_key(b"g" * 16, 0))
    # Without a signed slot (CKKS, an unsigned epoch) nothing can be released: the strict rule.
    ledger.admit("c" * 64, [1, 2, 3], run="7", round_number=1)
    with pytest.raises(SecureAggregationError, match="cannot be withdrawn"):
        ledger.admit("c" * 64, [1, 2], run="7", round_number=2, slot=first)


def _lose_round_one_unmask_replies(grid: LoopbackGrid) -> None:
    """Every reply to round 1's unmask requests is lost: the nodes consented, nothing was revealed."""
    trains = {"n": 0}

    def drop(sent: list[Message], replies: list[Message]) -> list[Message]:
        kind = sent[0].metadata.message_type if sent else ""
        trains["n"] += kind == "train"
        return [] if trains["n"] == 1 and kind == UNMASK else replies

    grid.drop = drop


def test_after_a_failed_round_the_next_trains_with_the_same_departments(tmp_path: Path) -> None:
    """Four of six are sampled each round. Round 1's unmask replies are all lost after every node
    consented: its sum may be known. Round 2 trains from the same model, so a fresh sample of four
    would be refused by every node of round 1 that the sample kept; it asks round 1's four again,
    which their ledgers admit (same model, same set), and completes."""
    contexts, roster = signed_nodes(tmp_path, names=NAMES)
    grid = LoopbackGrid(dict(contexts))
    _lose_round_one_unmask_replies(grid)
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster, "fraction-train": 0.66,
                                                      "num-rounds": 3})
    run = repo.get_run(federation.run())
    first, second, third = run.rounds
    assert first.status == RoundStatus.FAILED and len(first.selected) == 4
    assert second.status == RoundStatus.COMPLETED and sorted(second.selected) == sorted(first.selected)
    assert sorted(second.participants) == sorted(first.selected) and not second.failures
    assert third.status == RoundStatus.COMPLETED and len(third.selected) == 4  # the selector chooses again
    [repeat] = [s for s in repo.selections(run.id) if s.round == 2]
    assert repeat.policy == "repeat"


def test_resume_names_the_departments_of_the_failed_attempt_and_those_not_connected(tmp_path: Path) -> None:
    from quorumfl.deploy.resume import who_trains_again
    from quorumfl.server.state.database import connect
    from quorumfl.server.state.repository import Repository

    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    for node, name in ((7, "tax-office"), (8, "parks"), (9, "housing")):
        repo.touch_node(node, department=name)
    masked = repo.create_run(flower_run_id=5, config={"secure-aggregation": "masking"}, strategy="fedavg", num_rounds=3)
    done = repo.start_round(masked.id, 1, [7, 8, 9])
    repo.finish_round(done.id, RoundStatus.COMPLETED, participants=[7, 8, 9], timings={})
    assert who_trains_again(repo, {7}, masked.id) == ("", "")  # the last round completed: any set will do
    lost = repo.start_round(masked.id, 2, [7, 9])
    repo.finish_round(lost.id, RoundStatus.FAILED, participants=[], timings={}, error="too few shares")
    assert who_trains_again(repo, {7, 8, 9}, masked.id) == ("tax-office, housing", "")
    assert who_trains_again(repo, {7, 8}, masked.id) == ("tax-office, housing", "housing is")
    plain = repo.create_run(flower_run_id=6, config={"secure-aggregation": "none"}, strategy="fedavg", num_rounds=3)
    failed = repo.start_round(plain.id, 1, [7, 9])
    repo.finish_round(failed.id, RoundStatus.FAILED, participants=[], timings={}, error="min-nodes")
    assert who_trains_again(repo, set(), plain.id) == ("", "")  # plaintext: no ledger to satisfy


class _StopsAfterRound(LoopbackGrid):
    """The server process stops (Ctrl-C of `server start`) once round ``stop_after`` has ended."""

    stop = False

    def get_node_ids(self) -> list[int]:
        if self.stop:
            raise KeyboardInterrupt
        return list(self.nodes)


def test_a_resumed_run_asks_the_departments_of_its_failed_attempt(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Round 1 of a masked run fails after every node consented to its unmasking, and the server stops
    before round 2. The resumed run's round 2 trains from the same model: it asks round 1's four
    departments again (the server reads them from the state DB), their ledgers admit it, and the run
    ends partial (1 of 2 rounds lost), not with those departments refusing."""
    contexts, roster = signed_nodes(tmp_path, names=NAMES)
    grid = _StopsAfterRound(dict(contexts))
    _lose_round_one_unmask_replies(grid)
    settings = {**MASKING, "roster": roster, "fraction-train": 0.66}
    federation, repo = _federation(tmp_path, grid, **settings)

    def after(_run: int, number: int, _metrics: object) -> None:
        grid.stop = number == 1

    with pytest.raises(KeyboardInterrupt):
        federation.run(on_round=after)
    [first] = repo.list_runs()[0].rounds
    assert first.status == RoundStatus.FAILED and len(first.selected) == 4
    resumed, _ = _federation(tmp_path, LoopbackGrid(dict(contexts)), **{**settings, "resume-run": first.run_id})
    run = repo.get_run(resumed.run())
    second = [r for r in run.rounds if r.number == 2][-1]
    assert sorted(second.selected) == sorted(first.selected) and second.status == RoundStatus.COMPLETED
    assert run.status == "partial"
    # Had one of them been away, the server would have said which.
    away = sorted(first.selected)[0]
    names = {n.node_id: n.department for n in repo.list_nodes()}
    partial_grid = LoopbackGrid({n: c for n, c in contexts.items() if n != away})
    again, _ = _federation(tmp_path, partial_grid, **{**settings, "num-rounds": 1})
    again.repeat_set = sorted(first.selected)
    again._selection(1, list(partial_grid.nodes))
    assert f"{names.get(away) or away} is not connected" in caplog.text
