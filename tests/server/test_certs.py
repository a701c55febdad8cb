"""Federation credentials: what ``certs init`` makes verifies as TLS needs it, and every broken file is
refused with its name (fail closed)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from quorumfl.deploy.certs import (
    Credentials,
    add_node_key,
    check_node_key,
    check_server,
    init_credentials,
    issue_server_cert,
    node_public_key,
    retire_node_key,
    server_hosts,
)
from quorumfl.errors import ConfigError, CredentialError


@pytest.fixture
def creds(tmp_path: Path) -> Credentials:
    return init_credentials(tmp_path / "certs", hosts=["127.0.0.1", "city.example"], nodes=["tax-office", "parks"])


def test_init_makes_a_chain_that_ssl_accepts(creds: Credentials) -> None:
    cert = check_server(creds)
    assert server_hosts(cert) == ["127.0.0.1", "city.example"]
    # What a TLS client does: trust the CA, check the chain and the host name.
    context = ssl.create_default_context(cafile=str(creds.ca_cert))
    context.load_cert_chain(str(creds.server_cert), str(creds.server_key))  # key matches the certificate
    assert creds.node_names() == ["parks", "tax-office"]
    for path in (creds.ca_key, creds.server_key, creds.node_key("parks")):
        assert os.stat(path).st_mode & 0o077 == 0, path
    key = serialization.load_ssh_private_key(creds.node_key("parks").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert node_public_key(creds.node_pub("parks")) == key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    check_node_key(creds.node_key("parks"), creds.ca_cert)


def test_init_never_overwrites_a_ca(creds: Credentials) -> None:
    before = creds.ca_cert.read_bytes()
    with pytest.raises(CredentialError, match="already exists"):
        init_credentials(creds.root, hosts=["127.0.0.1"], nodes=[])
    assert creds.ca_cert.read_bytes() == before


@pytest.mark.parametrize("bad", ["", "../etc", "a b", "-x", "x" * 65])
def test_node_names_are_checked(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match="node name"):
        init_credentials(tmp_path / "c", hosts=["127.0.0.1"], nodes=[bad])
    assert not (tmp_path / "c").exists()


def test_rotation_and_revocation(creds: Credentials) -> None:
    old_pub = node_public_key(creds.node_pub("parks"))
    with pytest.raises(CredentialError, match="--replace"):
        add_node_key(creds, "parks")
    add_node_key(creds, "parks", replace=True)
    assert node_public_key(creds.node_pub("parks")) != old_pub
    [retired] = creds.retired()
    assert node_public_key(retired) == old_pub
    retire_node_key(creds, "tax-office")
    assert creds.node_names() == ["parks"] and not creds.node_key("tax-office").exists()
    with pytest.raises(CredentialError, match="no key"):
        retire_node_key(creds, "tax-office")
    old_cert = creds.server_cert.read_bytes()
    issue_server_cert(creds, hosts=["10.0.0.5"])
    assert creds.server_cert.read_bytes() != old_cert and server_hosts(check_server(creds)) == ["10.0.0.5"]


def test_broken_credentials_are_refused_by_name(creds: Credentials, tmp_path: Path) -> None:
    other = init_credentials(tmp_path / "other", hosts=["127.0.0.1"], nodes=[])
    # a certificate from another CA
    creds.server_cert.write_bytes(other.server_cert.read_bytes())
    with pytest.raises(CredentialError, match="not issued by|does not belong"):
        check_server(creds)
    issue_server_cert(creds, hosts=["127.0.0.1"])
    # a key that does not match the certificate
    creds.server_key.write_bytes(other.server_key.read_bytes())
    with pytest.raises(CredentialError, match="does not belong"):
        check_server(creds)
    issue_server_cert(creds, hosts=["127.0.0.1"])
    # readable by others
    creds.server_key.chmod(0o644)
    with pytest.raises(CredentialError, match="chmod 600"):
        check_server(creds)
    creds.server_key.chmod(0o600)
    # garbage, missing
    creds.server_cert.write_bytes(b"not a certificate")
    with pytest.raises(CredentialError, match="server.pem is not a PEM certificate"):
        check_server(creds)
    creds.server_cert.unlink()
    with pytest.raises(CredentialError, match="certs init"):
        check_server(creds)
    with pytest.raises(CredentialError, match="does not exist"):
        check_node_key(creds.root / "nodes" / "nobody.key", creds.ca_cert)
    creds.node_pub("parks").write_text("ssh-rsa AAAA nonsense")
    with pytest.raises(CredentialError, match="not an OpenSSH public key"):
        node_public_key(creds.node_pub("parks"))


def test_expired_server_certificate_is_refused(creds: Credentials, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt

    import quorumfl.deploy.certs as certs

    cert = x509.load_pem_x509_certificate(creds.server_cert.read_bytes())
    later = cert.not_valid_after_utc + dt.timedelta(days=1)
    monkeypatch.setattr(certs, "_now", lambda: later)
    with pytest.raises(CredentialError, match="expired.*rotate-server"):
        check_server(creds)


def test_bad_hosts_and_days(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--host"):
        init_credentials(tmp_path / "a", hosts=["not a host!"], nodes=[])
    with pytest.raises(ConfigError, match="--days"):
        init_credentials(tmp_path / "b", hosts=["127.0.0.1"], nodes=[], days=0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing half-made to block a retry


def test_init_makes_the_admin_key_and_rotation_retires_the_old_one(creds: Credentials) -> None:
    from quorumfl.deploy.certs import add_admin_key, check_admin_key

    check_admin_key(creds)
    assert oct(creds.admin_key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(CredentialError, match="--replace"):
        add_admin_key(creds)
    old = creds.admin_pub.read_bytes()
    add_admin_key(creds, replace=True)
    assert creds.admin_pub.read_bytes() != old
    assert [p.read_bytes() for p in (creds.root / "retired-admin").glob("*.pub")] == [old]
    assert creds.retired() == []  # retired/ holds node keys only: they are unregistered at the SuperLink
    check_admin_key(creds)
    creds.admin_pub.write_bytes(old)  # a public key that is not the private key's
    with pytest.raises(CredentialError, match="does not belong"):
        check_admin_key(creds)


def test_the_roster_lists_current_node_keys_only(creds: Credentials) -> None:
    import json

    from quorumfl.aggregation.secagg.identity import Roster
    from quorumfl.deploy.certs import roster_json

    roster = json.loads(roster_json(creds))
    assert sorted(roster) == ["parks", "tax-office"]
    assert roster["parks"].split() == creds.node_pub("parks").read_text().split()[:2]
    retire_node_key(creds, "parks")
    assert sorted(json.loads(roster_json(creds))) == ["tax-office"]
    assert sorted(Roster.from_json(roster_json(creds)).keys) == ["tax-office"]
