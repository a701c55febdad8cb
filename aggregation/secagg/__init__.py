"""Threshold secure aggregation by masking (SecAgg / SecAgg+ style), as pure state machines.

The server learns the sum of a group's inputs, and only when at least the quorum of its members
sent one; it never sees one node's input. No Flower, no I/O: ``quorumfl.server.secure`` and
``quorumfl.client.secure`` carry these messages over Flower.

Protocol (Bonawitz et al. CCS 2017; sparse graph of Bell et al. CCS 2020; multi-round keys in the
spirit of Flamingo, Ma et al. S&P 2023). n nodes, threshold t > n/2, R slots per key epoch.

Key epoch (two message round trips, once per R rounds):
  1. advertise: each node draws an X25519 share-encryption key c_u and, for every slot j < R, a slot
     key pair (s_uj, S_uj) and a self-mask seed b_uj; it sends the public keys.
  2. share: the server returns each node its neighbours' public keys; the node Shamir-splits every
     s_uj and b_uj (t-of-n over GF(2^521−1)) among its neighbours and itself, and sends each
     neighbour its shares encrypted with ChaCha20-Poly1305 under HKDF(X25519(c_u, c_v)).
  In a signed epoch every advertisement is signed with the department's registered node key and
  every node checks its peers' against the admin's roster before sharing (``identity``).
Round on slot j (the train round trip, a consistency round trip in signed epochs when a node dropped
or the graph is sparse, one unmask):
  3. mask (in the train reply): y_u = enc(x_u) + PRG(b_uj) + Σ_{v ∈ N(u)∩G} ±PRG(KDF(X25519(s_uj, S_vj)))
     mod 2^32 (or 2^64), + when u < v, − otherwise, where G is u's group this round.
  3½. consistency (signed epochs): the server shows each survivor the view (A, D) below; each signs
     it, once per slot; the unmask request carries the signatures, and a node reveals only for a
     view it signed and that enough of its share holders signed (Bonawitz et al., active variant).
     Skipped when D is empty on the complete graph: such a view asks for seed shares only, and a node
     answers it unsigned unless it signed another view of the slot, after which it signs no other
     (``NodeEpoch.unmask`` has the argument: the split-view bound below is unchanged).
  4. unmask: the server names the survivors A and the dropped D; each survivor returns its shares of
     b_vj for v ∈ A and of s_vj for v ∈ D. The server rebuilds those, removes PRG(b_vj) for v ∈ A and
     the pairwise masks between D and A; the pairwise masks inside A cancel in the sum.

Why the server learns only the sum (honest-but-curious server; up to t − 1 nodes colluding with it):
  * Each y_u is uniform to the server: it carries PRG(b_uj), and the server obtains b_uj only when u
    is a survivor, by which time y_u is already inside the sum. For a dropped u it rebuilds s_uj and
    never b_uj — a node answers one unmask request per slot and never reveals both for one node.
  * Fewer than t shares of a secret are independent of it (Shamir), so t − 1 colluding nodes and the
    server learn no secret a node did not agree to reveal.
  * Fewer than the quorum of survivors: the unmask request is not sent (server) and refused (node),
    so nothing beyond uniform-looking vectors is revealed.
  * Keys are per slot: a rebuilt s_uj unmasks only slot j, and a slot is masked at most once
    (the node refuses a reused slot), so a node whose key was rebuilt is never masked with it again;
    the next epoch re-keys everyone.
  * Share bundles are bound by AEAD associated data to epoch, sender and recipient; the server
    routes them but cannot read or redirect them.
Against an active server (signed epochs): substituted or replayed keys fail the roster check, and
a split view of who dropped gathers too few confirmations unless 2t − n colluding nodes sign both
views. Nodes check every message they receive against their own state.
"""

from quorumfl.aggregation.secagg.coordinator import CoordinatorEpoch, GroupOutcome, MaskedRound
from quorumfl.aggregation.secagg.fixedpoint import FixedPoint
from quorumfl.aggregation.secagg.graph import neighbour_graph, share_threshold, sparse_degree
from quorumfl.aggregation.secagg.messages import (
    EpochAnnouncement,
    KeyAdvertisement,
    KeyDirectory,
    MaskingParams,
    MaskRequest,
    ShareBundle,
    UnmaskReply,
    UnmaskRequest,
    resolve_threshold,
)
from quorumfl.aggregation.secagg.node import NodeEpoch
from quorumfl.aggregation.secagg.payload import (
    HEADER,
    SecureMean,
    flatten,
    read_payload,
    unflatten,
    weighted_payload,
)

__all__ = [
    "CoordinatorEpoch",
    "EpochAnnouncement",
    "FixedPoint",
    "HEADER",
    "GroupOutcome",
    "KeyAdvertisement",
    "KeyDirectory",
    "MaskRequest",
    "MaskedRound",
    "MaskingParams",
    "NodeEpoch",
    "SecureMean",
    "ShareBundle",
    "UnmaskReply",
    "UnmaskRequest",
    "flatten",
    "neighbour_graph",
    "read_payload",
    "resolve_threshold",
    "share_threshold",
    "sparse_degree",
    "unflatten",
    "weighted_payload",
]
