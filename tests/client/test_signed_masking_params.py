"""A lying server against the node's masking handlers: every parameter comes from the admin's signature.

The server announces each key epoch's parameters. Here it plays the attacker through the real
ClientApp handlers (``quorumfl.client.secure.advertise`` and ``share``, with Flower records): it
lowers the minimum group or t, zeroes the sparse graph's fractions, moves the complete-graph limit,
widens the clip, stretches the slots, inflates the cohort past the roster, and tells two nodes
different (each valid) cohorts. Each is refused with the parameter named, while the honest epoch's
masked sum still equals numpy's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Context, Message, RecordDict

from quorumfl.aggregation.secagg import (
    CoordinatorEpoch,
    EpochAnnouncement,
    FixedPoint,
    MaskingParams,
    NodeEpoch,
)
from quorumfl.aggregation.secagg.identity import Roster, sign
from quorumfl.client import secure
from quorumfl.errors import SecureAggregationError
from quorumfl.protocol.secure_wire import (
    ADVERTISE,
    SECAGG,
    SHARE,
    decode_advertisement,
    decode_bundles,
    encode_announcement,
    encode_directory,
)

from ..aggregation.secagg_harness import Federation
from .signed_harness import department_contexts, roster_json

NODES = [(2**62 + 7919 * i) % 2**64 for i in range(7)]
NAMES = ["tax-office", "urban-planning", "public-works", "parks", "libraries", "housing", "transit"]
KEYS = {name: ec.generate_private_key(ec.SECP384R1()) for name in NAMES}
ROSTER_JSON = roster_json(KEYS)
SIGNED = {  # the admin-signed run config's masking keys (the defaults, threshold 0.6)
    "secure-aggregation": "masking", "secagg-threshold": 0.6, "secagg-min-group": 0, "secagg-clip": 8.0,
    "secagg-modulus-bits": 32, "secagg-colluding-fraction": 0.2, "secagg-dropout-fraction": 0.1,
    "secagg-epoch-rounds": 10, "num-rounds": 5, "roster": ROSTER_JSON,
}
HONEST = MaskingParams(threshold=5, slots=5, modulus_bits=32, clip=8.0, min_group=0, colluding_fraction=0.2,
                       dropout_fraction=0.1)


@pytest.fixture
def contexts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[int, Context]:
    return department_contexts(tmp_path, monkeypatch, NODES, KEYS, SIGNED)


def _advertise(context: Context, announcement: EpochAnnouncement) -> RecordDict:
    message = Message(RecordDict({SECAGG: encode_announcement(announcement)}), dst_node_id=int(context.node_id),
                      message_type=ADVERTISE)
    return secure.advertise(message, context)


@pytest.mark.parametrize(("lie", "named"), [
    ({"min_group": 2}, "min-group 2 (signed: 0)"),
    ({"threshold": 4}, "threshold 4 (signed: 5)"),
    ({"colluding_fraction": 0.0, "dropout_fraction": 0.0}, "colluding-fraction 0 (signed: 0.2), dropout-fraction 0"),
    ({"complete_up_to": 2}, "complete-up-to 2 (signed: 100)"),
    ({"clip": 1000.0}, "clip 1000 (signed: 8)"),
    ({"modulus_bits": 64}, "modulus-bits 64 (signed: 32)"),
    ({"slots": 50}, "slots 50 (signed: at most 5)"),
])
def test_an_announcement_weaker_than_the_signed_run_is_refused_naming_the_parameter(
        contexts: dict[int, Context], lie: dict[str, object], named: str) -> None:
    weaker = dataclasses.replace(HONEST, **lie)  # type: ignore[arg-type]
    announcement = CoordinatorEpoch(NODES, weaker).announcement()
    with pytest.raises(SecureAggregationError, match="admin-signed run config does not allow") as refused:
        _advertise(contexts[NODES[0]], announcement)
    assert named in str(refused.value)
    assert "secagg-epoch" not in contexts[NODES[0]].state.config_records  # no keys were made


def test_a_cohort_larger_than_the_signed_roster_is_refused(contexts: dict[int, Context]) -> None:
    cohort = [*NODES, 2**63 + 5]  # a node id of the server's own, to lift n (and place t where it likes)
    params = dataclasses.replace(HONEST, threshold=5)  # 0.6 of 8 = 5: consistent with the inflated cohort
    with pytest.raises(SecureAggregationError, match="8 nodes \\(the signed roster has 7 departments\\)"):
        _advertise(contexts[NODES[0]], CoordinatorEpoch(sorted(cohort), params).announcement())


def test_a_signed_run_without_a_masking_key_is_refused(contexts: dict[int, Context]) -> None:
    context = contexts[NODES[0]]
    del context.run_config["secagg-min-group"]
    with pytest.raises(SecureAggregationError, match="no number for secagg-min-group"):
        _advertise(context, CoordinatorEpoch(NODES, HONEST).announcement())


def _epoch(contexts: dict[int, Context], told: dict[int, EpochAnnouncement]) -> CoordinatorEpoch:
    """Advertise through the handlers with what the server told each node; a coordinator with the
    last node's announcement collects the advertisements."""
    coordinator = CoordinatorEpoch(told[NODES[-1]].cohort, told[NODES[-1]].params)
    coordinator.epoch = told[NODES[-1]].epoch
    for node, context in contexts.items():
        reply = _advertise(context, told[node])
        coordinator.receive_advertisement(decode_advertisement(reply.config_records[SECAGG], node=node))
    return coordinator


def test_two_nodes_told_different_cohorts_refuse_each_others_advertisement(contexts: dict[int, Context]) -> None:
    """Each announcement passes the check on its own (t = 0.6 of its cohort), but the signature of an
    advertisement covers the cohort and parameters its node was told: the split is caught at sharing."""
    full = CoordinatorEpoch(NODES, HONEST).announcement()
    victim = NODES[0]
    told = dict.fromkeys(NODES, full)
    told[victim] = EpochAnnouncement(full.epoch, tuple(NODES[:6]), dataclasses.replace(HONEST, threshold=4))
    directories = _epoch(contexts, told).directories()
    target = NODES[1]
    message = Message(RecordDict({SECAGG: encode_directory(directories[target])}), dst_node_id=target,
                      message_type=SHARE)
    with pytest.raises(SecureAggregationError, match="'tax-office' is not signed by its registered key"):
        secure.share(message, contexts[target])


def test_the_honest_signed_epoch_through_the_handlers_equals_the_numpy_sum(contexts: dict[int, Context]) -> None:
    coordinator = _epoch(contexts, dict.fromkeys(NODES, CoordinatorEpoch(NODES, HONEST).announcement()))
    sharers = []
    for node, directory in coordinator.directories().items():
        message = Message(RecordDict({SECAGG: encode_directory(directory)}), dst_node_id=node, message_type=SHARE)
        reply = secure.share(message, contexts[node])
        coordinator.receive_bundles(node, decode_bundles(reply.config_records[SECAGG], node=node))
        sharers.append(node)
    coordinator.close_setup(sharers)
    states = {node: NodeEpoch.from_bytes(bytes(contexts[node].state.config_records["secagg-epoch"]["state"]))
              for node in NODES}  # type: ignore[arg-type]
    signers = {node: (name, lambda m, k=KEYS[name]: sign(k, m)) for node, name in zip(NODES, NAMES, strict=True)}
    fed = Federation(coordinator, {n: s.to_bytes() for n, s in states.items()}, signers=signers,  # type: ignore[arg-type]
                     roster=Roster.from_json(ROSTER_JSON))
    rng = np.random.default_rng(11)
    values = {u: rng.uniform(-2, 2, size=32) for u in NODES}
    (outcome,) = fed.round([coordinator.ready], values)
    assert outcome.total is not None, outcome.error
    reference = np.sum([values[u] for u in NODES], axis=0)
    assert np.max(np.abs(outcome.total - reference)) <= FixedPoint(32, 8.0, len(NODES)).error_bound
