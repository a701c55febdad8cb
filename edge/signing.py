"""Ed25519 keys that sign edge artifacts (``cryptography``): the server's private key, edge devices'
public key.

The private key is a PKCS#8 PEM written atomically with mode 0600 next to its public key (a
SubjectPublicKeyInfo PEM, the file edge devices are given). Loading refuses a missing, unreadable or
non-Ed25519 key with the path and the fix; nothing here logs key material.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from quorumfl.core.files import atomic_write
from quorumfl.errors import ArtifactError, ConfigError

__all__ = ["create_signing_key", "load_private_key", "load_public_key", "public_key_path", "sign", "verifies", "verify"]


def public_key_path(private_path: Path) -> Path:
    return private_path.with_name(private_path.stem + ".pub.pem")


def create_signing_key(path: Path) -> Ed25519PrivateKey:
    """Create a new key at ``path`` (0600) and its public half beside it; never overwrite one."""
    if path.exists():
        raise ConfigError(f"signing key {path} already exists; delete it first to replace it (edge "
                          "devices then need the new public key)")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    atomic_write(public_key_path(path), public)
    atomic_write(path, private, mode=0o600)
    return key


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise ConfigError(f"signing key {path} does not exist; create it with 'quorumfl edge keys init'") from None
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"signing key {path} is not a readable unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is not an Ed25519 key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"--public-key {path} does not exist; copy the server's edge public key "
                          "(quorumfl edge keys show) to the device") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--public-key {path} is not a PEM public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"--public-key {path} is not an Ed25519 public key")
    return key


def sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    return key.sign(message)


def verify(key: Ed25519PublicKey, message: bytes, signature: bytes) -> None:
    """Raise ArtifactError unless ``signature`` is ``key``'s signature of ``message``."""
    try:
        key.verify(signature, message)
    except InvalidSignature:
        raise ArtifactError("artifact signature does not verify with the given public key: the manifest "
                            "was altered or signed by another key; the artifact is refused") from None


def verifies(key: Ed25519PublicKey | bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``key``'s (a key, or its 32 raw bytes) over ``message``."""
    try:
        public = key if isinstance(key, Ed25519PublicKey) else Ed25519PublicKey.from_public_bytes(key)
        public.verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
