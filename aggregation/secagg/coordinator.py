"""The server's side of the masking protocol: a key epoch, and per round the masked sum and unmasking.

``CoordinatorEpoch`` runs the two setup stages (collect public keys → hand out key directories;
collect encrypted share bundles → route them) and then serves up to ``slots`` rounds. Each round is
a ``MaskedRound``: masked vectors are added into one running sum per group as they arrive (memory
grows with the model, not with the number of nodes), the unmask request tells the survivors who
dropped, and the reply shares rebuild exactly the self-mask seeds of survivors and the slot keys of
dropped nodes, which is enough to cancel every mask in each group's sum and nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from quorumfl.aggregation.secagg.messages import (
    COMMITMENT_BYTES,
    EPOCH_BYTES,
    EpochAnnouncement,
    KeyAdvertisement,
    KeyDirectory,
    MaskingParams,
    MaskRequest,
    ShareBundle,
    UnmaskReply,
    UnmaskRequest,
    share_commitment,
)
from quorumfl.aggregation.secagg.shamir import PRIME, reconstruct_secret, share_to_bytes
from quorumfl.aggregation.secagg.streams import (
    KEY_BYTES,
    add_keystream,
    load_private,
    pairwise_mask_key,
    public_key,
    self_mask_key,
)
from quorumfl.errors import QuorumNotMetError, SecureAggregationError

__all__ = ["CoordinatorEpoch", "GroupOutcome", "MaskedRound"]


class CoordinatorEpoch:
    """One key epoch on the server: setup, then rounds on fresh slots."""

    def __init__(self, cohort: Sequence[int], params: MaskingParams) -> None:
        cohort = tuple(sorted(set(int(c) for c in cohort)))
        params.check(len(cohort))
        self.cohort = cohort
        self.params = params
        self.epoch = os.urandom(EPOCH_BYTES)
        self.graph_seed = os.urandom(16)
        self.ads: dict[int, KeyAdvertisement] = {}
        self.members: tuple[int, ...] = ()
        self.position: dict[int, int] = {}  # member -> its index in members (its share x-coordinate − 1)
        self.graph: list[frozenset[int]] = []
        self.pending: dict[int, dict[int, bytes]] = {}  # recipient -> sender -> ciphertext
        self.commitments: dict[tuple[int, int], bytes] = {}  # (owner, holder) -> commitments to its shares
        self.ready: tuple[int, ...] = ()
        self.next_slot = 0
        self.reconstructed: set[tuple[int, int]] = set()  # (node, slot) whose slot key was rebuilt

    def announcement(self) -> EpochAnnouncement:
        return EpochAnnouncement(epoch=self.epoch, cohort=self.cohort, params=self.params)

    # ---- setup ---------------------------------------------------------------------------------
    def receive_advertisement(self, ad: KeyAdvertisement) -> None:
        if self.members:
            raise SecureAggregationError("key directories were already sent", node=str(ad.node))
        if ad.node not in self.cohort:
            raise SecureAggregationError("node is not in this epoch's cohort", node=str(ad.node))
        ad.check(self.params.slots)
        self.ads[ad.node] = ad

    def directories(self) -> dict[int, KeyDirectory]:
        """Close stage 1: members are the nodes that advertised; each gets its neighbours' keys."""
        members = tuple(sorted(self.ads))
        if len(members) < self.params.threshold:
            raise QuorumNotMetError(f"{len(members)} node(s) advertised keys, threshold is {self.params.threshold}")
        keys = [k for ad in self.ads.values() for k in (ad.share_key, *ad.mask_keys)]
        if len(set(keys)) != len(keys):
            raise SecureAggregationError("two nodes advertised the same public key")
        self.members = members
        self.position = {node: i for i, node in enumerate(members)}
        self.graph = self.params.graph(len(members), self.graph_seed)
        out: dict[int, KeyDirectory] = {}
        for i, node in enumerate(members):
            near = [members[j] for j in self.graph[i]] + [node]
            out[node] = KeyDirectory(self.epoch, members, self.graph_seed, {p: self.ads[p] for p in near})
        return out

    @property
    def complete(self) -> bool:
        """Every member holds a share of every other member's secrets (the complete graph)."""
        return bool(self.graph) and len(self.graph[0]) == len(self.members) - 1

    def neighbours(self, node: int) -> list[int]:
        return [self.members[j] for j in sorted(self.graph[self.position[node]])]

    def receive_bundles(self, node: int, bundles: Sequence[ShareBundle]) -> None:
        if node not in self.members or self.ready:
            raise SecureAggregationError("node may not send share bundles now", node=str(node))
        expected = set(self.neighbours(node))
        recipients = [b.recipient for b in bundles]
        if any(b.sender != node for b in bundles) or sorted(recipients) != sorted(expected):
            raise SecureAggregationError("share bundles must go to each neighbour exactly once", node=str(node))
        if any(len(b.commitment) != 2 * self.params.slots * COMMITMENT_BYTES for b in bundles):
            raise SecureAggregationError("share bundles must carry a commitment to every share", node=str(node))
        for b in bundles:
            self.pending.setdefault(b.recipient, {})[node] = b.ciphertext
            self.commitments[(node, b.recipient)] = b.commitment

    def close_setup(self, sharers: Sequence[int]) -> tuple[int, ...]:
        """Close stage 2: the nodes whose bundles arrived can take part in this epoch's rounds."""
        ready = tuple(sorted(set(sharers) & set(self.members)))
        if len(ready) < self.params.threshold:
            raise QuorumNotMetError(f"{len(ready)} node(s) shared keys, threshold is {self.params.threshold}")
        for recipient in self.pending:  # bundles from nodes that did not finish sharing are useless
            self.pending[recipient] = {s: c for s, c in self.pending[recipient].items() if s in ready}
        self.ready = ready
        return ready

    @property
    def slots_left(self) -> int:
        return self.params.slots - self.next_slot if self.ready else 0

    # ---- rounds ---------------------------------------------------------------------------------
    def start_round(self, groups: Sequence[Sequence[int]], length: int) -> MaskedRound:
        """A round on the next unused slot; each group is summed (and revealed) on its own."""
        if not self.ready:
            raise SecureAggregationError("the key epoch's setup is not finished")
        if self.slots_left < 1:
            raise SecureAggregationError("this key epoch has no unused slot left; start a new epoch")
        clean = [tuple(sorted(set(int(n) for n in g))) for g in groups]
        everyone = [n for g in clean for n in g]
        if len(set(everyone)) != len(everyone) or not set(everyone) <= set(self.ready):
            raise SecureAggregationError("groups must be disjoint sets of nodes that finished the key setup")
        small = [g for g in clean if len(g) < self.params.group_quorum]
        if small:
            raise QuorumNotMetError(f"group(s) below the quorum {self.params.group_quorum}: {small}")
        if length < 1:
            raise SecureAggregationError(f"vector length must be >= 1, got {length}")
        slot = self.next_slot
        self.next_slot += 1
        return MaskedRound(self, slot, clean, length)

    def mask_request(self, node: int, rnd: MaskedRound) -> MaskRequest:
        """The node's request; it carries every share bundle for it that it has not confirmed yet."""
        incoming = tuple(
            ShareBundle(sender, node, ciphertext, self.commitments[(sender, node)])
            for sender, ciphertext in sorted(self.pending.get(node, {}).items())
        )
        return MaskRequest(epoch=self.epoch, slot=rnd.slot, group=rnd.groups[rnd.group_of[node]], incoming=incoming)

    def delivered(self, node: int) -> None:
        """A masked input arrived, so the node has stored its bundles: stop resending them."""
        self.pending.pop(node, None)


@dataclass
class GroupOutcome:
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    total: NDArray[np.float64] | None = None
    error: str | None = None


@dataclass
class MaskedRound:
    epoch: CoordinatorEpoch
    slot: int
    groups: list[tuple[int, ...]]
    length: int
    group_of: dict[int, int] = field(init=False)
    sums: list[NDArray[np.unsignedinteger]] = field(init=False)
    arrived: list[set[int]] = field(init=False)
    request: UnmaskRequest | None = None
    shares: dict[int, UnmaskReply] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_of = {n: i for i, g in enumerate(self.groups) for n in g}
        dtype = self.epoch.params.fixed_point(len(self.epoch.members)).dtype
        self.sums = [np.zeros(self.length, dtype=dtype) for _ in self.groups]
        self.arrived = [set() for _ in self.groups]

    def add_masked(self, node: int, vector: NDArray[np.generic]) -> None:
        """Add one node's masked vector to its group's running sum (checked first)."""
        if self.request is not None:
            raise SecureAggregationError("masked input arrived after the unmask stage began", node=str(node))
        if node not in self.group_of:
            raise SecureAggregationError("node is not a participant of this round", node=str(node))
        g = self.group_of[node]
        if node in self.arrived[g]:
            raise SecureAggregationError("node sent two masked inputs", node=str(node))
        total = self.sums[g]
        if vector.dtype != total.dtype or vector.shape != total.shape:
            raise SecureAggregationError(
                f"masked input must be {total.dtype}[{self.length}], got {vector.dtype}{list(vector.shape)}", node=str(node)
            )
        np.add(total, vector, out=total)
        self.arrived[g].add(node)
        self.epoch.delivered(node)

    def unmask_request(self) -> tuple[UnmaskRequest, dict[int, str]]:
        """Close the input stage. Groups below quorum are dropped here (nothing of theirs is revealed)."""
        aborted: dict[int, str] = {}
        kept: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for g, members in enumerate(self.groups):
            alive = tuple(n for n in members if n in self.arrived[g])
            gone = tuple(n for n in members if n not in self.arrived[g])
            if len(alive) < self.epoch.params.group_quorum:
                aborted[g] = f"{len(alive)} masked input(s) arrived, quorum is {self.epoch.params.group_quorum}"
            else:
                kept.append((alive, gone))
        if not kept:
            raise QuorumNotMetError("; ".join(f"group {g}: {why}" for g, why in aborted.items()))
        self.request = UnmaskRequest(epoch=self.epoch.epoch, slot=self.slot, groups=tuple(kept))
        for g in aborted:
            self.sums[g] = self.sums[g][:0]  # an aborted group's sum is never unmasked
        return self.request, aborted

    def confirm(self, confirmations: Mapping[int, bytes]) -> UnmaskRequest:
        """Close the consistency stage (signed epochs): the unmask request carries the survivors'
        signatures over the view, which each node checks before it reveals anything."""
        request = self.request
        if request is None:
            raise SecureAggregationError("confirmations before the survivors are known")
        survivors = {n for alive, _ in request.groups for n in alive}
        self.request = replace(request, confirmations={n: s for n, s in confirmations.items() if n in survivors})
        return self.request

    def add_unmask(self, reply: UnmaskReply) -> None:
        request = self.request
        if request is None:
            raise SecureAggregationError("unmask reply before the unmask request", node=str(reply.node))
        survivors = {n for alive, _ in request.groups for n in alive}
        dropped = {n for _, gone in request.groups for n in gone}
        if reply.node not in survivors or reply.node in self.shares:
            raise SecureAggregationError("unexpected unmask reply", node=str(reply.node))
        if not set(reply.seed_shares) <= survivors or not set(reply.key_shares) <= dropped:
            raise SecureAggregationError("unmask reply holds shares nobody asked for", node=str(reply.node))
        if any(not 0 <= v < PRIME for v in (*reply.seed_shares.values(), *reply.key_shares.values())):
            raise SecureAggregationError("a share is not a field element", node=str(reply.node))
        for seed, held in ((True, reply.seed_shares), (False, reply.key_shares)):
            for owner, value in held.items():
                committed = self.epoch.commitments.get((owner, reply.node))
                if committed is None:  # its own share: nobody else holds a commitment to it
                    continue
                start = (2 * self.slot + int(seed)) * COMMITMENT_BYTES
                expected = share_commitment(epoch=self.epoch.epoch, owner=owner, holder=reply.node, slot=self.slot,
                                            seed=seed, share=share_to_bytes(value))
                if committed[start: start + COMMITMENT_BYTES] != expected:
                    raise SecureAggregationError(
                        f"node {reply.node} revealed a {'seed' if seed else 'key'} share of node {owner} that does not "
                        "match the commitment made with it; its reply is refused", node=str(reply.node))
        self.shares[reply.node] = reply

    def _points(self, owner: int, *, key: bool) -> tuple[dict[int, int], int]:
        members = self.epoch.members
        holders = [*self.epoch.neighbours(owner), owner]
        t = self.epoch.params.local_threshold(len(members), len(holders))
        points: dict[int, int] = {}
        for h in holders:
            reply = self.shares.get(h)
            if reply is not None:
                held = reply.key_shares if key else reply.seed_shares
                if owner in held:
                    points[self.epoch.position[h] + 1] = held[owner]
        return points, t

    def can_unmask(self) -> bool:
        """Enough shares arrived to rebuild every secret the unmask request names."""
        if self.request is None:
            return False
        return all(
            len(points) >= t
            for alive, gone in self.request.groups
            for owner, key in [*((u, False) for u in alive), *((u, True) for u in gone)]
            for points, t in [self._points(owner, key=key)]
        )

    def _secret(self, owner: int, *, key: bool) -> bytes:
        points, t = self._points(owner, key=key)
        if len(points) < t:
            raise QuorumNotMetError(f"only {len(points)} of the {t} shares needed for node {owner} arrived")
        return reconstruct_secret(points, threshold=t, length=KEY_BYTES)

    def result(self) -> list[GroupOutcome]:
        """Each group's unmasked, decoded sum, or why it could not be unmasked."""
        if self.request is None:
            raise SecureAggregationError("the unmask stage has not run")
        fp = self.epoch.params.fixed_point(len(self.epoch.members))
        kept = {tuple(sorted(a + d)): (a, d) for a, d in self.request.groups}
        outcomes: list[GroupOutcome] = []
        for g, members in enumerate(self.groups):
            if members not in kept:
                outcomes.append(GroupOutcome((), members, error="below quorum at the input stage"))
                continue
            alive, gone = kept[members]
            outcome = GroupOutcome(alive, gone)
            try:
                outcome.total = fp.decode(self._unmasked(self.sums[g], alive, gone))
            except SecureAggregationError as exc:
                outcome.error = str(exc)
            outcomes.append(outcome)
            self.sums[g] = self.sums[g][:0]
        return outcomes

    def _unmasked(self, masked: NDArray[np.unsignedinteger], alive: tuple[int, ...], gone: tuple[int, ...]) -> NDArray[np.unsignedinteger]:
        epoch, slot = self.epoch.epoch, self.slot
        total = masked.copy()
        for u in alive:
            seed = self._secret(u, key=False)
            add_keystream(total, self_mask_key(seed, epoch=epoch, slot=slot), subtract=True)
        for u in gone:
            private = self._secret(u, key=True)
            if public_key(private) != self.epoch.ads[u].mask_keys[slot]:
                raise SecureAggregationError(f"rebuilt slot key of node {u} does not match its public key")
            self.epoch.reconstructed.add((u, slot))
            loaded = load_private(private)
            for v in self.epoch.neighbours(u):
                if v not in alive:
                    continue
                key = pairwise_mask_key(loaded, self.epoch.ads[v].mask_keys[slot], epoch=epoch, slot=slot)
                add_keystream(total, key, subtract=v < u)  # v added this stream when v < u: take it away
        return total
