"""A lying server against the node's CKKS handlers: ceremony and manifest as the admin signed them.

Through the real ClientApp handlers (``quorumfl.client.ckks.commit``, ``reveal``, ``finish`` and
``decrypt``, with Flower records and each node's key store), the server announces a ceremony with
fewer members or a lower t than the signed ``secagg-threshold`` gives, a t below the signed
``secagg-min-group``, other parameters than the signed ring dimension, more members than the
roster, or tells one member another seed; and it asks for a decryption whose manifest states
another length or level than the contributors signed, or a contributor set other than the signed
records it sends. Each is refused with the reason, while an
honest ceremony and round through the same handlers decrypt to numpy's sum.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Context, Message, RecordDict

from quorumfl.aggregation.ckks import (
    Announcement,
    CeremonyCoordinator,
    CiphertextSum,
    CkksParams,
    combine,
    contribute,
    encrypt_vector,
    wire_form,
)
from quorumfl.aggregation.ckks.threshold import NONCE_BYTES
from quorumfl.aggregation.secagg.identity import sign
from quorumfl.client import ckks
from quorumfl.errors import SecureAggregationError
from quorumfl.protocol.ckks_wire import (
    ARRAYS,
    CKKS,
    COMMIT,
    DECRYPT,
    FINISH,
    REVEAL,
    decode_commitment,
    decode_partial,
    decode_reveal,
    encode_announcement,
    encode_decrypt_request,
    encode_directory,
    encode_finish,
)

from .signed_harness import department_contexts, roster_json

NODES = tuple(2**61 + 4099 * i for i in range(5))
NAMES = ("tax-office", "urban-planning", "public-works", "parks", "libraries")
KEYS = {name: ec.generate_private_key(ec.SECP384R1()) for name in NAMES}
ROSTER_JSON = roster_json(KEYS)
SIGNED = {"secure-aggregation": "ckks", "secagg-threshold": 0.6, "secagg-min-group": 0, "ckks-poly-degree": 8192,
          "ckks-min-threshold": 0,
          "ckks-max-decryptions": 100, "roster": ROSTER_JSON}
T = 3  # 0.6 of 5
LENGTH = 3000


def _params(t: int, n: int) -> CkksParams:
    return CkksParams(poly_degree=8192).fitted(threshold=t, contributors=n)


@pytest.fixture
def contexts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[int, Context]:
    return department_contexts(tmp_path, monkeypatch, NODES, KEYS, SIGNED, key_store=True)


def _call(handler, kind: str, node: int, context: Context, content: RecordDict) -> RecordDict:  # type: ignore[no-untyped-def]
    return handler(Message(content, dst_node_id=node, message_type=kind), context)  # type: ignore[no-any-return]


def _commit(contexts: dict[int, Context], told: dict[int, Announcement]) -> CeremonyCoordinator:
    coordinator = CeremonyCoordinator(told[NODES[-1]])
    for node, announcement in told.items():
        reply = _call(ckks.commit, COMMIT, node, contexts[node],
                      RecordDict({CKKS: encode_announcement(announcement, run_id=7)}))
        coordinator.add_commitment(decode_commitment(reply.config_records[CKKS], node=node,
                                                     ceremony=announcement.ceremony))
    return coordinator


@pytest.mark.parametrize(("members", "threshold", "params", "named"), [
    (NODES, 3, CkksParams(poly_degree=16384).fitted(threshold=3, contributors=5), "parameters"),
    (NODES, 3, dataclasses.replace(_params(3, 5), smudging_bits=41), "parameters"),
    ((*NODES, 2**63 + 1), 4, _params(4, 6), "6 nodes (the signed roster has 5 departments)"),
])
def test_a_ceremony_weaker_than_the_signed_run_is_refused(
        contexts: dict[int, Context], members: tuple[int, ...], threshold: int, params: CkksParams,
        named: str) -> None:
    announcement = Announcement.new(members, threshold, params)
    node = NODES[0]
    content = RecordDict({CKKS: encode_announcement(announcement, run_id=7)})
    with pytest.raises(SecureAggregationError, match="admin-signed run config does not allow") as refused:
        _call(ckks.commit, COMMIT, node, contexts[node], content)
    assert named in str(refused.value)


def test_a_ceremony_below_the_signed_minimum_group_is_refused(contexts: dict[int, Context]) -> None:
    """Signed threshold 0.9 over five departments (t = 5): the server announces 3 of 5, or a ceremony of
    3 members with t = 2 or 3, which would let fewer colluders decrypt: refused. A smaller ceremony
    keeps the whole roster's t (or the signed ckks-min-threshold), and t never goes below the
    signed minimum group."""
    for context in contexts.values():
        context.run_config.update({"secagg-threshold": 0.9, "secagg-min-group": 4})
    node = NODES[0]
    for members, t, named in ((NODES, 3, "threshold 3 (signed: 5 for 5 members of a 5-department roster)"),
                              (NODES[:3], 2, "threshold 2 (signed: 5 for 3 members of a 5-department roster)"),
                              (NODES[:3], 3, "threshold 3 (signed: 5 for 3 members")):
        announcement = Announcement.new(members, t, _params(t, len(members)))
        content = RecordDict({CKKS: encode_announcement(announcement, run_id=7)})
        with pytest.raises(SecureAggregationError, match="does not allow") as refused:
            _call(ckks.commit, COMMIT, node, contexts[node], content)
        assert named in str(refused.value)
    for context in contexts.values():  # the admin allows ceremonies of 3 with t = 3, but groups of 4
        context.run_config.update({"ckks-min-threshold": 3})
    announcement = Announcement.new(NODES[:3], 3, _params(3, 3))
    with pytest.raises(SecureAggregationError, match="below the signed secagg-min-group 4"):
        _call(ckks.commit, COMMIT, node, contexts[node], RecordDict({CKKS: encode_announcement(announcement, run_id=7)}))


def test_a_smaller_ceremony_keeps_the_whole_rosters_t(contexts: dict[int, Context]) -> None:
    """0.6 of the 5-department roster is 3: four members may hold the key with t = 3, three members
    only with t = 3 as well (not 0.6 of 3 = 2)."""
    node = NODES[0]
    for members, t in ((NODES[:4], 3), (NODES[:3], 3)):
        announcement = Announcement.new(members, t, _params(t, len(members)))
        _call(ckks.commit, COMMIT, node, contexts[node], RecordDict({CKKS: encode_announcement(announcement, run_id=7)}))
    announcement = Announcement.new(NODES[:3], 2, _params(2, 3))
    with pytest.raises(SecureAggregationError, match="threshold 2 \\(signed: 3 for 3 members"):
        _call(ckks.commit, COMMIT, node, contexts[node], RecordDict({CKKS: encode_announcement(announcement, run_id=7)}))


def test_a_member_told_another_seed_is_refused_by_the_others(contexts: dict[int, Context]) -> None:
    honest = Announcement.new(NODES, T, _params(T, 5))
    told = dict.fromkeys(NODES, honest)
    told[NODES[0]] = dataclasses.replace(honest, seed=os.urandom(32))  # each passes the check on its own
    coordinator = _commit(contexts, told)
    directory = RecordDict({CKKS: encode_directory(honest.ceremony, coordinator.directory())})
    with pytest.raises(SecureAggregationError, match="'tax-office' is not signed by its registered key"):
        _call(ckks.reveal, REVEAL, NODES[1], contexts[NODES[1]], directory)


def _ceremony(contexts: dict[int, Context]) -> CeremonyCoordinator:
    """An honest ceremony through the handlers: commit, reveal, finish."""
    announcement = Announcement.new(NODES, T, _params(T, 5))
    coordinator = _commit(contexts, dict.fromkeys(NODES, announcement))
    directory = RecordDict({CKKS: encode_directory(announcement.ceremony, coordinator.directory())})
    for node in NODES:
        reply = _call(ckks.reveal, REVEAL, node, contexts[node], directory)
        coordinator.add_reveal(decode_reveal(reply.config_records[CKKS], reply.array_records[ARRAYS], node=node,
                                             ceremony=announcement.ceremony))
    reveals, inbox = coordinator.finish_request()
    for node in NODES:
        config, arrays = encode_finish(announcement.ceremony, reveals, inbox[node])
        _call(ckks.finish, FINISH, node, contexts[node], RecordDict({CKKS: config, ARRAYS: arrays}))
    return coordinator


def test_a_manifest_with_another_length_or_level_than_signed_is_refused_and_the_honest_one_decrypts(
        contexts: dict[int, Context]) -> None:
    coordinator = _ceremony(contexts)
    key_id = coordinator.key_id
    shares = {n: ckks.key_store(contexts[n]).load_key(key_id).share for n in NODES}
    params, primes, nonce = shares[NODES[0]].params, 2, os.urandom(NONCE_BYTES)
    rng = np.random.default_rng(5)
    values = {n: rng.normal(0.0, 0.05, LENGTH) for n in NODES}
    total = CiphertextSum(params, length=LENGTH, primes=primes)
    tags = {}
    for node, name in zip(NODES, NAMES, strict=True):
        c0 = wire_form(params, encrypt_vector(shares[node], values[node], primes=primes, round_number=1, group=0,
                                              nonce=nonce))
        total.add(node, c0)
        tags[node] = contribute(shares[node], c0, round_number=1, group=0, nonce=nonce, length=LENGTH, primes=primes,
                                signer=lambda m, k=KEYS[name]: sign(k, m), department=name, binding=b"run:7")
    honest = total.manifest(key_id=key_id, round=1, group=0, nonce=nonce, subset=NODES[:T])

    def ask(node: int, manifest: object) -> RecordDict:
        return _call(ckks.decrypt, DECRYPT, node, contexts[node],
                     RecordDict({CKKS: encode_decrypt_request(manifest, tags)}))  # type: ignore[arg-type]

    for lie in (dataclasses.replace(honest, length=2**26), dataclasses.replace(honest, length=LENGTH + 1),
                dataclasses.replace(honest, primes=1)):
        with pytest.raises(SecureAggregationError, match="not signed by its registered key"):
            ask(NODES[0], lie)
    # a contributor set other than the signed records sent with it: one named without its record
    named_without = dataclasses.replace(honest, contributors=(*NODES[:4], 2**63 + 9))
    with pytest.raises(SecureAggregationError, match="contributor holds no share|do not match"):
        ask(NODES[0], named_without)
    fewer_records = {n: t for n, t in tags.items() if n != NODES[4]}
    with pytest.raises(SecureAggregationError, match="do not match the manifest's contributors"):
        _call(ckks.decrypt, DECRYPT, NODES[0], contexts[NODES[0]],
              RecordDict({CKKS: encode_decrypt_request(honest, fewer_records)}))
    partials = {}
    for node in honest.subset:
        reply = ask(node, honest)
        partials[node] = decode_partial(reply.config_records[CKKS], reply.array_records[ARRAYS], honest)
    result = combine(params, total.c0, partials, honest)
    reference = np.sum(np.stack(list(values.values())), axis=0)
    assert np.max(np.abs(result - reference)) <= 6 * params.error_std(T, len(NODES))
