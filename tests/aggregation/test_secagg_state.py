"""A node's stored masking state: compact, and a state stored in the earlier all-hex form (full
groups and views) reads back to the same state, so a node that upgrades mid-epoch keeps its keys
and every refusal it had."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quorumfl.aggregation.secagg import MaskingParams, NodeEpoch
from quorumfl.errors import SecureAggregationError

from .secagg_harness import Federation


def _earlier_form(state: NodeEpoch, used: dict[int, tuple[int, ...]],
                  revealed: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]) -> bytes:
    """What the earlier release stored for ``state``: hex, ids as strings, groups and views in full."""
    def ad(a: object) -> list[object]:
        return [a.share_key.hex(), [k.hex() for k in a.mask_keys], a.department, a.signature.hex()]  # type: ignore[attr-defined]

    return json.dumps({
        "node": str(state.node), "epoch": state.epoch.hex(), "params": state.params.to_dict(),
        "cohort": [str(c) for c in state.cohort], "share_private": state.share_private.hex(),
        "mask_private": [k.hex() for k in state.mask_private], "seeds": [s.hex() for s in state.seeds],
        "members": [str(m) for m in state.members], "graph_seed": state.graph_seed.hex(),
        "peers": {str(p): ad(a) for p, a in state.peers.items()},
        "held": {str(o): h.hex() for o, h in state.held.items()},
        "used": {str(s): [str(g) for g in grp] for s, grp in used.items()},
        "revealed": {str(s): [[str(x) for x in a], [str(x) for x in d]] for s, (a, d) in revealed.items()},
        "department": state.department, "signature": state.signature.hex(), "binding": state.binding.hex(),
        "confirmed": {},
    }).encode()


def test_a_state_in_the_earlier_form_reads_back_to_the_same_state_and_refusals() -> None:
    nodes = [11, 22, 33, 44, 2**64 - 5]  # Flower's node ids are unsigned 64-bit
    fed = Federation.setup(nodes, MaskingParams(threshold=3, slots=3))
    values = {n: np.full(6, float(i)) for i, n in enumerate(nodes)}
    (outcome,) = fed.round([fed.coordinator.ready], values)
    np.testing.assert_allclose(outcome.total, sum(values.values()), atol=1e-3)
    group = tuple(sorted(nodes))
    for node in nodes:
        stored = fed.states[node]
        state = NodeEpoch.from_bytes(stored)
        earlier = _earlier_form(state, {0: group}, {0: (group, ())})
        assert NodeEpoch.from_bytes(earlier) == state  # the same digests of the same group and survivors
        assert len(stored) < len(earlier)
    # a second round from the states read in the earlier form sums as before
    fed.states = {n: _earlier_form(NodeEpoch.from_bytes(fed.states[n]), {0: group}, {0: (group, ())}) for n in nodes}
    (again,) = fed.round([fed.coordinator.ready], values)
    np.testing.assert_allclose(again.total, sum(values.values()), atol=1e-3)


def test_a_state_read_in_the_earlier_form_still_refuses_another_view_of_its_slot() -> None:
    nodes = [1, 2, 3, 4, 5]
    fed = Federation.setup(nodes, MaskingParams(threshold=3, slots=2))
    fed.round([fed.coordinator.ready], {n: np.ones(4) for n in nodes})
    group = tuple(nodes)
    state = NodeEpoch.from_bytes(_earlier_form(NodeEpoch.from_bytes(fed.states[1]), {0: group}, {0: (group, ())}))
    from quorumfl.aggregation.secagg import UnmaskRequest

    other = UnmaskRequest(epoch=state.epoch, slot=0, groups=(((1, 2, 3, 4), (5,)),))  # 5 "dropped" after all
    with pytest.raises(SecureAggregationError, match="already unmasked with other survivors"):
        state.unmask(other)


def test_garbage_is_refused_as_unreadable() -> None:
    for raw in (b"{", b'{"format": 2}', b'{"format": 2, "cohort": "!!"}'):
        with pytest.raises(SecureAggregationError, match="unreadable"):
            NodeEpoch.from_bytes(raw)
