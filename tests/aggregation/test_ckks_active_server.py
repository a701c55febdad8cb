"""The active server against threshold CKKS: each attack, played with the real node code, fails.

The server relays the key ceremony and every decryption request. Here it plays the attacker: it
substitutes a transport key in the commitment directory; asks for decryptions under labels of its
own choosing (a fresh round or nonce, so the decryptors multiply their shares by a c1 it hopes
to exploit) and tries to read the joint key off them; names contributors who did not contribute
(noise) or leaves some out (their subset's sum: what the server may choose, once per round and group); replays a contribution from another round, strips or
forges a signature, moves one to another node; asks a node to encrypt twice under one nonce; and
keeps asking after the key's cap. Each is refused by the member with a reason or yields noise; an
honest signed round with a silent ceremony member and a lost contribution still equals numpy's sum.
"""

from __future__ import annotations

import dataclasses
import json
import os

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
    wire_form,
)
from quorumfl.aggregation.ckks.rns import add_mod, sub_mod
from quorumfl.aggregation.ckks.seal import Seal
from quorumfl.aggregation.ckks.threshold import NONCE_BYTES, _flooded, common_c1
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
    nonce: bytes
    group: int


def signed_round(public_key: bytes, shares: dict[int, KeyShare], contributors: tuple[int, ...],
                 round_number: int = 1, group: int = 0) -> SignedRound:
    rng = np.random.default_rng(round_number)
    values = {n: rng.normal(0.0, 0.05, LENGTH) for n in contributors}
    total = CiphertextSum(PARAMS, length=LENGTH, primes=2)
    nonce = os.urandom(NONCE_BYTES)
    ciphertexts, tags = {}, {}
    for node in contributors:
        ciphertexts[node] = wire_form(PARAMS, encrypt_vector(shares[node], values[node], primes=2,
                                                             round_number=round_number, group=group, nonce=nonce))
        total.add(node, ciphertexts[node])
        tags[node] = contribute(shares[node], ciphertexts[node], round_number=round_number, group=group, nonce=nonce,
                                length=LENGTH, primes=2, signer=_signer(node), department=DEPARTMENT[node],
                                binding=BINDING)
    return SignedRound(values, ciphertexts, total, tags, nonce, group)


@pytest.fixture(scope="module")
def keyed() -> tuple[bytes, dict[int, KeyShare]]:
    return signed_ceremony()


def _manifest(share: KeyShare, rnd: SignedRound, *, round_number: int = 1, nonce: bytes | None = None):  # type: ignore[no-untyped-def]
    return rnd.total.manifest(key_id=share.key_id, round=round_number, group=rnd.group,
                              nonce=rnd.nonce if nonce is None else nonce, subset=NODES[:T])


def _decrypt(share: KeyShare, rnd: SignedRound, *, round_number: int = 1,
             tags: list[Contribution] | None = None, asked: set[tuple[int, int]] | None = None,
             max_decryptions: int = 1000) -> np.ndarray:
    return partial_decrypt(share, _manifest(share, rnd, round_number=round_number), asked or set(),
                           list(rnd.tags.values()) if tags is None else tags,
                           roster=ROSTER, binding=BINDING, max_decryptions=max_decryptions)


def test_an_honest_signed_round_with_a_silent_member_and_a_lost_contribution_equals_the_numpy_sum() -> None:
    public_key, shares = signed_ceremony(silent=NODES[4])  # committed, then never revealed: holds no share
    assert set(shares) == set(NODES[:4]) and all(s.holders == NODES[:4] for s in shares.values())
    rnd = signed_round(public_key, shares, NODES[:3])  # NODES[3]'s encrypted update was lost on the way
    manifest = _manifest(shares[NODES[0]], rnd)
    partials = {n: partial_decrypt(shares[n], manifest, set(), list(rnd.tags.values()), roster=ROSTER,
                                   binding=BINDING) for n in manifest.subset}
    result = combine(PARAMS, rnd.total.c0, partials, manifest)
    reference = np.sum(np.stack(list(rnd.values.values())), axis=0)
    assert np.max(np.abs(result - reference)) <= 6 * PARAMS.error_std(T, 4)


def _lagrange_sum(shares: dict[int, KeyShare], manifest, partials: dict[int, np.ndarray]) -> np.ndarray:  # type: ignore[no-untyped-def]
    total = np.zeros_like(next(iter(partials.values())))
    for node in manifest.subset:
        total = add_mod(total, partials[node], Seal.of(PARAMS).primes_at(manifest.primes))
    return total


def test_decryptions_under_labels_of_the_servers_choosing_reveal_neither_the_key_nor_an_update(
    keyed: tuple[bytes, dict[int, KeyShare]],
) -> None:
    """The server cannot hand decryptors a c1 (they derive it from the label), so the old attack —
    a large constant K as c1, s·K standing out of the flooding — has nothing to work with. Under a
    fresh label it learns Σd = s_C·a' + F for a uniform a' of the oracle's choosing: dividing by
    a' (pointwise, NTT form) gives s_C + F/a', which matches s_C at no coordinate. And the real
    c0 sum, decrypted with partials made under a fresh label, is noise."""
    public_key, shares = keyed
    rnd = signed_round(public_key, shares, NODES)
    seal = Seal.of(PARAMS)
    q = seal.primes_at(2)
    fresh = {"a fresh nonce": _manifest(shares[NODES[0]], rnd, nonce=os.urandom(NONCE_BYTES))}
    for name, manifest in fresh.items():
        with pytest.raises(SecureAggregationError, match="not signed by its registered key"):  # signed for rnd.nonce
            partial_decrypt(shares[NODES[0]], manifest, set(), list(rnd.tags.values()), roster=ROSTER, binding=BINDING)
        # unsigned federation: the request passes every rule, so play it through
        partials = {n: partial_decrypt(shares[n], manifest, set(), list(rnd.tags.values())) for n in manifest.subset}
        # the attacker's best case: the partials before the wire form rounds them (what travels is a
        # function of these, so it reveals no more)
        summed = _lagrange_sum(shares, manifest, {n: _flooded(shares[n], manifest) for n in manifest.subset})
        a = common_c1(manifest.key_id, round_number=manifest.round, group=manifest.group, nonce=manifest.nonce,
                      primes=q, chunks=summed.shape[0], degree=PARAMS.poly_degree)
        secret = np.zeros((2, PARAMS.poly_degree), dtype=np.uint64)
        for node in NODES:  # s_C, the key the attacker wants: the sum of the contributors' secrets
            secret = add_mod(secret, shares[node].secret, q)
        hits = 0
        for j, prime in enumerate(q):
            for i in range(0, PARAMS.poly_degree, 97):
                guess = int(summed[0, j, i]) * pow(int(a[0, j, i]), -1, int(prime)) % int(prime)
                hits += guess == int(secret[j, i])
        assert hits == 0, name
        noise = combine(PARAMS, rnd.total.c0, partials, manifest)
        assert np.median(np.abs(noise)) > 1e6, name  # the c0 were made under the round's own a
    assert np.max(np.abs(combine(PARAMS, rnd.total.c0, {n: _decrypt(shares[n], rnd) for n in NODES[:T]},
                                 _manifest(shares[NODES[0]], rnd))
                         - np.sum(np.stack(list(rnd.values.values())), axis=0))) <= 6 * PARAMS.error_std(T, 5)


def test_a_manifest_naming_a_non_contributor_is_noise_and_one_leaving_contributors_out_is_their_subsets_sum(
    keyed: tuple[bytes, dict[int, KeyShare]],
) -> None:
    """Naming a holder who sent nothing leaves a key part no c0 cancels: flooded noise. Leaving a
    contributor out is another matter: the server holds every c0, so it adds only the named ones and
    gets that subset's exact sum. That is what it can choose (docs/explanation/security.md): one such sum per
    round and group, of at least t contributors (or the signed minimum group)."""
    public_key, shares = keyed
    rnd = signed_round(public_key, shares, NODES[:4])
    honest = _manifest(shares[NODES[0]], rnd)
    tags = list(rnd.tags.values())
    named = dataclasses.replace(honest, contributors=NODES)
    extra = Contribution(NODES[4], "", b"\0" * 32, b"")
    partials = {n: partial_decrypt(shares[n], named, set(), [*tags, extra]) for n in named.subset}
    assert np.median(np.abs(combine(PARAMS, rnd.total.c0, partials, named))) > 1e6
    left_out = dataclasses.replace(honest, contributors=NODES[:3])
    subset = CiphertextSum(PARAMS, length=LENGTH, primes=2)
    for node in left_out.contributors:
        subset.add(node, rnd.ciphertexts[node])
    partials = {n: partial_decrypt(shares[n], left_out, set(), tags[:3], roster=ROSTER, binding=BINDING)
                for n in left_out.subset}
    reference = np.sum([rnd.values[n] for n in left_out.contributors], axis=0)
    assert np.max(np.abs(combine(PARAMS, subset.c0, partials, left_out) - reference)) <= 6 * PARAMS.error_std(T, 5)


def test_a_node_encrypts_once_under_a_nonce(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two encryptions under one (key, round, group, nonce) share their c1: c0 − c0' = Δ(x − x') +
    (e − e'), the difference of two updates to within noise. A server that asks again (a replayed
    train request) is refused by the key store's ledger, which outlives a restart."""
    from quorumfl.privacy.keystore import KeyStore, StoredKey

    _, shares = signed_ceremony()
    share = shares[NODES[0]]
    nonce = os.urandom(NONCE_BYTES)
    first = encrypt_vector(share, np.full(100, 0.5), primes=2, round_number=1, group=0, nonce=nonce)
    second = encrypt_vector(share, np.full(100, 0.25), primes=2, round_number=1, group=0, nonce=nonce)
    seal = Seal.of(PARAMS)
    difference = seal.decode(sub_mod(first, second, seal.primes_at(2)), 100)
    assert np.max(np.abs(difference - 0.25)) < 1e-6  # why the ledger exists: the server would read x − x'
    store = KeyStore(tmp_path / "keys")
    store.save_key(StoredKey(share, run_id=1))
    store.record_encrypted(share.key_id, nonce)
    with pytest.raises(SecureAggregationError, match="already encrypted"):
        KeyStore(tmp_path / "keys").record_encrypted(share.key_id, nonce)
    KeyStore(tmp_path / "keys").record_encrypted(share.key_id, os.urandom(NONCE_BYTES))  # a new round's nonce


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
    manifest = _manifest(shares[NODES[0]], rnd)
    tags = list(rnd.tags.values())

    def ask(node: int, *, minimum: int | None, sent: list[Contribution] = tags) -> np.ndarray:
        return partial_decrypt(shares[node], manifest, set(), sent, roster=ROSTER, binding=BINDING,
                               min_contributors=minimum)

    with pytest.raises(SecureAggregationError, match="2 distinct contributor.s., fewer than t=3"):
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
    manifest = dataclasses.replace(_manifest(shares[NODES[0]], rnd), contributors=(*NODES[:2], NODES[4]))
    with pytest.raises(SecureAggregationError, match="holds no share of this key"):
        partial_decrypt(shares[NODES[0]], manifest, set(), [*list(rnd.tags.values())[:2], outsider],
                        roster=ROSTER, binding=BINDING)
