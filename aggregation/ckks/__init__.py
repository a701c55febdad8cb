"""Threshold CKKS secure aggregation: the server adds ciphertexts it can never decrypt; any t of n key holders decrypt the sum.

No FL framework ships threshold decryption (FLARE's HE gives every client the same secret key;
Flower has none) and OpenFHE has no Python 3.11 wheels, so this builds it on SEAL 4.3 as TenSEAL
ships it (``tenseal.sealapi``), with numpy for everything SEAL does not expose:

- ``params``: parameter sets checked for 128-bit security, smudging, capacity and precision;
- ``streams``: SEAL's serialized objects ⇄ numpy; ``seal``: the SEAL context and conversions;
- ``rns``: arithmetic mod the RNS primes, Shamir sharing per prime and coordinate, flooding noise;
- ``keys``: the dealer-free, commit-then-reveal key ceremony and the ``KeyShare`` it leaves;
- ``threshold``: encryption, the running ciphertext sum, refusal rules, partial decryption, combine.

Security (semi-honest parties, honest-but-curious server): the server holds only public material;
a decryption needs t members that each agree to a manifest (round, contributors, S) fixed in
advance; flooding noise of 2^κ times the aggregate's noise hides the key in published decryptions.
t colluding members (or t − 1 plus the server) can decrypt anything; fewer learn nothing.
"""

from .keys import (
    Announcement,
    CeremonyCoordinator,
    Commitment,
    KeyParty,
    KeyShare,
    Reveal,
    ceremony_in_one_process,
    public_key_id,
)
from .params import CkksParams
from .threshold import (
    CiphertextSum,
    DecryptionSum,
    Manifest,
    check_request,
    combine,
    encrypt_vector,
    partial_decrypt,
)

__all__ = [
    "Announcement",
    "CeremonyCoordinator",
    "CiphertextSum",
    "CkksParams",
    "DecryptionSum",
    "Commitment",
    "KeyParty",
    "KeyShare",
    "Manifest",
    "Reveal",
    "ceremony_in_one_process",
    "check_request",
    "combine",
    "encrypt_vector",
    "partial_decrypt",
    "public_key_id",
]
