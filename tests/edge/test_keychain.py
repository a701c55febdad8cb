"""The signing-key chain on its own: a device follows endorsements from the key it trusts and nowhere
else. Every test below that expects a refusal plays someone without the trusted key."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.edge.keychain import Endorsement, endorse, follow, raw_public_key, trusted_keys
from quorumfl.errors import ArtifactError

WHEN = "2026-12-04T10:00:00+00:00"


def _chain(n: int) -> tuple[list[Ed25519PrivateKey], list[Endorsement]]:
    keys = [Ed25519PrivateKey.generate() for _ in range(n + 1)]
    chain = [endorse(keys[i - 1], keys[i].public_key(), sequence=i, created_at=WHEN) for i in range(1, n + 1)]
    return keys, chain


def _raw(key: Ed25519PrivateKey) -> bytes:
    return raw_public_key(key.public_key())


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_a_device_at_any_key_follows_the_rest_of_the_chain(n: int, data: st.DataObject) -> None:
    keys, chain = _chain(n)
    k = data.draw(st.integers(0, n))
    assert follow(_raw(keys[k]), chain) == chain[k:]
    assert trusted_keys(_raw(keys[k]), chain[k:]) == [_raw(key) for key in keys[k:]]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), data=st.data())
def test_any_flipped_byte_in_a_step_the_device_takes_is_refused(n: int, data: st.DataObject) -> None:
    keys, chain = _chain(n)
    step = data.draw(st.integers(0, n - 1))
    target = chain[step]
    which = data.draw(st.sampled_from(["statement", "signature"]))
    blob = bytearray(getattr(target, which))
    position = data.draw(st.integers(0, len(blob) - 1))
    blob[position] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(ArtifactError):
        if which == "statement":
            forged = Endorsement.parse(bytes(blob), target.signature)
        else:
            forged = Endorsement.parse(target.statement, bytes(blob))
        follow(_raw(keys[0]), [*chain[:step], forged, *chain[step + 1:]])


def test_a_key_endorsed_by_anyone_but_the_trusted_key_is_refused() -> None:
    keys, chain = _chain(1)
    thief = Ed25519PrivateKey.generate()
    # The attacker names the device's key as "previous" but cannot sign with it.
    statement = json.loads(endorse(thief, thief.public_key(), sequence=1, created_at=WHEN).statement)
    statement["previous"] = _raw(keys[0]).hex()
    raw = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    forged = Endorsement.parse(raw, thief.sign(raw))
    with pytest.raises(ArtifactError, match="not signed by key 0"):
        follow(_raw(keys[0]), [forged])
    # A chain of another federation: it never names this device's key.
    _, other = _chain(2)
    with pytest.raises(ArtifactError, match="does not contain the key this device trusts"):
        follow(_raw(keys[0]), other)


def test_a_forked_or_gapped_chain_is_refused_whole() -> None:
    keys, chain = _chain(2)
    rival = Ed25519PrivateKey.generate()  # key 0 (stolen) endorses a second key 1
    fork = endorse(keys[0], rival.public_key(), sequence=1, created_at=WHEN)
    with pytest.raises(ArtifactError, match="skips or repeats"):
        follow(_raw(keys[0]), [chain[0], fork, chain[1]])
    with pytest.raises(ArtifactError, match="skips or repeats"):
        follow(_raw(keys[0]), [chain[1]])  # key 2 without key 1
    later = endorse(rival, Ed25519PrivateKey.generate().public_key(), sequence=2, created_at=WHEN)
    with pytest.raises(ArtifactError, match="forked"):
        follow(_raw(keys[1]), [chain[0], later])  # 2 continues from the rival key, not from 1


def test_a_device_record_that_does_not_verify_from_its_key_is_refused() -> None:
    keys, chain = _chain(2)
    with pytest.raises(ArtifactError, match="does not continue"):
        trusted_keys(_raw(keys[1]), chain)  # the record starts before the device's own key
    with pytest.raises(ArtifactError, match="does not continue"):
        trusted_keys(_raw(keys[0]), chain[1:])  # a step is missing


def test_an_endorsement_never_parses_as_something_else() -> None:
    keys, chain = _chain(1)
    body = json.loads(chain[0].statement)
    for change in ({"purpose": "quorumfl-edge-manifest"}, {"schema": 2}, {"sequence": 0}, {"extra": 1}):
        raw = json.dumps({**body, **change}, sort_keys=True, separators=(",", ":")).encode()
        with pytest.raises(ArtifactError):
            Endorsement.parse(raw, keys[0].sign(raw))
    spaced = json.dumps(body, sort_keys=True).encode()  # the same fields, not canonical
    with pytest.raises(ArtifactError, match="canonical"):
        Endorsement.parse(spaced, keys[0].sign(spaced))
