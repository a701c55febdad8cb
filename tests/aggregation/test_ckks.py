"""Threshold CKKS against references: numpy's sum, SEAL's own Decryptor with Σ s_i, the error formula."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zstandard
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tenseal import sealapi

import quorumfl.aggregation.ckks.seal as seal_module
from quorumfl.aggregation.ckks import (
    Announcement,
    CeremonyCoordinator,
    CiphertextSum,
    CkksParams,
    Contribution,
    KeyParty,
    KeyShare,
    Manifest,
    ceremony_in_one_process,
    combine,
    contribute,
    encrypt_vector,
    pack_residues,
    partial_decrypt,
    unpack_residues,
    wire_form,
)
from quorumfl.aggregation.ckks.keys import Reveal
from quorumfl.aggregation.ckks.rns import (
    add_mod,
    add_mod_into,
    flooding_noise,
    lagrange_at_zero,
    mul_scalar,
    mul_small,
    reduced,
    residues_of_integers,
    shamir_shares,
    small_noise,
    uniform_below,
    uniform_mod,
)
from quorumfl.aggregation.ckks.seal import SCRATCH_PREFIX, Seal
from quorumfl.aggregation.ckks.streams import (
    CiphertextData,
    build_ciphertext,
    build_plaintext,
    parse_ciphertext,
    parse_plaintext,
)
from quorumfl.aggregation.ckks.threshold import NONCE_BYTES, _unflooded, common_c1
from quorumfl.aggregation.secagg.identity import field_bytes
from quorumfl.errors import ConfigError, QuorumNotMetError, SecureAggregationError

PARAMS = CkksParams()
MEMBERS = tuple(2**63 + 101 * i for i in range(10))  # Flower-sized ids
T = 6
LENGTH = 18000  # three ciphertexts of 8192 values (4096 complex slots), the last one partly filled
SOME = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])


@dataclasses.dataclass
class Ceremony:
    parties: dict[int, KeyParty]
    shares: dict[int, KeyShare]
    public_key: bytes
    key_id: str


def run_ceremony(members: tuple[int, ...] = MEMBERS, threshold: int = T, params: CkksParams = PARAMS) -> Ceremony:
    coordinator, parties, shares = ceremony_in_one_process(members, threshold, params)
    assert coordinator.public_key is not None and len(coordinator.confirmed) == len(members)
    return Ceremony(parties, shares, coordinator.public_key, coordinator.key_id)


def committed(members: tuple[int, ...], threshold: int) -> tuple[CeremonyCoordinator, dict[int, KeyParty]]:
    """A ceremony after stage 1 (every member committed)."""
    coordinator = CeremonyCoordinator(Announcement.new(members, threshold, PARAMS))
    parties = {}
    for node in members:
        parties[node], commitment = KeyParty.commit(coordinator.announcement, node)
        coordinator.add_commitment(commitment)
    return coordinator, parties


@pytest.fixture(scope="module")
def ceremony() -> Ceremony:
    return run_ceremony()


@dataclasses.dataclass
class Round:
    values: dict[int, np.ndarray]
    total: CiphertextSum
    primes: int
    ciphertexts: dict[int, np.ndarray]
    shares: dict[int, KeyShare]
    nonce: bytes

    def tags(self, round_number: int = 1, nodes: tuple[int, ...] | None = None) -> list[Contribution]:
        """What each contributor sends with its ciphertext in ``round_number``."""
        return [contribute(self.shares[n], wire_form(self.total.params, self.ciphertexts[n]), round_number=round_number,
                           group=0, nonce=self.nonce, length=self.total.length, primes=self.primes)
                for n in (nodes or tuple(self.ciphertexts))]

    def level_sum(self) -> np.ndarray:
        """Σ c0_i at the level the nodes compute at (before the wire form): the references' input."""
        total = np.zeros_like(next(iter(self.ciphertexts.values())))
        for c0 in self.ciphertexts.values():
            total = add_mod(total, c0, Seal.of(self.total.params).primes_at(self.primes))
        return total

    def c1(self, key_id: str, round_number: int = 1) -> np.ndarray:
        """The round's common c1 (every party derives it from the label)."""
        params = self.total.params
        return common_c1(key_id, round_number=round_number, group=0, nonce=self.nonce,
                         primes=Seal.of(params).primes_at(self.primes),
                         chunks=self.total.shape[0], degree=params.poly_degree)


def summed(shares: dict[int, KeyShare], values: dict[int, np.ndarray], *, length: int,
           primes: int, params: CkksParams = PARAMS, round_number: int = 1) -> Round:
    total = CiphertextSum(params, length=length, primes=primes)
    nonce = os.urandom(NONCE_BYTES)
    ciphertexts = {}
    for node, vector in values.items():
        ciphertexts[node] = encrypt_vector(shares[node], vector, primes=primes, round_number=round_number, group=0,
                                           nonce=nonce)
        total.add(node, wire_form(params, ciphertexts[node]))
    return Round(values, total, primes, ciphertexts, shares, nonce)


@pytest.fixture(scope="module")
def encrypted(ceremony: Ceremony) -> Round:
    rng = np.random.default_rng(7)
    values = {n: rng.normal(0.0, 0.01, LENGTH) for n in MEMBERS}
    return summed(ceremony.shares, values, length=LENGTH, primes=PARAMS.send_primes(T, len(MEMBERS), 8.0))


def secret_sum(ceremony: Ceremony, nodes: tuple[int, ...] = MEMBERS) -> np.ndarray:
    """Σ s_i over ``nodes`` at the key level, from the parties' own secrets (the test's reference)."""
    seal = Seal.of(PARAMS)
    total = np.zeros_like(next(iter(ceremony.parties.values())).secret)
    for node in nodes:
        total = add_mod(total, ceremony.parties[node].secret, seal.primes)
    return np.asarray(total, dtype=np.uint64)


def manifest(ceremony: Ceremony, rnd: Round, subset: tuple[int, ...], *, round_number: int = 1) -> Manifest:
    return rnd.total.manifest(key_id=ceremony.key_id, round=round_number, group=0, nonce=rnd.nonce, subset=subset)


# ---- decryption against references ----------------------------------------------------------------
@SOME
@given(st.sets(st.sampled_from(MEMBERS), min_size=T, max_size=T))
def test_any_t_subset_decrypts_within_the_documented_bound(ceremony: Ceremony, encrypted: Round, subset: set[int]) -> None:
    m = manifest(ceremony, encrypted, tuple(sorted(subset)))
    tags = encrypted.tags()
    partials = {n: partial_decrypt(ceremony.shares[n], m, set(), tags) for n in m.subset}
    result = combine(PARAMS, encrypted.total.c0, partials, m)
    reference = np.sum(np.stack(list(encrypted.values.values())), axis=0)
    bound = 6 * PARAMS.error_std(T, len(MEMBERS))  # the bound the docs (threshold CKKS) and params.check quote
    assert np.max(np.abs(result - reference)) <= bound


def test_without_flooding_the_threshold_result_equals_seals_decryptor_with_the_summed_key(
    ceremony: Ceremony, encrypted: Round
) -> None:
    seal = Seal.of(PARAMS)
    m = manifest(ceremony, encrypted, MEMBERS[2:8])
    total = encrypted.level_sum()
    for node in m.subset:
        total = add_mod(total, _unflooded(ceremony.shares[node], m), seal.primes_at(encrypted.primes))
    threshold = seal.decode(total, LENGTH)
    reference = seal.decrypt_reference(seal.secret_from(secret_sum(ceremony)), encrypted.level_sum(),
                                       encrypted.c1(ceremony.key_id), LENGTH)
    assert np.array_equal(threshold, reference)


def test_measured_error_matches_the_formula_within_30_percent(ceremony: Ceremony, encrypted: Round) -> None:
    m = manifest(ceremony, encrypted, MEMBERS[:T])
    tags = encrypted.tags()
    partials = {n: partial_decrypt(ceremony.shares[n], m, set(), tags) for n in m.subset}
    error = combine(PARAMS, encrypted.total.c0, partials, m) - np.sum(np.stack(list(encrypted.values.values())), axis=0)
    predicted = PARAMS.error_std(T, len(MEMBERS))
    assert abs(float(np.std(error)) / predicted - 1.0) < 0.30


def test_t_minus_one_shares_give_garbage(ceremony: Ceremony, encrypted: Round) -> None:
    seal = Seal.of(PARAMS)
    subset = MEMBERS[: T - 1]
    m = dataclasses.replace(manifest(ceremony, encrypted, MEMBERS[:T]), subset=subset)
    total = encrypted.level_sum()
    for node in subset:  # what t − 1 colluders could compute: Lagrange over their own indices
        total = add_mod(total, _unflooded(ceremony.shares[node], m), seal.primes_at(encrypted.primes))
    garbage = seal.decode(total, LENGTH)
    assert np.median(np.abs(garbage)) > 1e6


def test_a_members_encryption_is_seals_ciphertext_under_its_own_secret_and_the_rounds_c1(ceremony: Ceremony) -> None:
    """(c0_i, a) is a SEAL ciphertext of the values under s_i: SEAL's own decryptor reads it with
    s_i and reads noise with another member's secret or another round's c1."""
    seal = Seal.of(PARAMS)
    values = np.linspace(-3.0, 3.0, 5000)
    rnd = summed(ceremony.shares, {MEMBERS[0]: values}, length=values.shape[0], primes=2)
    c0, a = rnd.ciphertexts[MEMBERS[0]], rnd.c1(ceremony.key_id)
    decrypted = seal.decrypt_reference(seal.secret_from(secret_sum(ceremony, MEMBERS[:1])), c0, a, values.shape[0])
    assert np.max(np.abs(decrypted - values)) < 1e-9
    wrong = seal.decrypt_reference(seal.secret_from(secret_sum(ceremony, MEMBERS[1:2])), c0, a, values.shape[0])
    assert np.median(np.abs(wrong - values)) > 1e6
    other_round = seal.decrypt_reference(seal.secret_from(secret_sum(ceremony, MEMBERS[:1])), c0,
                                         rnd.c1(ceremony.key_id, round_number=2), values.shape[0])
    assert np.median(np.abs(other_round - values)) > 1e6


def test_the_dealt_shares_of_any_contributor_set_reconstruct_its_secret_sum(ceremony: Ceremony) -> None:
    seal = Seal.of(PARAMS)
    q = seal.primes_at(2)
    for contributors in (MEMBERS, MEMBERS[:7], MEMBERS[3::2]):
        indices = [MEMBERS.index(n) + 1 for n in MEMBERS[2:8]]
        total = np.zeros((2, PARAMS.poly_degree), dtype=np.uint64)
        for node in MEMBERS[2:8]:
            lambdas = [lagrange_at_zero(MEMBERS.index(node) + 1, indices, p) for p in q]
            total = add_mod(total, mul_scalar(ceremony.shares[node].shares_of(contributors, 2), lambdas, q), q)
        assert np.array_equal(total, secret_sum(ceremony, contributors)[:2])


def test_key_shares_reconstruct_the_secret_from_any_t_and_not_from_t_minus_one(ceremony: Ceremony) -> None:
    q = Seal.of(PARAMS).primes_at(len(PARAMS.data_bits))  # shares are dealt at the data primes
    secret = secret_sum(ceremony)[: len(q)]
    assert ceremony.shares[MEMBERS[0]].share.shape == secret.shape
    for subset in (MEMBERS[:T], MEMBERS[4:], MEMBERS[::2] + MEMBERS[1:2]):
        indices = [MEMBERS.index(n) + 1 for n in subset]
        total = np.zeros_like(secret)
        for node in subset:
            lambdas = [lagrange_at_zero(MEMBERS.index(node) + 1, indices, p) for p in q]
            total = add_mod(total, mul_scalar(ceremony.shares[node].share, lambdas, q), q)
        assert np.array_equal(total, secret)
    indices = [MEMBERS.index(n) + 1 for n in MEMBERS[: T - 1]]
    short = np.zeros_like(secret)
    for node in MEMBERS[: T - 1]:
        lambdas = [lagrange_at_zero(MEMBERS.index(node) + 1, indices, p) for p in q]
        short = add_mod(short, mul_scalar(ceremony.shares[node].share, lambdas, q), q)
    assert np.mean(short == secret) < 1e-3


def test_ciphertext_sum_equals_seals_homomorphic_addition(ceremony: Ceremony) -> None:
    seal = Seal.of(PARAMS)
    rnd = summed(ceremony.shares, {MEMBERS[0]: np.ones(100), MEMBERS[1]: np.full(100, 2.0)}, length=100, primes=2)
    a, b = (wire_form(PARAMS, c0) for c0 in rnd.ciphertexts.values())  # what the server receives: one prime
    c1 = uniform_mod(seal.primes_at(1), (1, 1, PARAMS.poly_degree))[0][None]  # SEAL's addition needs a c1
    scale = 2.0**40

    def load(c0: np.ndarray) -> sealapi.Ciphertext:
        data = CiphertextData(seal.levels[1], True, scale, np.stack([c0[0], c1[0]]))
        return seal.load(sealapi.Ciphertext, build_ciphertext(data, version=seal.version))

    ct_a, ct_b = load(a), load(b)
    seal.evaluator.add_inplace(ct_a, ct_b)
    assert np.array_equal(parse_ciphertext(seal.save(ct_a)).polys[0], rnd.total.total[0])
    assert np.array_equal(parse_ciphertext(seal.save(ct_a)).polys[1], add_mod(c1, c1, seal.primes_at(1))[0])


# ---- refusal rules -----------------------------------------------------------------------------------
def test_a_node_refuses_every_request_the_rules_forbid(ceremony: Ceremony, encrypted: Round) -> None:
    share = ceremony.shares[MEMBERS[0]]
    good = manifest(ceremony, encrypted, MEMBERS[:T], round_number=5)
    cases = {
        "few contributors": dataclasses.replace(good, contributors=MEMBERS[: T - 1]),
        "a contributor twice": dataclasses.replace(good, contributors=(*MEMBERS[: T - 1], MEMBERS[0])),
        "small subset": dataclasses.replace(good, subset=MEMBERS[: T - 1]),
        "not in subset": dataclasses.replace(good, subset=MEMBERS[1: T + 1]),
        "other key": dataclasses.replace(good, key_id="0" * 32),
        "unknown decryptor": dataclasses.replace(good, subset=(*MEMBERS[: T - 1], 12345)),
        "unknown contributor": dataclasses.replace(good, contributors=(*MEMBERS[1:], 12345)),
        "the key level": dataclasses.replace(good, primes=3),
        "an absurd length": dataclasses.replace(good, length=1 << 40),
        "a short nonce": dataclasses.replace(good, nonce=b"1234"),
    }
    tags = encrypted.tags(5)
    for name, bad in cases.items():
        with pytest.raises(SecureAggregationError):
            partial_decrypt(share, bad, set(), tags)
        print("refused:", name)
    asked: set[tuple[int, int]] = set()
    partial_decrypt(share, good, asked, tags)
    asked.add((good.round, good.group))
    with pytest.raises(SecureAggregationError, match="already decrypted"):
        partial_decrypt(share, good, asked, tags)  # the same aggregate again
    with pytest.raises(SecureAggregationError, match="already decrypted"):  # same round, other contributors
        partial_decrypt(share, dataclasses.replace(good, contributors=MEMBERS[:8]), asked, tags[:8])
    with pytest.raises(SecureAggregationError, match="already decrypted"):  # same round under another nonce
        partial_decrypt(share, dataclasses.replace(good, nonce=os.urandom(NONCE_BYTES)), asked, tags)


def test_combine_without_every_decryptor_reveals_nothing(ceremony: Ceremony, encrypted: Round) -> None:
    m = manifest(ceremony, encrypted, MEMBERS[:T])
    tags = encrypted.tags()
    partials = {n: partial_decrypt(ceremony.shares[n], m, set(), tags) for n in m.subset[:-1]}
    with pytest.raises(QuorumNotMetError):
        combine(PARAMS, encrypted.total.c0, partials, m)


def test_the_sum_refuses_malformed_ciphertexts_whole(ceremony: Ceremony) -> None:
    total = CiphertextSum(PARAMS, length=100, primes=2)
    level = summed(ceremony.shares, {MEMBERS[0]: np.ones(100)}, length=100, primes=2).ciphertexts[MEMBERS[0]]
    good = wire_form(PARAMS, level)
    unreduced = good.copy()
    unreduced[0, 0, 0] = np.uint64(2**64 - 1)
    for bad in (level, good[:, :, :-2], unreduced, good.astype(np.int64)):  # unrounded, short, unreduced, signed
        with pytest.raises(SecureAggregationError):
            total.add(1, bad)
    assert not total.contributors and not total.total.any()
    total.add(1, good)
    with pytest.raises(SecureAggregationError, match="already contributed"):
        total.add(1, good)


# ---- the ceremony ---------------------------------------------------------------------------------------
def test_a_reveal_that_does_not_match_its_commitment_is_refused() -> None:
    members = MEMBERS[:4]
    coordinator, parties = committed(members, 3)
    directory = coordinator.directory()
    reveal = parties[members[0]].reveal(directory)
    forged = Reveal(reveal.node, uniform_mod(Seal.of(PARAMS).primes, reveal.b.shape), reveal.bundles)
    with pytest.raises(SecureAggregationError, match="commitment"):
        coordinator.add_reveal(forged)
    others = {n: parties[n].reveal(directory) for n in members[1:]}
    reveals = {members[0]: forged.b, **{n: r.b for n, r in others.items()}}
    inbox = {s: r.bundles[members[1]] for s, r in [(members[0], reveal), *others.items()] if members[1] in r.bundles}
    with pytest.raises(SecureAggregationError, match="commitment"):
        parties[members[1]].finish(reveals, inbox)


def test_a_ceremony_where_one_member_never_reveals_still_yields_a_working_key() -> None:
    members = MEMBERS[:5]
    coordinator, parties = committed(members, 3)
    directory = coordinator.directory()
    for node in members[:-1]:  # the last member goes silent after committing
        coordinator.add_reveal(parties[node].reveal(directory))
    reveals, inbox = coordinator.finish_request()
    shares = {n: parties[n].finish(reveals, inbox[n]) for n in members[:-1]}
    assert coordinator.public_key is not None
    values = np.arange(50, dtype=np.float64) / 10
    rnd = summed(shares, {n: values for n in members[:3]}, length=50, primes=2)
    total, tags = rnd.total, rnd.tags()
    m = total.manifest(key_id=coordinator.key_id, round=1, group=0, nonce=rnd.nonce, subset=members[1:4])
    partials = {n: partial_decrypt(shares[n], m, set(), tags) for n in m.subset}
    assert np.max(np.abs(combine(PARAMS, total.c0, partials, m) - 3 * values)) < 1e-6
    with pytest.raises(SecureAggregationError, match="hold no share"):
        partial_decrypt(shares[members[0]], dataclasses.replace(m, subset=(*members[:2], members[-1])), set(), tags)


# ---- parameters --------------------------------------------------------------------------------------------
def test_parameter_sets_outside_128_bit_security_or_smudging_are_refused_with_every_problem() -> None:
    with pytest.raises(ConfigError) as info:
        CkksParams(poly_degree=8192, coeff_bits=(60, 60, 60, 60), smudging_bits=20)
    assert len(info.value.problems) == 2
    assert "218" in str(info.value) and "smudging" in str(info.value)
    with pytest.raises(ConfigError, match="precision"):
        CkksParams(scale_bits=70).check(threshold=6, contributors=10, value_bound=8.0)
    with pytest.raises(ConfigError, match="cannot hold"):
        CkksParams(scale_bits=118).check(threshold=6, contributors=10, value_bound=8.0)
    PARAMS.check(threshold=6, contributors=10, value_bound=8.0)


def test_the_scale_is_fitted_to_the_ceremonys_size_and_a_fitted_key_meets_its_precision() -> None:
    """The flooding noise grows with the holders: 100 holders (t = 60) need 2^102 for the default
    1e-5 target, which the default 2^100 misses; small ceremonies keep the default. A fitted set
    decrypts a real sum within its target."""
    with pytest.raises(ConfigError, match="predicted error"):
        PARAMS.check(threshold=60, contributors=100, value_bound=8.0)
    fitted = PARAMS.fitted(threshold=60, contributors=100)
    assert fitted.scale_bits == 102 and fitted.send_primes(60, 100, 8.0) == 2  # no more bytes on the wire
    fitted.check(threshold=60, contributors=100, value_bound=8.0)
    assert PARAMS.fitted(threshold=6, contributors=10) is PARAMS
    with pytest.raises(ConfigError, match="cannot hold"):  # 300 holders need more than two primes hold
        PARAMS.fitted(threshold=180, contributors=300).check(threshold=180, contributors=300, value_bound=8.0)

    tight = dataclasses.replace(PARAMS, precision=1e-9)  # a target the default scale misses even for 3 holders
    params = tight.fitted(threshold=2, contributors=3)
    assert params.scale_bits > PARAMS.scale_bits
    params.check(threshold=2, contributors=3, value_bound=8.0)
    assert _two_of_three_error(params) <= params.precision


def _two_of_three_error(params: CkksParams) -> float:
    """A 2-of-3 ceremony under ``params``, three members' sum at two primes decrypted by two: the
    largest error against the plain sum."""
    ceremony = run_ceremony(MEMBERS[:3], 2, params)
    values = np.linspace(-1, 1, 300)
    rnd = summed(ceremony.shares, {n: values for n in MEMBERS[:3]}, length=300, primes=2, params=params)
    total, tags = rnd.total, rnd.tags()
    m = total.manifest(key_id=ceremony.key_id, round=1, group=0, nonce=rnd.nonce, subset=MEMBERS[:2])
    partials = {n: partial_decrypt(ceremony.shares[n], m, set(), tags) for n in m.subset}
    return float(np.max(np.abs(combine(params, total.c0, partials, m) - 3 * values)))


def test_updates_and_partial_decryptions_travel_one_prime_lighter_and_the_rounding_stays_in_budget(
    ceremony: Ceremony, encrypted: Round
) -> None:
    """At the default parameters what travels is divided by the last prime and rounded: half the
    bytes of two primes. The decrypted sum through the wire form matches the one computed at two
    primes to well below a tenth of the precision target; a parameter set whose scale would leave
    too little after the division keeps its primes."""
    seal = Seal.of(PARAMS)
    assert PARAMS.wire_primes(2) == 1 and encrypted.total.shape[1] == 1
    c0 = next(iter(encrypted.ciphertexts.values()))
    assert wire_form(PARAMS, c0).nbytes * 2 == c0.nbytes
    m = manifest(ceremony, encrypted, MEMBERS[:T])
    partials = {n: partial_decrypt(ceremony.shares[n], m, set(), encrypted.tags()) for n in m.subset}
    assert all(p.shape[1] == 1 for p in partials.values())
    through_wire = combine(PARAMS, encrypted.total.c0, partials, m)
    at_level = encrypted.level_sum()
    for node in m.subset:  # the same flooding, unrounded: the partials' level-2 values are not kept, so
        at_level = add_mod(at_level, _unflooded(ceremony.shares[node], m), seal.primes_at(2))  # compare unflooded
    unrounded = seal.decode(at_level, LENGTH)
    reference = np.sum(np.stack(list(encrypted.values.values())), axis=0)
    assert np.max(np.abs(unrounded - reference)) < 1e-9
    assert np.max(np.abs(through_wire - reference)) <= 6 * PARAMS.error_std(T, len(MEMBERS))
    coarse = dataclasses.replace(PARAMS, scale_bits=80)  # Δ/q = 2^20 would round too coarsely
    assert coarse.wire_primes(2) == 2 and PARAMS.wire_primes(3) == 3  # and the key level never travels


def test_a_longer_chain_is_switched_down_to_the_primes_the_sum_needs() -> None:
    params = CkksParams(poly_degree=16384, coeff_bits=(60, 60, 60, 60, 60))
    assert params.send_primes(6, 10, 8.0) == 2
    assert _two_of_three_error(params) < 1e-6


# ---- streams and arithmetic ----------------------------------------------------------------------------------
def _uncompressed(raw: bytes) -> bytes:
    magic, size, major, minor, _, reserved, _ = struct.unpack_from("<HBBBBHQ", raw)
    body = zstandard.ZstdDecompressor().decompress(raw[16:], max_output_size=1 << 30)
    return struct.pack("<HBBBBHQ", magic, size, major, minor, 0, reserved, 16 + len(body)) + body


def test_streams_round_trip_bit_for_bit(ceremony: Ceremony) -> None:
    seal = Seal.of(PARAMS)
    secret, _ = seal.new_secret()
    ct = sealapi.Ciphertext(seal.context)
    sealapi.Encryptor(seal.context, secret).encrypt_zero_symmetric(ct)
    plain = sealapi.Plaintext()
    seal.encoder.encode([0.5] * 10, list(seal.levels[2]), 2.0**40, plain)
    for obj, parse, build in (
        (ct, parse_ciphertext, build_ciphertext),
        (seal.load(sealapi.PublicKey, ceremony.public_key), parse_ciphertext, build_ciphertext),
        (secret, lambda raw: parse_plaintext(raw, degree=8192), build_plaintext),
        (plain, lambda raw: parse_plaintext(raw, degree=8192), build_plaintext),
    ):
        raw = seal.save(obj)
        rebuilt = build(parse(raw), version=seal.version)
        assert rebuilt == _uncompressed(raw)
        assert seal.save(seal.load(type(obj), rebuilt)) is not None
        assert build(parse(rebuilt), version=seal.version) == rebuilt


def test_streams_refuse_truncated_or_foreign_bytes(ceremony: Ceremony) -> None:
    for bad in (b"", b"\x00" * 40, ceremony.public_key[:-8], b"\xa1\x5e" + ceremony.public_key[2:]):
        with pytest.raises(SecureAggregationError):
            parse_ciphertext(bad)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, Seal.of(PARAMS).primes[0] - 1), st.integers(0, 2**40 - 1))
def test_mul_small_matches_python_integers(a: int, k: int) -> None:
    q = Seal.of(PARAMS).primes[0]
    values = np.array([a, q - 1, 0, a // 3], dtype=np.uint64)
    expected = [(int(v) * k) % q for v in values]
    assert mul_small(values, k, q).tolist() == expected


def test_shamir_shares_of_a_residue_array_interpolate_back() -> None:
    primes = Seal.of(PARAMS).primes
    secret = uniform_mod(primes, (len(primes), 64))
    shares = shamir_shares(secret, [1, 2, 3, 4, 5], 3, primes)
    indices = [2, 4, 5]
    total = np.zeros_like(secret)
    for x in indices:
        lambdas = [lagrange_at_zero(x, indices, q) for q in primes]
        total = add_mod(total, mul_scalar(shares[x - 1], lambdas, primes), primes)
    assert np.array_equal(total, secret)


def test_flooding_noise_is_centred_in_its_bound() -> None:
    primes = Seal.of(PARAMS).primes[:2]
    noise = flooding_noise(63, primes, (2, 2, 8192))
    q0, q1 = primes
    big = q0 * q1
    inverse = pow(q0, -1, q1)
    # lift the residue pair back to one integer by CRT, then to (−Q/2, Q/2)
    lifted = [
        r0 + q0 * (((r1 - r0) * inverse) % q1)
        for r0, r1 in zip(noise[:, 0].ravel().tolist(), noise[:, 1].ravel().tolist(), strict=True)
    ]
    signed = np.array([v - big if v > big // 2 else v for v in lifted], dtype=object)
    assert all(-(2**63) <= v < 2**63 for v in signed)
    spread = np.std(signed.astype(float))
    assert abs(spread / (2**63 / np.sqrt(3)) - 1) < 0.05


def _scratch_names(pid: int) -> list[str]:
    root = seal_module._scratch_root() or tempfile.gettempdir()
    return [n for n in os.listdir(root) if n.startswith(f"{SCRATCH_PREFIX}{pid}-")]


@pytest.mark.skipif(not seal_module._MEMFD, reason="memfd_create is Linux-only")
def test_seal_objects_pass_through_anonymous_files_emptied_after_a_secret() -> None:
    seal = Seal.of(PARAMS)
    secret, residues = seal.new_secret()  # a secret key's round trip: SEAL saves it, we read it
    channel = seal_module._channel()
    assert channel is not None
    for fd in (channel.load_fd, channel.save_fd):  # anonymous: no name in any directory
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:quorumfl-ckks-")
    assert os.fstat(channel.save_fd).st_size == 0  # the secret's stream is gone once read
    seal.to_ntt(seal.encode_coefficients(np.linspace(-1.0, 1.0, 100), 2))  # a ciphertext stays until overwritten
    assert os.fstat(channel.load_fd).st_size > 0
    again = seal.secret_from(residues)  # and back: we write it, SEAL loads it
    assert os.fstat(channel.load_fd).st_size == 0
    assert seal.save(again, secret=True) == seal.save(secret, secret=True)
    assert not _scratch_names(os.getpid())


@pytest.mark.skipif(not seal_module._MEMFD, reason="memfd_create is Linux-only")
def test_a_forked_process_and_another_thread_get_their_own_anonymous_files() -> None:
    """A forked ClientApp task inherits its parent's descriptors: writing through them would change
    the parent's file under it. The child and every thread make their own."""
    seal = Seal.of(PARAMS)
    values = np.linspace(-1.0, 1.0, 100)
    expected = seal.to_ntt(seal.encode_coefficients(values, 2))
    parent = seal_module._channel()
    assert parent is not None
    before = os.pread(parent.load_fd, os.fstat(parent.load_fd).st_size, 0)
    files = {os.fstat(fd).st_ino for fd in (parent.load_fd, parent.save_fd)}
    child = os.fork()
    if child == 0:
        code = 1
        try:
            seal.to_ntt(seal.encode_coefficients(np.linspace(-5.0, 5.0, 3 * PARAMS.poly_degree), 2))
            mine = seal_module._channel()
            own = mine is not None and mine.pid == os.getpid() and not files & {
                os.fstat(mine.load_fd).st_ino, os.fstat(mine.save_fd).st_ino}
            code = 0 if own else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.pread(parent.load_fd, os.fstat(parent.load_fd).st_size, 0) == before
    assert np.array_equal(seal.to_ntt(seal.encode_coefficients(values, 2)), expected)

    def anonymous() -> set[int]:
        names = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in map(int, os.listdir("/proc/self/fd"))
                 if os.path.exists(f"/proc/self/fd/{fd}")}
        return {os.fstat(fd).st_ino for fd, name in names.items() if name.startswith("/memfd:quorumfl-ckks-")}

    before_thread = anonymous()
    seen: list[set[int]] = []

    def use() -> None:
        channel = seal_module._channel()
        assert channel is not None
        seal.to_ntt(seal.encode_coefficients(values, 2))
        seen.append({os.fstat(channel.load_fd).st_ino, os.fstat(channel.save_fd).st_ino})

    thread = threading.Thread(target=use)
    thread.start()
    thread.join()
    assert len(seen) == 1 and len(seen[0]) == 2 and not files & seen[0]  # the thread had its own
    gc.collect()
    assert anonymous() == before_thread  # and they were closed when it ended


def test_without_memfd_objects_pass_through_private_files_that_do_not_outlive_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(seal_module, "_MEMFD", False)
    seal = Seal.of(PARAMS)
    created: list[str] = []
    mkstemp = tempfile.mkstemp

    def watched(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, path = mkstemp(*args, **kwargs)
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        created.append(path)
        return fd, path

    monkeypatch.setattr(seal_module.tempfile, "mkstemp", watched)
    secret, residues = seal.new_secret()  # a secret key's round trip: SEAL saves it, we read it
    seal.secret_from(residues)  # and back: we write it, SEAL loads it
    assert len(created) >= 2 and not [p for p in created if os.path.exists(p)]
    assert all(os.path.basename(p).startswith(f"{SCRATCH_PREFIX}{os.getpid()}-") for p in created)
    fd, path = mkstemp(dir=os.path.dirname(created[0]))  # SEAL writes into the private file it is given
    os.close(fd)
    try:
        secret.save(path)
        assert os.path.getsize(path) > 0 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        os.remove(path)


def test_a_task_that_ends_with_os_exit_leaves_no_scratch_files() -> None:
    """A forked ClientApp task ends with ``os._exit`` (no finalisers): a context it built and used
    must leave nothing in the scratch directory."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            own = Seal(PARAMS)  # not the parent's cached context: one this process builds
            own.to_ntt(own.encode_coefficients(np.linspace(-1.0, 1.0, 100), 2))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not _scratch_names(child)


def test_in_place_modular_addition_equals_the_plain_one() -> None:
    primes = Seal.of(PARAMS).primes[:2]
    a = np.stack([uniform_mod(primes, (2, 257)) for _ in range(3)])
    b = np.stack([uniform_mod(primes, (2, 257)) for _ in range(3)])
    expected = [[[(int(x) + int(y)) % q for x, y in zip(ra, rb, strict=True)] for ra, rb, q in zip(ca, cb, primes, strict=True)]
                for ca, cb in zip(a, b, strict=True)]
    add_mod_into(a, b, primes)
    assert a.tolist() == expected


# ---- residues on the wire -------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**60 - 1), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_packed_residues_are_the_pairs_as_120_bit_little_endian_integers(values: list[int]) -> None:
    residues = np.array(values, dtype=np.uint64)
    packed = pack_residues(residues)
    reference = b"".join((a + (b << 60)).to_bytes(15, "little") for a, b in zip(values[::2], values[1::2], strict=True))
    assert packed.tobytes() == reference
    assert unpack_residues(packed).tolist() == values


def test_ciphertexts_travel_at_15_16_of_their_size_and_come_back_bit_for_bit(encrypted: Round) -> None:
    polys = next(iter(encrypted.ciphertexts.values()))
    packed = pack_residues(polys)
    assert packed.nbytes * 16 == polys.nbytes * 15
    assert np.array_equal(unpack_residues(packed), polys)


def test_packing_refuses_unreduced_residues_and_unpacking_refuses_partial_pairs() -> None:
    with pytest.raises(SecureAggregationError, match="more than 60 bits"):
        pack_residues(np.array([0, 2**60], dtype=np.uint64))
    with pytest.raises(SecureAggregationError, match="even last axis"):
        pack_residues(np.zeros(3, dtype=np.uint64))
    with pytest.raises(SecureAggregationError, match="multiples of 15"):
        unpack_residues(np.zeros(16, dtype=np.uint8))


def test_one_ciphertext_carries_n_values_two_per_complex_slot(ceremony: Ceremony) -> None:
    values = np.linspace(-1.0, 1.0, PARAMS.poly_degree)
    primes = PARAMS.send_primes(T, len(MEMBERS), 8.0)
    rnd = summed(ceremony.shares, {MEMBERS[0]: values}, length=values.shape[0], primes=primes)
    polys = rnd.ciphertexts[MEMBERS[0]]
    assert polys.shape[0] == 1
    seal = Seal.of(PARAMS)
    decrypted = seal.decrypt_reference(seal.secret_from(secret_sum(ceremony, MEMBERS[:1])), polys,
                                       rnd.c1(ceremony.key_id), values.shape[0])
    assert np.max(np.abs(decrypted - values)) < 1e-6


def _seals_encoding(values: np.ndarray, primes: int) -> np.ndarray:
    """SEAL's own CKKSEncoder, chunk by chunk, brought back to the coefficient domain."""
    seal = Seal.of(PARAMS)
    parms = seal.levels[primes]
    slots, per = PARAMS.slots, PARAMS.values_per_ciphertext
    padded = np.zeros(PARAMS.chunks(values.shape[0]) * per)
    padded[: values.shape[0]] = values
    out = []
    for c in range(padded.shape[0] // per):
        piece = padded[c * per: (c + 1) * per]
        plain = sealapi.Plaintext()
        seal.encoder.encode((piece[:slots] + 1j * piece[slots:]).tolist(), list(parms), 2.0**PARAMS.scale_bits, plain)
        ntt = parse_plaintext(seal.save(plain), degree=PARAMS.poly_degree).coeffs
        ct = seal.load(sealapi.Ciphertext, build_ciphertext(CiphertextData(parms, True, 1.0, np.stack([ntt, np.ones_like(ntt)])),
                                                            version=seal.version))
        seal.evaluator.transform_from_ntt_inplace(ct)
        out.append(parse_ciphertext(seal.save(ct)).polys[0])
    return np.stack(out)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(-8.0, 8.0, allow_nan=False), min_size=1, max_size=20000), st.integers(0, 3))
def test_the_numpy_encoder_is_seals_encoder(values: list[float], exponent: int) -> None:
    """``encode_coefficients`` against SEAL's CKKSEncoder: the same coefficients to within float64's
    precision (both FFTs run in double: at Δ = 2^100 a coefficient's last bit is 2^35 or more, so they
    differ by a few of those), and SEAL's decoder reads the values back."""
    seal = Seal.of(PARAMS)
    x = np.asarray(values) * 10.0**-exponent
    ours = seal.encode_coefficients(x, 2)
    reference = _seals_encoding(x, 2)
    q = np.asarray(seal.primes_at(2), dtype=np.uint64)[:, None]
    apart = np.minimum((ours - reference) % q, (reference - ours) % q)
    largest = max(float(np.max(np.abs(x))), 1e-300) * 2.0**PARAMS.scale_bits / PARAMS.poly_degree
    assert float(apart.max()) <= largest * 2.0**-40  # a wrong slot order or sign would be off by ~largest
    assert np.max(np.abs(seal.decode(seal.to_ntt(ours), x.shape[0]) - x)) < 1e-9


def test_the_numpy_encoder_refuses_values_its_scale_cannot_hold() -> None:
    with pytest.raises(SecureAggregationError, match="too large to encode"):
        Seal.of(PARAMS).encode_coefficients(np.full(10, 2.0**20), 2)


def test_blocked_modular_addition_over_many_cache_blocks_equals_the_plain_one() -> None:
    primes = Seal.of(PARAMS).primes[:2]
    acc = np.stack([uniform_mod(primes, (2, 8192)) for _ in range(11)])  # 11 rows: blocks of 4 and a partial one
    acc[0, 0, 0], acc[0, 1, 1] = primes[0] - 1, primes[1] - 1
    b = np.stack([uniform_mod(primes, (2, 8192)) for _ in range(11)])
    b[0, 0, 0], b[0, 1, 1] = primes[0] - 1, 1  # the largest sum, and one that lands exactly on q
    expected = add_mod(acc, b, primes)
    add_mod_into(acc, b, primes)
    assert np.array_equal(acc, expected)
    assert acc[0, 1, 1] == 0


def test_reduced_finds_one_residue_at_or_above_its_prime() -> None:
    primes = Seal.of(PARAMS).primes[:2]
    a = np.stack([uniform_mod(primes, (2, 64)) for _ in range(3)])
    assert reduced(a, primes)
    a[2, 1, 63] = primes[1]
    assert not reduced(a, primes)


@pytest.mark.parametrize(("subtract", "rescale"), [(True, True), (False, True), (True, False), (False, False)])
def test_one_pass_of_ntt_product_and_rescale_equals_the_steps_one_after_the_other(subtract: bool, rescale: bool) -> None:
    """``ntt_with_product`` (what an encryption and a partial decryption now run) against ``to_ntt``,
    ``multiply``, numpy's modular difference or sum and ``rescale`` called one by one, on 31 polynomials
    (three batches, the last one short), zero coefficients included."""
    seal = Seal.of(PARAMS)
    primes = seal.primes_at(2)
    q = np.asarray(primes, dtype=np.uint64)[:, None]
    rng = np.random.default_rng(7)
    coeffs = (rng.integers(0, 2**63, size=(31, 2, PARAMS.poly_degree), dtype=np.uint64) % q)
    coeffs[3] = 0
    polys = uniform_mod(primes, (2, 31, PARAMS.poly_degree)).transpose(1, 0, 2).copy()
    plain = uniform_mod(primes, (2, PARAMS.poly_degree))
    product = seal.multiply(polys, plain)
    ntt = seal.to_ntt(coeffs)
    steps = (ntt + (q - product)) % q if subtract else (ntt + product) % q
    if rescale:
        steps = seal.rescale(steps)
    fused = seal.ntt_with_product(coeffs, polys, plain, subtract=subtract, rescale=rescale)
    assert fused.shape == steps.shape and np.array_equal(fused, steps)


_INTEGER_FLOATS = st.one_of(
    st.integers(-(2**53), 2**53).map(float),  # small ones, every bit set where a float allows
    st.builds(lambda m, e: float(m) * 2.0**e, st.integers(-(2**53) + 1, 2**53 - 1), st.integers(0, 50)),
    st.sampled_from([0.0, -0.0, 2.0**63, -(2.0**63), 2.0**64, -(2.0**64), 2.0**104 - 2.0**51, -(2.0**104 - 2.0**51)]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_INTEGER_FLOATS, min_size=1, max_size=300),
       st.lists(st.sampled_from([1048573, 8589934609, 35184372088777, 2305843009213693951]), max_size=2))
def test_residues_of_integers_are_pythons_exact_residues(values: list[float], others: list[int]) -> None:
    """Each residue against Python's exact integers, for integers anywhere below 2^104 in magnitude
    (both signs, −0.0, the split points 2^63 and 2^64, the largest), modulo SEAL's 60-bit primes and
    small and mid-sized ones."""
    primes = [*Seal.of(PARAMS).primes[:2], *others]
    v = np.asarray(values, dtype=np.float64).reshape(1, -1)
    out = np.empty((1, len(primes), v.shape[1]), dtype=np.uint64)
    residues_of_integers(v, primes, out)
    for j, q in enumerate(primes):
        assert [int(r) for r in out[0, j]] == [int(x) % q for x in values]


@pytest.mark.parametrize("scale", [2.0**52, 2.0**63, 2.0**80, 2.0**103])
def test_residues_of_many_integers_are_exact_where_the_quotient_estimate_is_coarsest(scale: float) -> None:
    """Thousands of integers of one size against Python's residues: a 20-bit prime makes the float
    quotient largest (its estimate is off by up to 2^−7, so the floor would land one too high
    without the bias), SEAL's primes and a 45-bit one the common case."""
    primes = [1048573, 35184372088777, *Seal.of(PARAMS).primes[:2]]
    v = np.round(np.random.default_rng(7).uniform(-1.0, 1.0, (2, 4096)) * scale)
    out = np.empty((2, len(primes), 4096), dtype=np.uint64)
    residues_of_integers(v, primes, out)
    for j, q in enumerate(primes):
        assert [[int(r) for r in row] for row in out[:, j]] == [[int(x) % q for x in row] for row in v]


def test_residues_of_integers_refuse_what_they_cannot_reduce_exactly() -> None:
    primes = Seal.of(PARAMS).primes[:2]
    out = np.empty((1, 2, 2), dtype=np.uint64)
    with pytest.raises(SecureAggregationError, match="passes 2\\^104"):
        residues_of_integers(np.array([[1.0, -(2.0**104)]]), primes, out)
    with pytest.raises(ValueError, match="between 2\\^19 and 2\\^61"):
        residues_of_integers(np.array([[1.0, 2.0]]), [65521, primes[0]], out)


@pytest.mark.parametrize("bits", [33, 50, 67, 81, 94])
def test_flooding_noise_residues_are_those_of_the_integers_its_bytes_spell(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each residue against Python's exact integers: h·2^32 + l from the drawn bytes (h the masked
    first word shifted to be signed, l the 32-bit tail), reduced modulo SEAL's 60-bit primes and
    modulo a 20-bit and a 33-bit prime (the small-prime branches), at every supported size."""
    import quorumfl.aggregation.ckks.rns as rns

    count = 4096
    raw = os.urandom(12 * count)
    raw = bytes(8) + b"\xff" * 8 + raw[16:]  # the most negative and the largest h among the draws
    monkeypatch.setattr(rns, "random_bytes", lambda n: raw[:n])
    primes = [*Seal.of(PARAMS).primes[:2], 1048573, 8589934609]
    noise = flooding_noise(bits, primes, (2, len(primes), count // 2))
    high = bits - 32
    for i in range(count):
        h = (int.from_bytes(raw[8 * i: 8 * i + 8], "little") & ((1 << (high + 1)) - 1)) - (1 << high)
        low = int.from_bytes(raw[8 * count + 4 * i: 8 * count + 4 * i + 4], "little")
        value = h * 2**32 + low
        assert -(2**bits) <= value < 2**bits
        for j, q in enumerate(primes):
            assert int(noise[i // (count // 2), j, i % (count // 2)]) == value % q


def test_small_noise_residues_are_those_of_the_centred_binomials_its_bytes_spell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each residue against Python's integers: e = popcount(low 21 bits) − popcount(bits 32..52) of
    each drawn word, reduced modulo SEAL's 60-bit primes and a 20-bit one; the extremes ±21 drawn."""
    import quorumfl.aggregation.ckks.rns as rns

    count = 4096
    raw = bytearray(os.urandom(8 * count))
    raw[0:8] = ((1 << 21) - 1).to_bytes(8, "little")  # e = 21
    raw[8:16] = (((1 << 21) - 1) << 32).to_bytes(8, "little")  # e = −21
    raw[16:24] = bytes(8)  # e = 0
    monkeypatch.setattr(rns, "random_bytes", lambda n: bytes(raw[:n]))
    primes = [*Seal.of(PARAMS).primes[:2], 1048573]
    noise = small_noise(primes, (2, len(primes), count // 2))
    assert noise.dtype == np.uint64 and noise.flags.c_contiguous
    seen = set()
    for i in range(count):
        word = int.from_bytes(raw[8 * i: 8 * i + 8], "little")
        e = bin(word & (2**21 - 1)).count("1") - bin((word >> 32) & (2**21 - 1)).count("1")
        seen.add(e)
        for j, q in enumerate(primes):
            assert int(noise[i // (count // 2), j, i % (count // 2)]) == e % q
    assert {21, -21, 0} <= seen


def _rejection_reference(q: int, count: int, draw: Callable[[int], bytes]) -> list[int]:
    """The rejection sampler word by word, in Python: masked words below q, in stream order, from
    draws of 8·(still needed + 64) bytes."""
    mask, out = (1 << q.bit_length()) - 1, []
    while len(out) < count:
        raw = draw(8 * (count - len(out) + 64))
        words = [int.from_bytes(raw[i: i + 8], "little") & mask for i in range(0, len(raw), 8)]
        out += [w for w in words if w < q][: count - len(out)]
    return out


def _stream(seed: bytes) -> Callable[[int], bytes]:
    state = {"at": 0}

    def draw(n: int) -> bytes:
        out = b"".join(hashlib.sha256(seed + i.to_bytes(8, "big")).digest()
                       for i in range(state["at"] // 32, (state["at"] + n + 31) // 32 + 1))
        skip = state["at"] % 32
        state["at"] += n
        return out[skip: skip + n]
    return draw


@settings(max_examples=40, deadline=None)
@given(count=st.integers(0, 300), seed=st.binary(min_size=1, max_size=8),
       q=st.sampled_from([(1 << 20) + 7, (1 << 33) + 9, (1 << 61) - 1, 1152921504606748673]))
def test_uniform_residues_are_the_rejection_samplers_word_for_word(count: int, seed: bytes, q: int) -> None:
    """Every party derives the round's c1 from one stream: the sampler must keep exactly the words the
    plain rejection loop keeps, whether none is rejected (a 60-bit SEAL prime) or about half (2^20 + 7)."""
    got = uniform_below(q, count, _stream(seed))
    assert got.dtype == np.uint64 and got.shape == (count,)
    assert [int(v) for v in got] == _rejection_reference(q, count, _stream(seed))


def test_the_common_c1_is_each_primes_stream_laid_out_chunk_by_chunk() -> None:
    """c1[c, j] is chunk c of prime j's own AES-CTR stream (the layout every party must share)."""
    primes, chunks, degree, nonce = Seal.of(PARAMS).primes[:2], 3, 64, bytes(range(NONCE_BYTES))
    c1 = common_c1("k" * 32, round_number=4, group=1, nonce=nonce, primes=primes, chunks=chunks, degree=degree)
    label = b"quorumfl/ckks/common-c1" + field_bytes(("k" * 32).encode()) + (4).to_bytes(8, "big", signed=True) \
        + (1).to_bytes(4, "big", signed=True) + nonce
    key = hashlib.sha256(label).digest()
    assert c1.shape == (chunks, len(primes), degree) and c1.flags.c_contiguous
    for j, q in enumerate(primes):
        keystream = Cipher(algorithms.AES(key), modes.CTR(j.to_bytes(16, "big"))).encryptor()
        row = _rejection_reference(q, chunks * degree, lambda n, ks=keystream: ks.update(bytes(n)))
        assert [int(v) for v in c1[:, j, :].ravel()] == row

