"""The active server against threshold CKKS: each attack, played with the real node code, is refused.

The server relays the key ceremony and every decryption request. Here it plays the attacker: it
substitutes a transport key in the commitment directory, asks for the decryption of a crafted c1
(a large constant, which would put the joint secret key in the partial decryptions) under the
real round's label or a fresh one, of a combination of the contributors' own ciphertexts, replays
a tag from another round, strips or forges a contribution's signature, moves one to another node,
and keeps asking after the key's cap. Each is refused by the member with a reason; an honest
signed round with a silent ceremony member and a lost contribution still equals numpy's sum.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from quorumfl.aggregation.ckks import (
    Announcement,
    CeremonyCoordinator,
    CiphertextSum,
    CkksParams,
    Commitment,
    Contribution,
    KeyParty,
    KeyShare,
    combine,
    contribute,
    encrypt_vector,
    partial_decrypt,
)
from quorumfl.aggregation.ckks.seal import Seal
from quorumfl.aggregation.ckks.threshold import c1_digest
from quorumfl.aggregation.secagg.identity import Roster, sign
from quorumfl.aggregation.secagg.streams import new_private_key, public_key
from quorumfl.errors import SecureAggregationError

PARAMS = CkksParams()
NODES = tuple(2**62 + 313 * i for i in range(5))
NAMES = ("tax-office", "urban-planning", "public-works", "parks", "libraries")
KEYS = {name: ec.generate_private_key(ec.SECP384R1()) for name in NAMES}
SERVER_KEY = ec.generate_private_key(ec.SECP384R1())  # the attacker's own key, on no roster
DEPARTMENT = dict(zip(NODES, NAMES, strict=True))
BINDING = b"run:7"
T = 3
LENGTH = 5000


def _line(key: ec.EllipticCurvePrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


ROSTER = Roster.from_json(json.dumps({name: _line(key) for name, key in KEYS.items()}))


def _signer(node: int):  # type: ignore[no-untyped-def]
    key = KEYS[DEPARTMENT[node]]
    return lambda message: sign(key, message)


def _committed(members: tuple[int, ...] = NODES) -> tuple[CeremonyCoordinator, dict[int, KeyParty]]:
    coordinator = CeremonyCoordinator(Announcement.new(members, T, PARAMS))
    parties = {}
    for node in members:
        parties[node], commitment = KeyParty.commit(coordinator.announcement, node, signer=_signer(node),
                                                    department=DEPARTMENT[node], binding=BINDING)
        coordinator.add_commitment(commitment)
    return coordinator, parties


def signed_ceremony(silent: int | None = None) -> tuple[bytes, dict[int, KeyShare]]:
    """A signed ceremony of the five departments; ``silent`` commits and then never reveals."""
    coordinator, parties = _committed()
    directory = coordinator.directory()
    for node, party in parties.items():
        if node != silent:
            coordinator.add_reveal(party.reveal(directory, roster=ROSTER, binding=BINDING))
    reveals, inbox = coordinator.finish_request()
    shares = {n: parties[n].finish(reveals, inbox[n]) for n in reveals}
    assert coordinator.public_key is not None
    return coordinator.public_key, shares


@dataclasses.dataclass
class SignedRound:
    values: dict[int, np.ndarray]
    ciphertexts: dict[int, np.ndarray]
    total: CiphertextSum
    tags: dict[int, Contribution]


def signed_round(public_key: bytes, shares: dict[int, KeyShare], contributors: tuple[int, ...],
                 round_number: int = 1, group: int = 0) -> SignedRound:
    rng = np.random.default_rng(round_number)
    values = {n: rng.normal(0.0, 0.05, LENGTH) for n in contributors}
    total = CiphertextSum(PARAMS, length=LENGTH, primes=2)
    ciphertexts, tags = {}, {}
    for node in contributors:
        ciphertexts[node] = encrypt_vector(PARAMS, public_key, values[node], primes=2)
        total.add(node, ciphertexts[node])
        tags[node] = contribute(shares[node], ciphertexts[node][:, 1], round_number=round_number, group=group,
                                signer=_signer(node), department=DEPARTMENT[node], binding=BINDING)
    return SignedRound(values, ciphertexts, total, tags)


@pytest.fixture(scope="module")
def keyed() -> tuple[bytes, dict[int, KeyShare]]:
    return signed_ceremony()


def _decrypt(share: KeyShare, rnd: SignedRound, *, c1: np.ndarray | None = None, round_number: int = 1,
             tags: list[Contribution] | None = None, asked: set[tuple[int, int]] | None = None,
             max_decryptions: int = 1000) -> np.ndarray:
    c1 = rnd.total.c1 if c1 is None else c1
    manifest = dataclasses.replace(
        rnd.total.manifest(key_id=share.key_id, round=round_number, group=0, subset=NODES[:T]), digest=c1_digest(c1))
    return partial_decrypt(share, manifest, c1, asked or set(), list(rnd.tags.values()) if tags is None else tags,
                           roster=ROSTER, binding=BINDING, max_decryptions=max_decryptions)


def test_an_honest_signed_round_with_a_silent_member_and_a_lost_contribution_equals_the_numpy_sum() -> None:
    public_key, shares = signed_ceremony(silent=NODES[4])  # committed, then never revealed: holds no share
    assert set(shares) == set(NODES[:4]) and len({s.mac_key for s in shares.values()}) == 1
    rnd = signed_round(public_key, shares, NODES[:3])  # NODES[3]'s encrypted update was lost on the way
    manifest = rnd.total.manifest(key_id=shares[NODES[0]].key_id, round=1, group=0, subset=NODES[:T])
    partials = {n: partial_decrypt(shares[n], manifest, rnd.total.c1, set(), list(rnd.tags.values()), roster=ROSTER,
                                   binding=BINDING) for n in manifest.subset}
    result = combine(PARAMS, rnd.total.c0, partials, manifest)
    reference = np.sum(np.stack(list(rnd.values.values())), axis=0)
    assert np.max(np.abs(result - reference)) <= 6 * PARAMS.error_std(T, 4)


def test_a_crafted_c1_is_refused_under_the_rounds_label_and_under_a_fresh_one(
    keyed: tuple[bytes, dict[int, KeyShare]],
) -> None:
    public_key, shares = keyed
    rnd = signed_round(public_key, shares, NODES)
    crafted = np.full_like(rnd.total.c1, 1 << 55)  # s·K with K = 2^55 would stand out of the flooding noise
    with pytest.raises(SecureAggregationError, match="not the sum of the contributors' own ciphertexts"):
        _decrypt(shares[NODES[0]], rnd, c1=crafted)
    with pytest.raises(SecureAggregationError, match="not signed by its registered key"):  # a fresh label
        _decrypt(shares[NODES[0]], rnd, c1=crafted, round_number=77)
    fresh = dataclasses.replace(rnd.total.manifest(key_id=shares[NODES[0]].key_id, round=77, group=0, subset=NODES[:T]),
                                digest=c1_digest(crafted))
    with pytest.raises(SecureAggregationError, match="does not open"):  # without signatures the sealed tags still bind
        partial_decrypt(shares[NODES[0]], fresh, crafted, set(), list(rnd.tags.values()))
    _decrypt(shares[NODES[0]], rnd)  # the real aggregate under its own label is answered


def test_a_combination_of_the_contributors_own_ciphertexts_is_refused(keyed: tuple[bytes, dict[int, KeyShare]]) -> None:
    public_key, shares = keyed
    rnd = signed_round(public_key, shares, NODES)
    primes = np.asarray(Seal.of(PARAMS).primes_at(2), dtype=np.uint64)[:, None]
    doubled = (rnd.total.c1 + rnd.ciphertexts[NODES[1]][:, 1]) % primes  # 2·c1_B + the others
    with pytest.raises(SecureAggregationError, match="not the sum"):
        _decrypt(shares[NODES[0]], rnd, c1=doubled)


def test_replayed_stripped_forged_and_moved_contributions_are_refused(keyed: tuple[bytes, dict[int, KeyShare]]) -> None:
    public_key, shares = keyed
    rnd = signed_round(public_key, shares, NODES)
    old = signed_round(public_key, shares, NODES, round_number=2)
    honest = list(rnd.tags.values())
    victim = rnd.tags[NODES[2]]
    forged_message = b"anything"
    cases = {
        "replayed from round 2": [*honest[:2], old.tags[NODES[2]], *honest[3:]],
        "signature stripped": [*honest[:2], dataclasses.replace(victim, signature=b""), *honest[3:]],
        "signed by the server": [*honest[:2], dataclasses.replace(victim, signature=sign(SERVER_KEY, forged_message)),
                                 *honest[3:]],
        "another department's name": [*honest[:2], dataclasses.replace(victim, department="parks"), *honest[3:]],
    }
    for name, tags in cases.items():
        with pytest.raises(SecureAggregationError, match="not signed by its registered key") as info:
            _decrypt(shares[NODES[0]], rnd, tags=tags)
        print(f"refused ({name}):", info.value)
    moved = [*honest[:2], dataclasses.replace(victim, node=NODES[3]), *honest[3:]]  # two tags for one node
    with pytest.raises(SecureAggregationError, match="do not match the manifest"):
        _decrypt(shares[NODES[0]], rnd, tags=moved)
    with pytest.raises(SecureAggregationError, match="do not match the manifest"):  # a contributor's tag left out
        _decrypt(shares[NODES[0]], rnd, tags=honest[:-1])


def test_a_substituted_or_unsigned_transport_key_stops_the_ceremony() -> None:
    coordinator, parties = _committed()
    directory = coordinator.directory()
    victim = NODES[1]
    substituted = {**directory, victim: dataclasses.replace(directory[victim], transport_key=public_key(new_private_key()))}
    unsigned = {**directory, victim: Commitment(victim, directory[victim].digest, directory[victim].transport_key)}
    for tampered in (substituted, unsigned):
        for node in NODES:
            if node == victim:
                continue
            with pytest.raises(SecureAggregationError, match="not signed by its registered key|not on the admin's roster"):
                parties[node].reveal(tampered, roster=ROSTER, binding=BINDING)
    with pytest.raises(SecureAggregationError, match="not signed"):  # a commitment replayed into another run
        parties[NODES[0]].reveal(directory, roster=ROSTER, binding=b"run:8")


def test_each_key_answers_at_most_its_cap_and_never_a_round_twice(keyed: tuple[bytes, dict[int, KeyShare]]) -> None:
    public_key, shares = keyed
    rnd = signed_round(public_key, shares, NODES)
    share = shares[NODES[0]]
    with pytest.raises(SecureAggregationError, match="its cap of 3"):
        _decrypt(share, rnd, asked={(10, 0), (11, 0), (12, 0)}, max_decryptions=3)
    _decrypt(share, rnd, asked={(10, 0), (11, 0)}, max_decryptions=3)
    with pytest.raises(SecureAggregationError, match="already decrypted"):
        _decrypt(share, rnd, asked={(1, 0)})


def test_a_cluster_sum_below_the_signed_group_minimum_is_refused(keyed: tuple[bytes, dict[int, KeyShare]]) -> None:
    """IFCA under CKKS: each cluster is a group. A sum of 2 contributors (t = 3) is decrypted only when
    the admin-signed run config sets secagg-min-group to 2; a node never goes below 2, and tags signed
    for another group do not verify."""
    public_key, shares = keyed
    rnd = signed_round(public_key, shares, NODES[3:], group=1)
    manifest = rnd.total.manifest(key_id=shares[NODES[0]].key_id, round=1, group=1, subset=NODES[:T])
    tags = list(rnd.tags.values())

    def ask(node: int, *, minimum: int | None, sent: list[Contribution] = tags) -> np.ndarray:
        return partial_decrypt(shares[node], manifest, rnd.total.c1, set(), sent, roster=ROSTER, binding=BINDING,
                               min_contributors=minimum)

    with pytest.raises(SecureAggregationError, match="2 contributor.s., fewer than t=3"):
        ask(NODES[0], minimum=None)
    with pytest.raises(SecureAggregationError, match="fewer than the run's minimum group of 3"):
        ask(NODES[0], minimum=3)
    with pytest.raises(SecureAggregationError, match="would reveal single updates"):
        ask(NODES[0], minimum=1)
    elsewhere = signed_round(public_key, shares, NODES[3:], group=0).tags  # the same nodes' tags for group 0
    with pytest.raises(SecureAggregationError):
        ask(NODES[0], minimum=2, sent=list(elsewhere.values()))
    partials = {n: ask(n, minimum=2) for n in manifest.subset}
    result = combine(PARAMS, rnd.total.c0, partials, manifest)
    reference = rnd.values[NODES[3]] + rnd.values[NODES[4]]
    assert np.max(np.abs(result - reference)) <= 6 * PARAMS.error_std(T, len(NODES))  # the key has 5 holders


def test_a_contribution_from_outside_the_key_is_refused() -> None:
    public_key, shares = signed_ceremony(silent=NODES[4])
    rnd = signed_round(public_key, shares, NODES[:3])
    outsider = dataclasses.replace(rnd.tags[NODES[2]], node=NODES[4])  # holds no share: could not make a tag
    manifest = dataclasses.replace(
        rnd.total.manifest(key_id=shares[NODES[0]].key_id, round=1, group=0, subset=NODES[:T]),
        contributors=(*NODES[:2], NODES[4]))
    with pytest.raises(SecureAggregationError, match="holds no share of this key"):
        partial_decrypt(shares[NODES[0]], manifest, rnd.total.c1, set(), [*list(rnd.tags.values())[:2], outsider],
                        roster=ROSTER, binding=BINDING)
