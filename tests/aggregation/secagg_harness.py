"""Runs the masking protocol in memory between one coordinator and n nodes, with planted dropouts.

Messages pass through ``NodeEpoch.to_bytes``/``from_bytes`` between stages, as they do on a real node
that keeps its state between Flower messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from quorumfl.aggregation.secagg import (
    CoordinatorEpoch,
    GroupOutcome,
    KeyDirectory,
    MaskingParams,
    NodeEpoch,
    UnmaskReply,
    UnmaskRequest,
)
from quorumfl.aggregation.secagg.identity import Roster
from quorumfl.errors import SecureAggregationError


@dataclass
class Dropouts:
    """Nodes that vanish before advertising, before sharing, before masking, and before unmasking."""

    advertise: set[int] = field(default_factory=set)
    share: set[int] = field(default_factory=set)
    mask: set[int] = field(default_factory=set)
    confirm: set[int] = field(default_factory=set)
    unmask: set[int] = field(default_factory=set)


@dataclass
class Federation:
    coordinator: CoordinatorEpoch
    states: dict[int, bytes]
    masked_log: list[tuple[int, int]] = field(default_factory=list)  # (node, slot) each masked input
    signers: Mapping[int, tuple[str, Callable[[bytes], bytes]]] | None = None
    roster: Roster | None = None
    refused: list[tuple[int, str]] = field(default_factory=list)

    @classmethod
    def setup(
        cls, nodes: Sequence[int], params: MaskingParams, drop: Dropouts | None = None, *,
        signers: Mapping[int, tuple[str, Callable[[bytes], bytes]]] | None = None, roster: Roster | None = None,
        tamper: Callable[[int, KeyDirectory], KeyDirectory] | None = None, binding: bytes = b"run:1",
    ) -> Federation:
        """``signers``: node → (department, sign function) for a signed epoch checked against
        ``roster``; ``tamper``: the server rewriting the key directory it sends each node."""
        drop = drop or Dropouts()
        coord = CoordinatorEpoch(nodes, params)
        states: dict[int, bytes] = {}
        for node in nodes:
            if node in drop.advertise:
                continue
            department, signer = (signers or {}).get(node, ("", None))
            state, ad = NodeEpoch.advertise(coord.announcement(), node, signer=signer, department=department,
                                            binding=binding)
            coord.receive_advertisement(ad)
            states[node] = state.to_bytes()
        sharers = []
        for node, directory in coord.directories().items():
            state = NodeEpoch.from_bytes(states[node])
            bundles = state.share(tamper(node, directory) if tamper else directory, roster=roster)
            states[node] = state.to_bytes()
            if node in drop.share:
                continue
            coord.receive_bundles(node, bundles)
            sharers.append(node)
        coord.close_setup(sharers)
        return cls(coord, states, signers=signers, roster=roster)

    def round(
        self,
        groups: Sequence[Sequence[int]],
        values: Mapping[int, NDArray[np.float64]],
        drop: Dropouts | None = None,
        *,
        seed: int = 0,
        view_of: Callable[[int, UnmaskRequest], UnmaskRequest] | None = None,
        tamper_unmask: Callable[[UnmaskReply], UnmaskReply] | None = None,
        consistency: bool | None = None,
    ) -> list[GroupOutcome]:
        """``view_of``: what the server shows each node in the consistency and unmask stages (an
        honest server shows everyone the same request); ``tamper_unmask``: a node rewriting its
        unmask reply (the coordinator's refusals are then kept in ``refused``); ``consistency``:
        whether a signed epoch runs the consistency stage (None: as the server decides, only when a
        node dropped or the graph is sparse)."""
        drop = drop or Dropouts()
        length = next(iter(values.values())).shape[0]
        rnd = self.coordinator.start_round(groups, length)
        rng = np.random.default_rng(seed)
        for group in rnd.groups:
            for node in group:
                request = self.coordinator.mask_request(node, rnd)
                if node in drop.mask:
                    continue
                state = NodeEpoch.from_bytes(self.states[node])
                masked = state.mask(request, values[node], rng)
                self.states[node] = state.to_bytes()
                self.masked_log.append((node, rnd.slot))
                rnd.add_masked(node, masked)
        request, _ = rnd.unmask_request()
        if consistency is None:
            consistency = request.needs_confirmations(complete=self.coordinator.complete)
        if self.signers is not None and consistency:  # every survivor signs the view it is shown
            signatures = {}
            for alive, _gone in request.groups:
                for node in alive:
                    if node in drop.confirm:
                        continue
                    state = NodeEpoch.from_bytes(self.states[node])
                    shown = view_of(node, request) if view_of else request
                    signatures[node] = state.confirm(shown, self.signers[node][1])
                    self.states[node] = state.to_bytes()
            request = rnd.confirm(signatures)
        for alive, _gone in request.groups:
            for node in alive:
                if node in drop.unmask or node in drop.confirm:  # gone before confirming: gone for unmasking
                    continue
                state = NodeEpoch.from_bytes(self.states[node])
                reply = state.unmask(view_of(node, request) if view_of else request, roster=self.roster)
                self.states[node] = state.to_bytes()
                if tamper_unmask is None:
                    rnd.add_unmask(reply)
                    continue
                try:
                    rnd.add_unmask(tamper_unmask(reply))
                except SecureAggregationError as exc:
                    self.refused.append((node, str(exc)))
        return rnd.result()
