"""A masking key epoch has one slot per round it may serve, and no more: ``secagg-epoch-rounds``, or
the rounds the run has left when fewer. What the nodes are told is read back from the announcement
the server sends them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from flwr.app import Message

from quorumfl.protocol.secure_wire import SECAGG, decode_announcement
from quorumfl.protocol.wire import TrainConfig
from quorumfl.server.config import RunConfig
from quorumfl.server.secure import MaskingSession

pytestmark = pytest.mark.usefixtures("task_identity")


def _announced_slots(num_rounds: int, epoch_rounds: int, server_round: int) -> int:
    config = RunConfig.from_mapping({"secure-aggregation": "masking", "num-rounds": num_rounds,
                                     "secagg-epoch-rounds": epoch_rounds, "min-nodes": 2})
    sent: list[Message] = []

    def exchange(messages: list[Message], failures: dict[int, tuple[str, str]], stage: str, timeout: float,
                 consume: Callable[[int, Message], None] | None = None) -> list[tuple[int, Message]]:
        sent.extend(messages)
        return []  # nobody answers: the set-up stops after the announcement

    train = TrainConfig(server_round=server_round, model="mlp", local_epochs=1, batch_size=8, learning_rate=0.1,
                        proximal_mu=0.0, seed=0)
    phase = MaskingSession(config, exchange).round([{}], {n: train for n in (1, 2, 3)}, {}, {})
    assert phase.arrays is None and phase.error  # no node answered, so no round
    assert sent and all(m.metadata.message_type == sent[0].metadata.message_type for m in sent)
    return decode_announcement(sent[0].content.config_records[SECAGG]).params.slots


@pytest.mark.parametrize(("num_rounds", "epoch_rounds", "server_round", "slots"), [
    (3, 10, 1, 3),  # a short run: three slots, not ten
    (30, 10, 1, 10),  # a long one: the epoch length
    (30, 10, 25, 6),  # re-keyed near the end: the rounds left
    (5, 10, 5, 1),  # the last round
])
def test_an_epoch_has_a_slot_per_round_it_can_serve(num_rounds: int, epoch_rounds: int, server_round: int,
                                                    slots: int) -> None:
    assert _announced_slots(num_rounds, epoch_rounds, server_round) == slots
