"""The federation admin's Ed25519 key: bearer tokens for the Control API and signatures over apps.

Two things must hold even when the coordinating server is not trusted (an active server, or anyone
who reaches its port):

- **Only the admin controls the federation.** Every Control API call (start/stop/list runs,
  register/unregister nodes) carries a short-lived token signed by the admin's key; the SuperLink
  holds only the admin's *public* key, so neither it nor anyone who reads its disk can mint one.
- **Departments run only what the admin approved.** A run's app bundle (FAB) carries the admin's
  signature over every file in it (the run config included); a node's ClientApp process checks it
  before any of the bundle is installed or imported, and refuses a run config that differs from the
  signed one. A server that starts runs on its own (or with a stolen token) cannot push code or a
  weaker configuration (``secure-aggregation = none``) to the departments.

Token: ``qfl1.<claims>.<signature>`` (base64url), claims ``{"aud", "iat", "exp", "nonce", "call"}``;
the audience is the federation id (SHA-256 of the federation CA certificate), so a token for one
federation is refused by another. ``call`` is the SHA-256 of the HTTP method, path and body of the
one Control API call the token is for (``call_digest``): the SuperLink refuses it for any other
call, and a second time (``TokenNonces``), and it lives at most ``TOKEN_TTL_S``. A token without
``call`` is a session token for Flower's own CLI (at most ``SESSION_TTL_S``), accepted for a few
calls only (``deploy.admin_access``). The signature covers ``quorumfl-admin-token-v1.`` + claims.

App signature: a JSON file inside the FAB, ``{"version", "signed-at", "files", "signature"}``
where ``files`` maps each other path of the bundle (Flower's own ``.info/CONTENT`` aside) to its
SHA-256 and the signature covers the canonical JSON of ``signed-at`` and ``files``. The run config
inside carries ``run_stamp``'s nonce, expiry and roster version, which nodes hold to one run each
(``privacy.served_runs``).

Written on ``cryptography``'s Ed25519 (no JWT library: the token is two fields and one signature,
and a JWT library would add algorithm negotiation we would have to forbid). Pure: bytes in, bytes
out; the caller reads and writes the key files.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import threading
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from quorumfl.errors import CredentialError

__all__ = [
    "SIGNATURE_FILE",
    "RUN_STAMP_KEYS",
    "SESSION_TTL_S",
    "SIGNED_RUN_VALID_S",
    "TOKEN_TTL_S",
    "AdminToken",
    "AppSignature",
    "TokenNonces",
    "call_digest",
    "federation_id",
    "generate_admin_key",
    "issue_token",
    "key_id",
    "load_admin_private",
    "load_admin_publics",
    "run_stamp",
    "sign_app",
    "verify_app",
    "verify_token",
]

SIGNATURE_FILE = "quorumfl-signature.json"
TOKEN_TTL_S = 300.0  # a token bound to one call
SESSION_TTL_S = 8 * 3600.0  # a session token for Flower's own CLI (quorumfl certs flwr-login)
SIGNED_RUN_VALID_S = 6 * 3600  # a signed run must reach each node within this; its later tasks run on past it
CLOCK_SKEW_S = 60.0
_TOKEN_PREFIX = "qfl1"
_TOKEN_CONTEXT = b"quorumfl-admin-token-v1."
_APP_CONTEXT = b"quorumfl-app-signature-v1."
_FLOWER_META = ".info/CONTENT"  # Flower's manifest of the bundle's files, written by Flower's builder
MAX_TOKEN_CHARS = 2048
_SIGNATURE_FIELDS = {"version", "signed-at", "files", "key", "signature"}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """Strict: only the canonical unpadded encoding (base64 leaves spare bits in the last character,
    and a token or signature with another spelling of the same bytes is refused)."""
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("not canonical base64url")
    return data


def generate_admin_key() -> tuple[bytes, bytes]:
    """A new admin key: (private key as unencrypted PKCS8 PEM, public key as an OpenSSH line)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + b" quorumfl-admin\n"


def load_admin_private(data: bytes, *, source: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise CredentialError(f"{source} is not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise CredentialError(f"{source} is not an Ed25519 key; make the admin key with 'quorumfl certs admin-key'")
    return key


def load_admin_publics(data: bytes, *, source: str) -> list[Ed25519PublicKey]:
    """Every admin public key in an OpenSSH file, one per line (more than one while rotating)."""
    keys: list[Ed25519PublicKey] = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            key = serialization.load_ssh_public_key(line.strip().encode())
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise CredentialError(f"{source} line {number} is not an OpenSSH public key ({exc})") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise CredentialError(f"{source} line {number} is not an Ed25519 key")
        keys.append(key)
    if not keys:
        raise CredentialError(f"{source} holds no admin public key; copy the federation's admin.pub there")
    return keys


def key_id(key: Ed25519PublicKey) -> str:
    """A short fingerprint of an admin public key, for messages and logs."""
    return hashlib.sha256(key.public_bytes_raw()).hexdigest()[:16]


def federation_id(ca_certificate: bytes) -> str:
    """The federation's id: SHA-256 of its CA certificate (PEM bytes as written by 'certs init')."""
    return hashlib.sha256(ca_certificate.strip()).hexdigest()


def _verify(keys: Sequence[Ed25519PublicKey], signature: bytes, message: bytes) -> Ed25519PublicKey | None:
    for key in keys:
        try:
            key.verify(signature, message)
            return key
        except InvalidSignature:
            continue
    return None


# ---- Control API tokens ---------------------------------------------------------------------------
def call_digest(method: str, path: str, body: bytes) -> str:
    """What a call-bound token names: SHA-256 of the HTTP method, the path and the body."""
    return hashlib.sha256(method.upper().encode() + b" " + path.encode() + b"\n" + body).hexdigest()


def issue_token(key: Ed25519PrivateKey, *, audience: str, now: float, ttl: float = TOKEN_TTL_S, call: str = "") -> str:
    """A token for one Control API call (``call``: its ``call_digest``), or without ``call`` a session
    token for Flower's own CLI (``quorumfl certs flwr-login``), which the SuperLink accepts for a few
    calls only (``deploy.admin_access``)."""
    fields: dict[str, object] = {"aud": audience, "iat": int(now), "exp": int(now + ttl), "nonce": os.urandom(12).hex()}
    if call:
        fields["call"] = call
    claims = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    body = _b64(claims)
    return f"{_TOKEN_PREFIX}.{body}.{_b64(key.sign(_TOKEN_CONTEXT + body.encode()))}"


@dataclass(frozen=True)
class AdminToken:
    """A verified token: who signed it, its nonce and expiry, and the call it is for ("" for a session token)."""

    key: str
    nonce: str
    expires: int
    call: str


def verify_token(token: str, keys: Sequence[Ed25519PublicKey], *, audience: str, now: float) -> AdminToken:
    """The verified claims of ``token``; raises ``CredentialError`` with the reason. A call-bound
    token lives at most ``TOKEN_TTL_S``, a session token at most ``SESSION_TTL_S``."""
    if len(token) > MAX_TOKEN_CHARS:
        raise CredentialError("admin token is too long")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != _TOKEN_PREFIX:
        raise CredentialError("not a QuorumFL admin token")
    try:
        signature = _unb64(parts[2])
        claims = json.loads(_unb64(parts[1]))
        aud, iat, exp, nonce = claims["aud"], claims["iat"], claims["exp"], claims["nonce"]
        call = claims.get("call", "")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CredentialError(f"malformed admin token ({exc.__class__.__name__})") from exc
    signer = _verify(keys, signature, _TOKEN_CONTEXT + parts[1].encode())
    if signer is None:
        raise CredentialError("admin token is not signed by a key this federation trusts")
    if aud != audience:
        raise CredentialError("admin token is for another federation")
    if not isinstance(nonce, str) or len(nonce) != 24 or not isinstance(call, str):
        raise CredentialError("admin token has a malformed nonce or call")
    longest = TOKEN_TTL_S if call else SESSION_TTL_S
    if not isinstance(iat, int) or not isinstance(exp, int) or not 0 < exp - iat <= longest:
        raise CredentialError(f"admin token has an invalid lifetime (at most {longest:g} s)")
    if now > exp + CLOCK_SKEW_S:
        raise CredentialError("admin token expired")
    if now < iat - CLOCK_SKEW_S:
        raise CredentialError("admin token is not valid yet; check the clocks")
    return AdminToken(key_id(signer), nonce, exp, call)


class TokenNonces:
    """The nonces of the call-bound tokens a SuperLink accepted, each kept until its token expired
    (plus the clock skew): a token is accepted once."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def claim(self, token: AdminToken, *, now: float) -> None:
        with self._lock:
            self._seen = {n: until for n, until in self._seen.items() if until >= now}
            if token.nonce in self._seen:
                raise CredentialError("admin token was already used; every call signs a fresh one")
            self._seen[token.nonce] = token.expires + CLOCK_SKEW_S


# ---- app bundles ----------------------------------------------------------------------------------
RUN_STAMP_KEYS = ("run-nonce", "run-expires", "roster-version")  # run-config keys each signature sets afresh


def run_stamp(*, now: float, roster_version: int) -> dict[str, str | int]:
    """What makes a signed run config good for one run (``privacy.served_runs``): a fresh nonce, the
    expiry ``SIGNED_RUN_VALID_S`` from ``now``, and the version of the roster it carries."""
    return {"run-nonce": os.urandom(16).hex(), "run-expires": int(now + SIGNED_RUN_VALID_S),
            "roster-version": int(roster_version)}


def _digests(files: Mapping[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())}


def _app_message(signed_at: int, digests: Mapping[str, str]) -> bytes:
    return _APP_CONTEXT + json.dumps({"files": dict(digests), "signed-at": signed_at}, sort_keys=True,
                                     separators=(",", ":")).encode()


def sign_app(files: Mapping[str, bytes], key: Ed25519PrivateKey, *, now: float) -> bytes:
    """The signature file for an app bundle made of ``files`` (path → bytes)."""
    if SIGNATURE_FILE in files:
        raise CredentialError(f"the app bundle already holds {SIGNATURE_FILE}")
    digests = _digests(files)
    signed_at = int(now)
    return _canonical({
        "version": 1, "signed-at": signed_at, "files": digests,
        "key": key_id(key.public_key()), "signature": _b64(key.sign(_app_message(signed_at, digests))),
    })


def _canonical(record: Mapping[str, object]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class AppSignature:
    key: str  # id of the admin key that signed
    signed_at: int
    files: dict[str, bytes]  # the bundle's files (signature file and Flower's metadata aside)


def verify_app(fab: bytes, keys: Sequence[Ed25519PublicKey]) -> AppSignature:
    """Check a FAB (zip bytes) against the admin keys: every file is covered by a valid signature and
    nothing was added or left out. Raises ``CredentialError`` naming what is wrong."""
    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as archive:
            files = {info.filename: archive.read(info) for info in archive.infolist() if not info.is_dir()}
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CredentialError(f"the app bundle is not a readable zip ({exc})") from exc
    raw = files.pop(SIGNATURE_FILE, None)
    if raw is None:
        raise CredentialError(f"the app bundle is not signed by the federation admin (no {SIGNATURE_FILE})")
    try:
        record = json.loads(raw)
        signed_at, digests, signature = int(record["signed-at"]), record["files"], _unb64(record["signature"])
        if record.get("version") != 1 or not isinstance(digests, dict) or set(record) != _SIGNATURE_FIELDS:
            raise ValueError("unknown signature format")
        if _canonical(record) != raw:
            raise ValueError("not in canonical form")
    except (ValueError, KeyError, TypeError) as exc:
        raise CredentialError(f"the app bundle's {SIGNATURE_FILE} is malformed ({exc})") from exc
    signer = _verify(keys, signature, _app_message(signed_at, digests))
    if signer is None or record["key"] != key_id(signer):
        raise CredentialError("the app bundle's signature does not verify with the federation admin's key")
    content = {name: data for name, data in files.items() if name != _FLOWER_META}
    if _digests(content) != dict(sorted(digests.items())):
        changed = sorted(set(content) ^ set(digests)) or sorted(
            n for n in content if digests.get(n) != hashlib.sha256(content[n]).hexdigest())
        raise CredentialError(f"the app bundle differs from what the admin signed: {', '.join(changed)}")
    return AppSignature(key_id(signer), signed_at, content)
