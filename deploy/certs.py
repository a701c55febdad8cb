"""A federation's TLS and SuperNode-authentication credentials: create, rotate, check.

Flower brings the mechanisms (TLS on the SuperLink's port, SuperNode authentication by registered
ECDSA keys); this module makes the files they need, with ``cryptography``, in one folder:

    ca.crt  ca.key              the federation's own CA (self-signed, ECDSA P-384)
    server.pem  server.key      the SuperLink's certificate, signed by the CA, for the given hosts
    nodes/NAME.key  NAME.pub    one OpenSSH ECDSA P-384 key pair per department node
    admin.key  admin.pub        the admin's Ed25519 key: signs Control API tokens and run bundles
                                (the SuperLink and the nodes get admin.pub only)
    retired-admin/admin-STAMP.pub  admin keys replaced by a rotation
    retired/NAME-STAMP.pub      keys replaced or revoked: unregistered at the SuperLink, never again valid

Nothing here talks to the network. ``check_*`` functions fail closed with a ``CredentialError``
that names the file and the fix; private keys are written 0600 and refused when others can read them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from quorumfl.aggregation.secagg.identity import parse_ec_private_key
from quorumfl.errors import ConfigError, CredentialError
from quorumfl.privacy.admin import generate_admin_key, load_admin_private, load_admin_publics

__all__ = [
    "Credentials",
    "add_admin_key",
    "add_node_key",
    "check_admin_key",
    "check_node_key",
    "check_server",
    "init_credentials",
    "issue_server_cert",
    "node_public_key",
    "roster_json",
    "retire_node_key",
    "server_hosts",
    "validate_node_name",
]

CURVE = ec.SECP384R1()
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CA_DAYS = 3650


@dataclass(frozen=True)
class Credentials:
    """Where a federation's credential files live."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    @property
    def admin_key(self) -> Path:
        return self.root / "admin.key"

    @property
    def admin_pub(self) -> Path:
        return self.root / "admin.pub"

    def node_key(self, name: str) -> Path:
        return self.root / "nodes" / f"{validate_node_name(name)}.key"

    def node_pub(self, name: str) -> Path:
        return self.root / "nodes" / f"{validate_node_name(name)}.pub"

    def node_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "nodes").glob("*.pub"))

    def retired(self) -> list[Path]:
        return sorted((self.root / "retired").glob("*.pub"))


def validate_node_name(name: str) -> str:
    if not NODE_NAME.match(name):
        raise ConfigError(f"node name {name!r} must be 1-64 letters, digits, '.', '_' or '-' (starting with a "
                          "letter or digit), e.g. 'tax-office'")
    return name


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Atomic write; private files are created 0600 before any byte lands in them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    if not hosts:
        raise ConfigError("--host: name at least one address or DNS name the nodes use to reach the SuperLink")
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not re.match(r"^[A-Za-z0-9*]([A-Za-z0-9.-]{0,252})$", host):
                raise ConfigError(f"--host {host!r} is neither an IP address nor a DNS name") from None
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def init_credentials(root: Path, *, hosts: Sequence[str], nodes: Sequence[str], days: int = 365) -> Credentials:
    """Create the CA, the SuperLink's certificate and one key pair per node. Refuses to overwrite an
    existing CA (every node trusts it); rotate with ``issue_server_cert`` / ``add_node_key`` instead."""
    creds = Credentials(root)
    if creds.ca_key.exists() or creds.ca_cert.exists():
        raise CredentialError(f"{creds.ca_cert} already exists; every node trusts that CA. Rotate with "
                              "'quorumfl certs rotate-server' or 'quorumfl certs add-node --replace', or "
                              "choose another --dir for a new federation")
    for name in nodes:
        validate_node_name(name)
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"--nodes names a node twice: {', '.join(nodes)}")
    if days < 1:
        raise ConfigError(f"--days must be at least 1, got {days}")
    _san(hosts)  # every argument is checked before the first file is written
    key = ec.generate_private_key(CURVE)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "QuorumFL federation CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    _write(creds.ca_key, _pem_key(key), private=True)
    _write(creds.ca_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    issue_server_cert(creds, hosts=hosts, days=days)
    add_admin_key(creds)
    for node in nodes:
        add_node_key(creds, node)
    return creds


def add_admin_key(creds: Credentials, *, replace: bool = False) -> Path:
    """The admin's Ed25519 key pair (``admin.key`` 0600, ``admin.pub``). ``replace`` rotates it: the
    old public key moves to ``retired-admin/``; the SuperLink and every node need the new ``admin.pub``."""
    if creds.admin_key.exists() or creds.admin_pub.exists():
        if not replace:
            raise CredentialError(f"{creds.admin_key} already exists; pass --replace to rotate the admin key")
        if creds.admin_pub.exists():
            # not in retired/: every key there is a node key to unregister at the SuperLink
            target = creds.root / "retired-admin" / f"admin-{_now().strftime('%Y%m%dT%H%M%S%f')}.pub"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(creds.admin_pub, target)
    private, public = generate_admin_key()
    _write(creds.admin_key, private, private=True)
    _write(creds.admin_pub, public, private=False)
    return creds.admin_key


def check_admin_key(creds: Credentials) -> None:
    """The admin key pair is present, private to its owner and matching (fails closed)."""
    for path in (creds.admin_key, creds.admin_pub):
        if not path.exists():
            raise CredentialError(f"no admin key at {path}: the Control API accepts only calls signed by the admin; "
                                  "make it with 'quorumfl certs admin-key' (admin machine)")
    _check_private_mode(creds.admin_key)
    key = load_admin_private(creds.admin_key.read_bytes(), source=str(creds.admin_key))
    publics = load_admin_publics(creds.admin_pub.read_bytes(), source=str(creds.admin_pub))
    if all(p.public_bytes_raw() != key.public_key().public_bytes_raw() for p in publics):
        raise CredentialError(f"{creds.admin_key} does not belong to {creds.admin_pub}; rotate both with "
                              "'quorumfl certs admin-key --replace'")


def issue_server_cert(creds: Credentials, *, hosts: Sequence[str], days: int = 365) -> Path:
    """A new SuperLink key and certificate from the CA (rotation: nodes keep trusting the same CA)."""
    san = _san(hosts)
    if days < 1:
        raise ConfigError(f"--days must be at least 1, got {days}")
    ca_key = _load_private(creds.ca_key, "the CA key")
    ca_cert = _load_cert(creds.ca_cert)
    key = ec.generate_private_key(CURVE)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)  # type: ignore[arg-type]
        .sign(ca_key, hashes.SHA384())
    )
    _write(creds.server_key, _pem_key(key), private=True)
    _write(creds.server_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return creds.server_cert


def add_node_key(creds: Credentials, name: str, *, replace: bool = False) -> Path:
    """A new OpenSSH ECDSA P-384 key pair for node ``name``; with ``replace`` the old public key moves
    to ``retired/`` (to be unregistered at the SuperLink) instead of being refused."""
    key_path, pub_path = creds.node_key(name), creds.node_pub(name)
    if pub_path.exists() or key_path.exists():
        if not replace:
            raise CredentialError(f"node {name!r} already has a key ({pub_path}); pass --replace to rotate it")
        retire_node_key(creds, name)
    key = ec.generate_private_key(CURVE)
    _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()), private=True)
    _write(pub_path, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                   serialization.PublicFormat.OpenSSH) + f" {name}\n".encode(),
           private=False)
    return key_path


def retire_node_key(creds: Credentials, name: str) -> Path:
    """Move node ``name``'s public key to ``retired/`` and delete its private key: the next
    registration sync unregisters it at the SuperLink, so that key is refused from then on."""
    pub_path = creds.node_pub(name)
    if not pub_path.exists():
        raise CredentialError(f"node {name!r} has no key in {pub_path.parent}; 'quorumfl certs list' shows the nodes")
    stamp = _now().strftime("%Y%m%dT%H%M%S%f")
    target = creds.root / "retired" / f"{name}-{stamp}.pub"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(pub_path, target)
    creds.node_key(name).unlink(missing_ok=True)
    return target


def node_public_key(path: Path) -> bytes:
    """The key as Flower registers it (PEM SubjectPublicKeyInfo), from an OpenSSH ``.pub`` file."""
    try:
        key = serialization.load_ssh_public_key(path.read_bytes())
    except OSError as exc:
        raise CredentialError(f"cannot read node public key {path}: {exc.strerror}") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CredentialError(f"{path} is not an OpenSSH public key ({exc}); create keys with "
                              "'quorumfl certs add-node'") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CredentialError(f"{path} holds a {type(key).__name__}; node keys must be ECDSA (NIST curve)")
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def roster_version(creds: Credentials) -> int:
    """The roster's version, derived from the credentials folder: the current node keys plus twice the
    retired ones. Adding a key adds 1, retiring one adds 1 (−1 current, +2 retired), replacing one
    adds 2: it grows with every change, so a node that has seen a signed run with a newer roster
    refuses an older one (``privacy.served_runs``)."""
    return len(creds.node_names()) + 2 * len(creds.retired())


def roster_json(creds: Credentials) -> str:
    """The admin's roster of departments for a run's config: JSON {name: OpenSSH public key} of every
    current node key (retired keys are not on it). Nodes check peers' signed keys against it."""
    import json

    roster: dict[str, str] = {}
    for name in creds.node_names():
        node_public_key(creds.node_pub(name))  # refuses anything but an ECDSA key
        fields = creds.node_pub(name).read_text().split()
        roster[name] = f"{fields[0]} {fields[1]}"
    return json.dumps(roster, sort_keys=True, separators=(",", ":"))


def _check_private_mode(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialError(f"{path} can be read by other users (mode {stat.S_IMODE(mode):o}); "
                              f"run 'chmod 600 {path}'")


def _load_private(path: Path, what: str, *, missing: str = "create credentials with 'quorumfl certs init'"
                  ) -> ec.EllipticCurvePrivateKey:
    try:
        _check_private_mode(path)
        data = path.read_bytes()
    except FileNotFoundError:
        raise CredentialError(f"{what} {path} does not exist; {missing}") from None
    except OSError as exc:
        raise CredentialError(f"cannot read {what} {path}: {exc.strerror}") from exc
    try:
        return parse_ec_private_key(data)
    except ValueError as exc:
        raise CredentialError(f"{what} {path} is {exc}") from exc


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise CredentialError(f"certificate {path} does not exist; create credentials with 'quorumfl certs init'") from None
    except OSError as exc:
        raise CredentialError(f"cannot read certificate {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise CredentialError(f"{path} is not a PEM certificate ({exc})") from exc


def _check_valid(cert: x509.Certificate, path: Path, fix: str) -> None:
    now = _now()
    if now < cert.not_valid_before_utc:
        raise CredentialError(f"{path} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; check the clock")
    if now > cert.not_valid_after_utc:
        raise CredentialError(f"{path} expired on {cert.not_valid_after_utc:%Y-%m-%d}; {fix}")


def check_server(creds: Credentials) -> x509.Certificate:
    """The SuperLink's certificate: present, issued by the CA, matching its key, not expired."""
    ca = _load_cert(creds.ca_cert)
    cert = _load_cert(creds.server_cert)
    key = _load_private(creds.server_key, "the SuperLink key")
    _check_valid(ca, creds.ca_cert, "create a new federation CA with 'quorumfl certs init --dir NEW'")
    _check_valid(cert, creds.server_cert, "reissue it with 'quorumfl certs rotate-server'")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise CredentialError(f"{creds.server_cert} was not issued by {creds.ca_cert}; reissue it with "
                              "'quorumfl certs rotate-server'") from exc
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.public_numbers() != key.public_key().public_numbers():
        raise CredentialError(f"{creds.server_key} does not belong to {creds.server_cert}; reissue both with "
                              "'quorumfl certs rotate-server'")
    return cert


def check_node_key(key_path: Path, ca_cert: Path) -> None:
    """A node's side: its private key is readable only by its owner, and the CA certificate is valid."""
    _load_private(key_path, "the node key", missing=(
        f"the admin makes a department's key with 'quorumfl certs add-node {key_path.stem}' (an existing federation) "
        f"and copies nodes/{key_path.name} here, or pass --key"))
    _check_valid(_load_cert(ca_cert), ca_cert, "ask the admin for the federation's current ca.crt")


def server_hosts(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.IPAddress)] + list(san.get_values_for_type(x509.DNSName))
