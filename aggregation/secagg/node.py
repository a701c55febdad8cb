"""The node's side of the masking protocol: one key epoch as a state machine that fails closed.

Stages: ``NodeEpoch.advertise`` (fresh keys) → ``share`` (Shamir shares, encrypted per neighbour)
→ per round ``mask`` (with the train reply) → ``unmask`` (shares for the server). Every stage checks
what it receives and raises ``SecureAggregationError`` instead of doing anything unsafe: a slot is
masked at most once, a dropped node's key share and a survivor's seed share are never both
revealed for the same slot, and nothing is revealed for a group below its quorum. A slot's secrets
are erased as soon as they have done their job: the node's own slot key and self-mask seed once its
masked input is made; the shares it holds for a slot once it unmasked that slot (all but the part
it revealed, which the server already has, so a retried request still gets the same answer), and
everything of older slots once a newer slot is masked (they were skipped or their round was
abandoned). A stolen node state then holds no key to the masks of past rounds. The whole state
round-trips through ``to_bytes``/``from_bytes`` because the node keeps it between messages.

What the node remembers of each slot's groups and views (the group it masked with, the view it
signed, the survivors it unmasked for) is only ever compared for equality, so it keeps a SHA-256
digest of each (``_digest``) rather than the node lists. With the lists, a node of 1,000
departments (174 neighbours, 2 slots) stored 346 KB after two rounds; it stores 135 KB now, most of
it its neighbours' keys and the shares it holds. Flower's simulation engine keeps every virtual
node's state in the ServerApp's process, so this is also that process's memory. Member lists are
stored as packed 64-bit ids and keys in base64; ``from_bytes`` still reads the earlier all-hex form.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from numpy.typing import NDArray

from quorumfl.aggregation.secagg.identity import Roster, advertisement_message, view_message
from quorumfl.aggregation.secagg.messages import (
    EPOCH_BYTES,
    EpochAnnouncement,
    KeyAdvertisement,
    KeyDirectory,
    MaskingParams,
    MaskRequest,
    ShareBundle,
    UnmaskReply,
    UnmaskRequest,
    announcement_terms,
    pack_ids,
    share_commitment,
    unpack_ids,
)
from quorumfl.aggregation.secagg.shamir import (
    SHARE_BYTES,
    share_from_bytes,
    share_to_bytes,
    split_secret,
)
from quorumfl.aggregation.secagg.streams import (
    KEY_BYTES,
    add_keystream,
    decrypt_bundle,
    encrypt_bundle,
    load_private,
    new_private_key,
    pairwise_mask_key,
    public_key,
    self_mask_key,
)
from quorumfl.errors import QuorumNotMetError, SecureAggregationError

__all__ = ["NodeEpoch"]

_SLOT_BYTES = 2 * SHARE_BYTES  # key share + seed share


@dataclass
class NodeEpoch:
    node: int
    epoch: bytes
    params: MaskingParams
    cohort: tuple[int, ...]
    share_private: bytes
    mask_private: list[bytes]
    seeds: list[bytes]
    members: tuple[int, ...] = ()
    graph_seed: bytes = b""
    peers: dict[int, KeyAdvertisement] = field(default_factory=dict)
    held: dict[int, bytes] = field(default_factory=dict)  # owner -> plaintext bundle (shares I hold)
    used: dict[int, bytes] = field(default_factory=dict)  # slot -> digest of the group it was masked with
    revealed: dict[int, bytes] = field(default_factory=dict)  # slot -> digest of (survivors, dropped) unmasked for
    department: str = ""  # the roster name this node signs as ("" in an unsigned federation)
    signature: bytes = b""  # over this node's advertisement
    binding: bytes = b""  # the run the signatures are bound to
    confirmed: dict[int, bytes] = field(default_factory=dict)  # slot -> digest of the view this node signed

    def _fail(self, message: str) -> SecureAggregationError:
        return SecureAggregationError(message, node=str(self.node))

    # ---- stage 1 ----------------------------------------------------------------------------
    @classmethod
    def advertise(
        cls, announcement: EpochAnnouncement, node: int, *, signer: Callable[[bytes], bytes] | None = None,
        department: str = "", binding: bytes = b"",
    ) -> tuple[NodeEpoch, KeyAdvertisement]:
        """Fresh keys; with ``signer`` (the department's node key) the advertisement is signed for
        ``department`` and bound to the run (``binding``) and the epoch."""
        cohort = announcement.cohort
        if len(announcement.epoch) != EPOCH_BYTES:
            raise SecureAggregationError(f"epoch id must be {EPOCH_BYTES} bytes", node=str(node))
        if list(cohort) != sorted(set(cohort)) or node not in cohort:
            raise SecureAggregationError("cohort must be sorted, unique and include this node", node=str(node))
        announcement.params.check(len(cohort))
        slots = announcement.params.slots
        state = cls(
            node=node,
            epoch=announcement.epoch,
            params=announcement.params,
            cohort=tuple(cohort),
            share_private=new_private_key(),
            mask_private=[new_private_key() for _ in range(slots)],
            seeds=[os.urandom(KEY_BYTES) for _ in range(slots)],
            department=department,
            binding=binding,
        )
        if signer is not None:
            if not department:
                raise SecureAggregationError("a signed advertisement names its department", node=str(node))
            unsigned = state.advertisement()
            state.signature = signer(state._message(unsigned))
        return state, state.advertisement()

    def _message(self, ad: KeyAdvertisement) -> bytes:
        return advertisement_message(binding=self.binding, epoch=self.epoch,
                                     terms=announcement_terms(self.params, self.cohort), node=ad.node,
                                     department=ad.department, share_key=ad.share_key, mask_keys=ad.mask_keys)

    def advertisement(self) -> KeyAdvertisement:
        return KeyAdvertisement(
            node=self.node,
            share_key=public_key(self.share_private),
            mask_keys=tuple(public_key(k) for k in self.mask_private),
            department=self.department,
            signature=self.signature,
        )

    def _check_identities(self, directory: KeyDirectory, roster: Roster | None) -> None:
        """Every advertisement in the directory is signed by its department's roster key, and no
        department appears twice; an unsigned federation (no roster) accepts unsigned ones only."""
        if roster is None:
            if any(ad.signature or ad.department for ad in directory.keys.values()) or self.signature:
                raise self._fail("signed advertisements need the run's roster to be checked; refusing")
            return
        if not self.signature:
            raise self._fail("the run has a roster, so this node must sign its advertisement")
        seen: dict[str, int] = {}
        for peer, ad in directory.keys.items():
            roster.check(ad.department, self._message(ad), ad.signature, node=peer)
            if seen.setdefault(ad.department, peer) != peer:
                raise self._fail(f"department {ad.department!r} advertised keys for two nodes ({seen[ad.department]}, "
                                 f"{peer}); refusing")

    # ---- stage 2 ----------------------------------------------------------------------------
    def neighbours(self) -> list[int]:
        index = self.members.index(self.node)
        return [self.members[j] for j in sorted(self.params.neighbours_of(index, len(self.members), self.graph_seed))]

    def share(self, directory: KeyDirectory, *, roster: Roster | None = None) -> list[ShareBundle]:
        """Shamir shares for the neighbours; with ``roster``, only after every advertisement in the
        directory verified under its department's registered key."""
        if self.members:
            raise self._fail("shares for this epoch were already made")
        if directory.epoch != self.epoch:
            raise self._fail("key directory is for another epoch")
        members = directory.members
        if list(members) != sorted(set(members)) or not set(members) <= set(self.cohort) or self.node not in members:
            raise self._fail("members must be a sorted subset of the cohort that includes this node")
        if len(members) < self.params.threshold:
            raise QuorumNotMetError(
                f"{len(members)} node(s) advertised keys, threshold is {self.params.threshold}", node=str(self.node)
            )
        if directory.keys.get(self.node) != self.advertisement():
            raise self._fail("the directory does not carry this node's own keys")
        self._check_identities(directory, roster)
        self.members, self.graph_seed = tuple(members), directory.graph_seed
        neighbours = self.neighbours()
        seen: set[bytes] = set()
        for peer in [*neighbours, self.node]:
            ad = directory.keys.get(peer)
            if ad is None or ad.node != peer:
                raise self._fail(f"the directory has no keys for neighbour {peer}")
            ad.check(self.params.slots)
            for key in (ad.share_key, *ad.mask_keys):
                if key in seen:
                    raise self._fail("two advertised public keys are equal")
                seen.add(key)
            if peer != self.node:
                self.peers[peer] = ad
        holders = [*neighbours, self.node]
        position = {m: i for i, m in enumerate(members)}
        xs = [position[h] + 1 for h in holders]
        t = self.params.local_threshold(len(members), len(holders))
        parts: dict[int, list[bytes]] = {x: [] for x in xs}
        for key, seed in zip(self.mask_private, self.seeds, strict=True):
            key_shares = split_secret(key, threshold=t, holders=xs)
            seed_shares = split_secret(seed, threshold=t, holders=xs)
            for x in xs:
                parts[x].append(share_to_bytes(key_shares[x]) + share_to_bytes(seed_shares[x]))
        self.held[self.node] = b"".join(parts[position[self.node] + 1])
        private = load_private(self.share_private)
        return [
            ShareBundle(
                sender=self.node,
                recipient=peer,
                ciphertext=encrypt_bundle(
                    b"".join(parts[position[peer] + 1]),
                    private=private,
                    peer_public=self.peers[peer].share_key,
                    epoch=self.epoch,
                    sender=self.node,
                    recipient=peer,
                ),
                commitment=self._commitments(self.node, peer, b"".join(parts[position[peer] + 1])),
            )
            for peer in neighbours
        ]

    def _commitments(self, owner: int, holder: int, plain: bytes) -> bytes:
        """The commitments to every slot's key and seed share in one bundle's plaintext."""
        out = []
        for slot in range(self.params.slots):
            offset = slot * _SLOT_BYTES
            for seed, start in ((False, offset), (True, offset + SHARE_BYTES)):
                out.append(share_commitment(epoch=self.epoch, owner=owner, holder=holder, slot=slot, seed=seed,
                                            share=plain[start: start + SHARE_BYTES]))
        return b"".join(out)

    # ---- per round: mask ----------------------------------------------------------------------
    def _receive(self, bundle: ShareBundle, private: X25519PrivateKey) -> None:
        if bundle.recipient != self.node or bundle.sender not in self.peers:
            raise self._fail(f"share bundle from {bundle.sender} to {bundle.recipient} is not for this node")
        plain = decrypt_bundle(
            bundle.ciphertext,
            private=private,
            peer_public=self.peers[bundle.sender].share_key,
            epoch=self.epoch,
            sender=bundle.sender,
            recipient=self.node,
        )
        if len(plain) != self.params.slots * _SLOT_BYTES:
            raise self._fail(f"share bundle from {bundle.sender} has the wrong length")
        if bundle.commitment != self._commitments(bundle.sender, self.node, plain):
            raise self._fail(f"the commitments relayed with node {bundle.sender}'s shares do not match them; refusing "
                             "(the server could not check what this node reveals)")
        known = self.held.get(bundle.sender)
        if known is not None:  # a bundle sent again (its first delivery was not confirmed): parts erased stay erased
            erased = bytes(SHARE_BYTES)
            for i in range(0, len(plain), SHARE_BYTES):
                if known[i: i + SHARE_BYTES] not in (erased, plain[i: i + SHARE_BYTES]):
                    raise self._fail(f"node {bundle.sender} sent two different share bundles")
            return
        self.held[bundle.sender] = plain

    def _check_group(self, group: tuple[int, ...]) -> None:
        if list(group) != sorted(set(group)) or not set(group) <= set(self.members):
            raise self._fail("a group must be a sorted, unique subset of the epoch's members")
        if len(group) < self.params.group_quorum:
            raise QuorumNotMetError(
                f"group of {len(group)} is below the quorum {self.params.group_quorum}", node=str(self.node)
            )

    def mask(self, request: MaskRequest, values: NDArray[np.floating], rng: np.random.Generator) -> NDArray[np.unsignedinteger]:
        """Encode ``values`` and hide them under the slot's self mask and pairwise masks."""
        if not self.members:
            raise self._fail("no shares were made for this epoch yet")
        if request.epoch != self.epoch:
            raise self._fail("mask request is for another epoch; the node must re-key")
        if not 0 <= request.slot < self.params.slots:
            raise self._fail(f"slot {request.slot} is outside this epoch's {self.params.slots} slots")
        if request.slot in self.used:
            raise self._fail(f"slot {request.slot} was already used; a mask key is never used twice")
        if self.used and request.slot < max(self.used):
            raise self._fail(f"slot {request.slot} is older than a slot this node already used")
        if request.incoming:
            private = load_private(self.share_private)
            for bundle in request.incoming:
                self._receive(bundle, private)
        group = request.group
        self._check_group(group)
        if self.node not in group:
            raise self._fail("this node is not in the group it is asked to mask for")
        in_group = set(group)
        partners = [p for p in self.neighbours() if p in in_group]
        if not partners:
            raise self._fail("no neighbour takes part in this group; the input would be exposed")
        missing = [p for p in partners if p not in self.held]
        if missing:
            raise self._fail(f"no share bundle from group member(s) {missing}")
        fp = self.params.fixed_point(len(self.members))
        masked, _ = fp.encode(values, rng)
        slot = request.slot
        self.used[slot] = _digest([group])  # recorded before any mask is added: a failure later never reuses it
        add_keystream(masked, self_mask_key(self.seeds[slot], epoch=self.epoch, slot=slot))
        mask_private = load_private(self.mask_private[slot])
        for peer in partners:
            key = pairwise_mask_key(mask_private, self.peers[peer].mask_keys[slot], epoch=self.epoch, slot=slot)
            add_keystream(masked, key, subtract=self.node > peer)
        del mask_private
        self.mask_private[slot], self.seeds[slot] = b"", b""  # done: only the holders' shares can rebuild them
        for older in range(slot):  # skipped, or their round was abandoned: nothing of them is needed again
            self.mask_private[older], self.seeds[older] = b"", b""
            for owner in self.held:
                self._wipe(owner, older, key=True, seed=True)
        return masked

    def _wipe(self, owner: int, slot: int, *, key: bool, seed: bool) -> None:
        """Overwrite the key share and/or seed share this node holds of ``owner`` for ``slot``."""
        held = bytearray(self.held[owner])
        offset = slot * _SLOT_BYTES
        if key:
            held[offset: offset + SHARE_BYTES] = bytes(SHARE_BYTES)
        if seed:
            held[offset + SHARE_BYTES: offset + _SLOT_BYTES] = bytes(SHARE_BYTES)
        self.held[owner] = bytes(held)

    def _share(self, owner: int, start: int) -> int:
        raw = self.held[owner][start: start + SHARE_BYTES]
        if raw == bytes(SHARE_BYTES):
            raise self._fail(f"the share of node {owner} for this slot was erased; it cannot be revealed")
        return share_from_bytes(raw)

    # ---- per round: unmask ----------------------------------------------------------------------
    def _check_view(self, request: UnmaskRequest, stage: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(all survivors, all dropped) of a consistency or unmask request, checked against what this
        node itself did in the slot."""
        if request.epoch != self.epoch:
            raise self._fail(f"{stage} request is for another epoch")
        slot = request.slot
        if slot not in self.used:
            raise self._fail(f"this node sent no masked input in slot {slot}")
        if slot < max(self.used):  # that round was abandoned: its inputs are never unmasked
            raise self._fail(f"slot {slot} is older than slot {max(self.used)}, which this node masked since; "
                             "nothing of it is confirmed or revealed")
        survivors: set[int] = set()
        dropped: set[int] = set()
        mine: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        for alive, gone in request.groups:
            if len(alive) < self.params.group_quorum:
                raise QuorumNotMetError(
                    f"only {len(alive)} survivor(s) in a group, quorum is {self.params.group_quorum}; nothing revealed",
                    node=str(self.node),
                )
            both = set(alive) | set(gone)
            if len(both) != len(alive) + len(gone) or both & (survivors | dropped) or not both <= set(self.members):
                raise self._fail(f"{stage} groups must be disjoint sets of epoch members")
            survivors |= set(alive)
            dropped |= set(gone)
            if self.node in both:
                mine = (tuple(sorted(alive)), tuple(sorted(gone)))
        if mine is None or self.node not in mine[0]:
            raise self._fail("this node is not listed as a survivor")
        if _digest([tuple(sorted(mine[0] + mine[1]))]) != self.used[slot]:
            raise self._fail("survivors and dropped nodes do not match the group this node masked with")
        return tuple(sorted(survivors)), tuple(sorted(dropped))

    # ---- per round: consistency (signed epochs) -------------------------------------------------
    def confirm(self, request: UnmaskRequest, signer: Callable[[bytes], bytes]) -> bytes:
        """Sign the round's survivor/dropped view; a node signs one view per slot and no other, and
        none other than the view it already unmasked for without a consistency stage."""
        survivors, dropped = self._check_view(request, "consistency")
        view = request.view()
        seen = _view_digest(view)
        previous = self.confirmed.get(request.slot)
        if previous is not None and previous != seen:
            raise self._fail(f"slot {request.slot}: the server already showed this node other survivors; "
                             "refusing to sign a second view")
        answered = self.revealed.get(request.slot)
        if answered is not None and answered != _digest([survivors, dropped]):
            raise self._fail(f"slot {request.slot}: this node already revealed shares for other survivors; "
                             "refusing to sign a second view")
        self.confirmed[request.slot] = seen
        return signer(view_message(binding=self.binding, epoch=self.epoch, slot=request.slot, view=view))

    def _check_confirmations(self, request: UnmaskRequest, roster: Roster, survivors: tuple[int, ...]) -> None:
        """Enough of the nodes holding this node's shares signed this very view (and so did this node)."""
        view = request.view()
        if self.confirmed.get(request.slot) != _view_digest(view):
            raise self._fail(f"slot {request.slot}: this node did not confirm these survivors; nothing revealed")
        message = view_message(binding=self.binding, epoch=self.epoch, slot=request.slot, view=view)
        holders = {*self.neighbours(), self.node}
        needed = self.params.local_threshold(len(self.members), len(holders))
        valid: set[int] = set()
        for signer, signature in request.confirmations.items():
            if len(valid) >= needed:  # enough: verifying the rest (~0.1 ms each) would change nothing
                break
            if signer not in holders or signer not in survivors:
                continue
            department = self.department if signer == self.node else self.peers[signer].department
            try:
                roster.check(department, message, signature, node=signer)
            except SecureAggregationError:
                continue  # a bad signature counts for nothing
            valid.add(signer)
        if len(valid) < needed:
            raise self._fail(f"only {len(valid)} survivor(s) confirmed this view with a valid signature, "
                             f"{needed} needed; the server may be showing nodes different views; nothing revealed")

    # ---- per round: unmask ----------------------------------------------------------------------
    def unmask(self, request: UnmaskRequest, *, roster: Roster | None = None) -> UnmaskReply:
        """The shares this node may reveal; in a signed epoch (``roster``) only for a view it confirmed
        and enough of its share holders confirmed with valid signatures, or, without a consistency
        stage, for a view that names no dropped node on the complete graph
        (``UnmaskRequest.needs_confirmations``) when this node has signed no other view of the slot.

        Why the no-dropout view needs no signatures: the server can only unmask one node's input v by
        rebuilding both its seed b_v (from t holders shown v alive) and its slot key s_v (from t holders
        shown v dropped, each of whom checks t signatures over that view). An honest node takes one
        view per slot: once it has answered a no-dropout view it signs no other (``confirm``), and once
        it has signed a view it answers no other. So the honest nodes revealing b_v and the honest
        signers of a view dropping v are disjoint sets, each needing t minus the colluders: the same
        2t − n colluders bound as when every view is signed. A no-dropout view reveals no key share,
        so a node answering it needs no proof that others saw the same view."""
        survivors, dropped = self._check_view(request, "unmask")
        slot = request.slot
        if roster is not None:
            signed = self.confirmed.get(slot)
            complete = len(self.neighbours()) == len(self.members) - 1
            if request.needs_confirmations(complete=complete) or (signed is not None
                                                                  and signed != _view_digest(request.view())):
                self._check_confirmations(request, roster, survivors)
        answer = _digest([survivors, dropped])
        previous = self.revealed.get(slot)
        if previous is not None and previous != answer:
            raise self._fail(f"slot {slot} was already unmasked with other survivors; refusing")
        self.revealed[slot] = answer
        offset = slot * _SLOT_BYTES
        seed_shares = {u: self._share(u, offset + SHARE_BYTES) for u in survivors if u in self.held}
        key_shares = {u: self._share(u, offset) for u in dropped if u in self.held}
        for owner in self.held:  # keep only what was just revealed (a retry gets the same answer)
            self._wipe(owner, slot, key=owner not in dropped, seed=owner not in survivors)
        return UnmaskReply(node=self.node, seed_shares=seed_shares, key_shares=key_shares)

    # ---- persistence ----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        def ad(a: KeyAdvertisement) -> list[str | list[str]]:
            return [_b64(a.share_key), [_b64(k) for k in a.mask_keys], a.department, _b64(a.signature)]

        def digests(d: dict[int, bytes]) -> dict[str, str]:
            return {str(k): _b64(v) for k, v in d.items()}

        return json.dumps(
            {
                "format": 2,
                "node": str(self.node), "epoch": _b64(self.epoch), "params": self.params.to_dict(),
                "cohort": _b64(pack_ids(self.cohort)), "share_private": _b64(self.share_private),
                "mask_private": [_b64(k) for k in self.mask_private], "seeds": [_b64(s) for s in self.seeds],
                "members": _b64(pack_ids(self.members)), "graph_seed": _b64(self.graph_seed),
                "peers": {str(p): ad(a) for p, a in self.peers.items()},
                "held": {str(o): _b64(h) for o, h in self.held.items()},
                "used": digests(self.used), "revealed": digests(self.revealed), "confirmed": digests(self.confirmed),
                "department": self.department, "signature": _b64(self.signature), "binding": _b64(self.binding),
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> NodeEpoch:
        """The state ``to_bytes`` wrote, or one in the earlier form (hex, the groups and views in full)."""
        try:
            raw = json.loads(data)
            compact = raw.get("format") == 2
            raw_bytes: Callable[[str], bytes] = _unb64 if compact else bytes.fromhex
            ids: Callable[[Any], tuple[int, ...]] = (lambda text: unpack_ids(_unb64(text))) if compact else _id_list
            if compact:
                used, revealed, confirmed = (
                    {int(k): _unb64(v) for k, v in raw[name].items()} for name in ("used", "revealed", "confirmed"))
            else:
                used = {int(s): _digest([_id_list(g)]) for s, g in raw["used"].items()}
                revealed = {int(s): _digest([_id_list(v[0]), _id_list(v[1])]) for s, v in raw["revealed"].items()}
                confirmed = {int(s): _view_digest(tuple((_id_list(a), _id_list(d)) for a, d in v))
                             for s, v in raw["confirmed"].items()}
            return cls(
                node=int(raw["node"]),
                epoch=raw_bytes(raw["epoch"]),
                params=MaskingParams.from_dict(raw["params"]),
                cohort=ids(raw["cohort"]),
                share_private=raw_bytes(raw["share_private"]),
                mask_private=[raw_bytes(k) for k in raw["mask_private"]],
                seeds=[raw_bytes(s) for s in raw["seeds"]],
                members=ids(raw["members"]),
                graph_seed=raw_bytes(raw["graph_seed"]),
                peers={
                    int(p): KeyAdvertisement(int(p), raw_bytes(a[0]), tuple(raw_bytes(k) for k in a[1]),
                                             str(a[2]), raw_bytes(a[3]))
                    for p, a in raw["peers"].items()
                },
                held={int(o): raw_bytes(h) for o, h in raw["held"].items()},
                used=used,
                revealed=revealed,
                department=str(raw["department"]),
                signature=raw_bytes(raw["signature"]),
                binding=raw_bytes(raw["binding"]),
                confirmed=confirmed,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise SecureAggregationError(f"stored secure-aggregation state is unreadable ({exc})") from exc


def _b64(raw: bytes) -> str:
    return binascii.b2a_base64(raw, newline=False).decode("ascii")


def _unb64(text: str) -> bytes:
    """Strict base64 (what ``base64.b64decode(validate=True)`` checks, without its Python wrappers:
    a state holds a few thousand fields)."""
    return binascii.a2b_base64(text, strict_mode=True)


def _id_list(xs: list[str]) -> tuple[int, ...]:
    """Node ids as the earlier form stored them (a list of decimal strings)."""
    return tuple(int(x) for x in xs)


def _digest(parts: Sequence[Sequence[int]]) -> bytes:
    """SHA-256 of node-id lists, each length-prefixed (so no two different lists of lists collide but
    by a SHA-256 collision): what the node keeps of a group or a view it only ever compares."""
    h = hashlib.sha256(len(parts).to_bytes(4, "big"))
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(pack_ids(part))
    return h.digest()


def _view_digest(view: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bytes:
    """``_digest`` of a survivor view: its (survivors, dropped) pairs in order."""
    return _digest([part for pair in view for part in pair])
