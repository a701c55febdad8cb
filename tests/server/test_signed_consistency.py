"""The consistency stage of a signed masked round: run only when a node dropped, and then asking t + spare survivors.

Signed federations of in-process nodes (registered keys, the run's roster). A round in which every
asked node sent its masked input skips the consistency stage: its view names no dropped node, so
nodes reveal only self-mask seed shares and answer it unsigned (``NodeEpoch.unmask``); t + spare are
asked to unmask. When a node dropped, a node reveals shares only for a view it signed itself and that
t share holders signed, so any t signers are enough: the server asks t + 1 survivors to sign and then
to unmask, and the others only when too few of them answer. Checked by what every node was actually
sent and by the round's outcome (every surviving input in the recovered sum).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flwr.app import Message

from quorumfl.protocol.secure_wire import CONFIRM, UNMASK
from quorumfl.server.state.repository import RoundStatus

from .test_department_names import signed_nodes
from .test_rounds import (
    LoopbackGrid,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)

NAMES = ["tax-office", "urban-planning", "public-works", "housing", "transport", "libraries", "parks"]
# t = 4 of 6 and of 7 (a majority, at least 0.55 of them)
MASKING = {"secure-aggregation": "masking", "secagg-threshold": 0.55, "round-timeout": 1.0, "secagg-stage-timeout": 1.0,
           "num-rounds": 1}


def _asked(grid: LoopbackGrid, kind: str) -> list[int]:
    return [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == kind]


def test_a_round_without_dropouts_skips_the_consistency_stage(tmp_path: Path) -> None:
    contexts, roster = signed_nodes(tmp_path, names=NAMES[:6])
    ids = list(contexts)
    grid = LoopbackGrid(dict(contexts))
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster})
    [rnd] = repo.get_run(federation.run()).rounds

    assert rnd.status == RoundStatus.COMPLETED and sorted(rnd.participants) == sorted(ids)  # all six are in the sum
    assert not _asked(grid, CONFIRM)
    unmaskers = _asked(grid, UNMASK)
    assert len(unmaskers) == 5 and len(set(unmaskers)) == 5  # t = 4 and one spare, each once
    assert not rnd.failures and "secagg-unmask" in rnd.timings and "secagg-confirm" not in rnd.timings


def _lose_train_reply(grid: LoopbackGrid, node: int, then: Callable[[list[Message], list[Message]], list[Message]]
                      | None = None) -> None:
    def drop(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == "train":
            return [r for r in replies if r.metadata.src_node_id != node]
        return then(sent, replies) if then else replies

    grid.drop = drop


def test_with_a_dropout_t_plus_spare_survivors_confirm_and_unmask_and_the_sixth_survivor_is_never_asked(
    tmp_path: Path,
) -> None:
    contexts, roster = signed_nodes(tmp_path, names=NAMES)
    ids = list(contexts)
    grid = LoopbackGrid(dict(contexts))
    _lose_train_reply(grid, ids[0])
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster})
    [rnd] = repo.get_run(federation.run()).rounds

    assert rnd.status == RoundStatus.COMPLETED and sorted(rnd.participants) == sorted(ids[1:])  # the six survivors
    confirmers = _asked(grid, CONFIRM)
    assert len(confirmers) == 5 and len(set(confirmers)) == 5 and ids[0] not in confirmers
    assert _asked(grid, UNMASK) == confirmers  # the same five, each once
    assert {f.node_id: f.stage for f in rnd.failures} == {ids[0]: "train"}


def test_too_few_signatures_ask_the_rest_to_confirm_before_anyone_unmasks(tmp_path: Path) -> None:
    contexts, roster = signed_nodes(tmp_path, names=NAMES)
    ids = list(contexts)
    grid = LoopbackGrid(dict(contexts))
    lost: set[int] = set()
    batches: list[list[int]] = []  # each push of consistency requests

    def drop(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == CONFIRM:
            batches.append([m.metadata.dst_node_id for m in sent])
        if sent and sent[0].metadata.message_type == CONFIRM and not lost:
            lost.update(m.metadata.dst_node_id for m in sent[:2])  # 2 of the first 5 never sign: 3 < t = 4
            return [r for r in replies if r.metadata.src_node_id not in lost]
        return replies

    _lose_train_reply(grid, ids[0], then=drop)
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster})
    [rnd] = repo.get_run(federation.run()).rounds

    assert rnd.status == RoundStatus.COMPLETED and sorted(rnd.participants) == sorted(ids[1:])
    confirmers = _asked(grid, CONFIRM)
    first, rest = batches
    assert len(first) == 5 and rest == [n for n in ids[1:] if n not in first]  # then the sixth survivor, once
    signed = [n for n in confirmers if n not in lost]
    assert sorted(_asked(grid, UNMASK)) == sorted(signed)  # only signers unmask, each with t signatures
    assert {f.node_id: f.stage for f in rnd.failures} == {ids[0]: "train", **{n: "secagg-confirm" for n in lost}}
