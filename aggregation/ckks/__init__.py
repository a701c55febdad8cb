"""Threshold CKKS secure aggregation: the server adds ciphertexts it can never decrypt; any t of n key holders decrypt the sum.

No FL framework ships threshold decryption (FLARE's HE gives every client the same secret key;
Flower has none) and OpenFHE has no Python 3.11 wheels, so this builds it on SEAL 4.3 as TenSEAL
ships it (``tenseal.sealapi``), with numpy for everything SEAL does not expose:

- ``params``: parameter sets checked for 128-bit security, smudging, capacity and precision;
- ``streams``: SEAL's serialized objects ⇄ numpy; ``seal``: the SEAL context and conversions;
- ``rns``: arithmetic mod the RNS primes, Shamir sharing per prime and coordinate, flooding noise;
- ``keys``: the dealer-free, commit-then-reveal key ceremony and the ``KeyShare`` it leaves;
- ``threshold``: encryption under a round's common c1, the running sum, refusal rules, partial
  decryption, combine;
- ``packing``: residues on the wire at 60 bits (two in 15 bytes).

Security: the server holds only public material; a decryption needs t members that each agree to a
manifest (round, group, nonce, contributors, S); the c1 they multiply their shares by is derived
by each of them from that label (so an active server has no c1 to craft), and each (round, group)
is decrypted once; ceremony commitments and contributions are signed with the members' registered
node keys and checked against the admin's roster; flooding noise of 2^κ times the aggregate's
noise hides the key in published decryptions, and each key answers a capped number of
decryptions. t colluding members can decrypt anything; t − 1 learn nothing from the shares.
"""

from quorumfl.aggregation.ckks.keys import (
    Announcement,
    CeremonyCoordinator,
    Commitment,
    KeyParty,
    KeyShare,
    Reveal,
    ceremony_in_one_process,
    public_key_id,
)
from quorumfl.aggregation.ckks.packing import pack_residues, unpack_residues
from quorumfl.aggregation.ckks.params import CkksParams, ceremony_threshold
from quorumfl.aggregation.ckks.threshold import (
    MAX_DECRYPTIONS,
    CiphertextSum,
    Contribution,
    DecryptionSum,
    Manifest,
    check_request,
    combine,
    common_c1,
    contribute,
    encrypt_vector,
    partial_decrypt,
    wire_form,
)

__all__ = [
    "MAX_DECRYPTIONS",
    "Announcement",
    "CeremonyCoordinator",
    "CiphertextSum",
    "CkksParams",
    "DecryptionSum",
    "Commitment",
    "Contribution",
    "KeyParty",
    "KeyShare",
    "Manifest",
    "Reveal",
    "ceremony_in_one_process",
    "ceremony_threshold",
    "check_request",
    "combine",
    "common_c1",
    "contribute",
    "encrypt_vector",
    "pack_residues",
    "partial_decrypt",
    "public_key_id",
    "unpack_residues",
    "wire_form",
]
