"""The consistency stage of a signed masked round asks t + spare survivors, as the unmask stage does.

Signed federation of six in-process nodes (registered keys, the run's roster), t = 4, one spare. A
node reveals shares only for a view it signed itself and that t share holders signed, so any t
signers are enough: the server asks t + 1 survivors to sign and then to unmask, and the sixth only
when too few of them answer. Checked by what every node was actually sent and by the round's
outcome (all six inputs in the recovered sum).
"""

from __future__ import annotations

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

NAMES = ["tax-office", "urban-planning", "public-works", "housing", "transport", "libraries"]
MASKING = {"secure-aggregation": "masking", "secagg-threshold": 0.6, "round-timeout": 1.0, "secagg-stage-timeout": 1.0,
           "num-rounds": 1}


def _asked(grid: LoopbackGrid, kind: str) -> list[int]:
    return [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == kind]


def test_t_plus_spare_survivors_confirm_and_unmask_and_the_sixth_is_never_asked(tmp_path: Path) -> None:
    contexts, roster = signed_nodes(tmp_path, names=NAMES)
    ids = list(contexts)
    grid = LoopbackGrid(dict(contexts))
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster})
    [rnd] = repo.get_run(federation.run()).rounds

    assert rnd.status == RoundStatus.COMPLETED and sorted(rnd.participants) == sorted(ids)  # all six are in the sum
    confirmers = _asked(grid, CONFIRM)
    assert len(confirmers) == 5 and len(set(confirmers)) == 5
    assert _asked(grid, UNMASK) == confirmers  # the same five, each once
    assert not rnd.failures


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

    grid.drop = drop
    federation, repo = _federation(tmp_path, grid, **{**MASKING, "roster": roster})
    [rnd] = repo.get_run(federation.run()).rounds

    assert rnd.status == RoundStatus.COMPLETED and sorted(rnd.participants) == sorted(ids)
    confirmers = _asked(grid, CONFIRM)
    first, rest = batches
    assert len(first) == 5 and rest == [n for n in ids if n not in first]  # then the sixth, once
    signed = [n for n in confirmers if n not in lost]
    assert sorted(_asked(grid, UNMASK)) == sorted(signed)  # only signers unmask, each with t signatures
    assert {f.node_id: f.stage for f in rnd.failures} == {n: "secagg-confirm" for n in lost}
