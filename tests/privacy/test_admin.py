"""The admin's signatures, attacked: tokens and app bundles that were forged, edited, re-targeted or
replayed late are refused; the admin's own are accepted (and nothing else is)."""

from __future__ import annotations

import io
import json
import time
import zipfile

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.deploy.app_guard import check_run
from quorumfl.deploy.control import app_pyproject, build_fab
from quorumfl.errors import CredentialError
from quorumfl.privacy.admin import (
    SIGNATURE_FILE,
    generate_admin_key,
    issue_token,
    load_admin_private,
    load_admin_publics,
    sign_app,
    verify_app,
    verify_token,
)
from quorumfl.server.config import DEFAULTS

ADMIN_PEM, ADMIN_PUB = generate_admin_key()
ADMIN = load_admin_private(ADMIN_PEM, source="admin.key")
KEYS = load_admin_publics(ADMIN_PUB, source="admin.pub")
FED = "f" * 64
NOW = 1_800_000_000.0


def test_the_admins_token_verifies_and_names_the_key() -> None:
    token = issue_token(ADMIN, audience=FED, now=NOW)
    assert verify_token(token, KEYS, audience=FED, now=NOW + 10) == verify_token(token, KEYS, audience=FED, now=NOW)


@pytest.mark.parametrize(("token_now", "check_now", "audience", "reason"), [
    (NOW, NOW, "0" * 64, "another federation"),
    (NOW - 3600, NOW, FED, "expired"),
    (NOW + 3600, NOW, FED, "not valid yet"),
])
def test_a_token_for_another_federation_or_time_is_refused(token_now: float, check_now: float, audience: str,
                                                          reason: str) -> None:
    token = issue_token(ADMIN, audience=audience, now=token_now)
    with pytest.raises(CredentialError, match=reason):
        verify_token(token, KEYS, audience=FED, now=check_now)


def test_a_token_signed_by_another_key_is_refused() -> None:
    token = issue_token(Ed25519PrivateKey.generate(), audience=FED, now=NOW)
    with pytest.raises(CredentialError, match="not signed by a key this federation trusts"):
        verify_token(token, KEYS, audience=FED, now=NOW)


def test_a_rotated_key_file_accepts_each_listed_key() -> None:
    _, other_pub = generate_admin_key()
    other = load_admin_publics(other_pub, source="x")
    both = load_admin_publics(ADMIN_PUB + other_pub, source="both")
    token = issue_token(ADMIN, audience=FED, now=NOW)
    verify_token(token, both, audience=FED, now=NOW)
    with pytest.raises(CredentialError):
        verify_token(token, other, audience=FED, now=NOW)


@settings(max_examples=300, deadline=None)
@given(position=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255))
def test_any_edited_character_of_a_token_is_refused(position: int, flip: int) -> None:
    token = issue_token(ADMIN, audience=FED, now=NOW)
    i = position % len(token)
    edited = token[:i] + chr((ord(token[i]) + flip) % 128 or 1) + token[i + 1:]
    if edited == token:
        return
    with pytest.raises(CredentialError):
        verify_token(edited, KEYS, audience=FED, now=NOW)


def _zip(files: dict[str, bytes]) -> bytes:
    """A bundle as an attacker zips it (Flower's builder would refuse some of the edits below)."""
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return archive.getvalue()


def test_a_signed_bundle_verifies_and_keeps_every_file() -> None:
    files = {"pyproject.toml": app_pyproject(), "extra/module.py": b"x = 1\n"}
    signature = verify_app(build_fab(files, admin_key=ADMIN).content, KEYS)
    assert signature.files == files


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_edit_to_a_signed_bundle_is_refused(data: st.DataObject) -> None:
    files = {"pyproject.toml": app_pyproject(), "extra/module.py": b"x = 1\n"}
    files[SIGNATURE_FILE] = sign_app(files, ADMIN, now=NOW)
    action = data.draw(st.sampled_from(["edit", "add", "remove", "resign"]))
    if action == "edit":
        name = data.draw(st.sampled_from(sorted(files)))
        content = bytearray(files[name])
        i = data.draw(st.integers(0, len(content) - 1))
        content[i] ^= data.draw(st.integers(1, 255))
        files[name] = bytes(content)
    elif action == "add":
        files[data.draw(st.sampled_from(["evil.py", "extra/evil.py", "README.md"]))] = b"import os\n"
    elif action == "remove":
        del files["extra/module.py"]
    else:  # the attacker re-signs with its own key
        del files[SIGNATURE_FILE]
        files[SIGNATURE_FILE] = sign_app(files, Ed25519PrivateKey.generate(), now=NOW)
    with pytest.raises(CredentialError):
        verify_app(_zip(files), KEYS)


def test_an_unsigned_or_broken_bundle_is_refused_with_the_reason() -> None:
    with pytest.raises(CredentialError, match="not signed by the federation admin"):
        verify_app(_zip({"pyproject.toml": app_pyproject()}), KEYS)
    with pytest.raises(CredentialError, match="not a readable zip"):
        verify_app(b"PK\x03\x04 not a zip", KEYS)
    with pytest.raises(CredentialError, match="malformed"):
        verify_app(_zip({"pyproject.toml": app_pyproject(), SIGNATURE_FILE: b"{}"}), KEYS)


def _fused(fab: bytes, overrides: dict[str, object]) -> dict[str, object]:
    """What Flower hands the ClientApp: the bundle's config with the run's overrides on top."""
    from flwr.common.config import get_fused_config_from_fab
    from flwr.supercore.run import Run

    run = Run.create_empty(run_id=1)
    run.override_config = dict(overrides)  # type: ignore[assignment]
    return dict(get_fused_config_from_fab(fab, run))


def test_the_node_accepts_the_signed_config_and_refuses_any_override() -> None:
    config = {**DEFAULTS, "secure-aggregation": "masking", "num-rounds": 3}
    fab = build_fab({"pyproject.toml": app_pyproject(config)}, admin_key=ADMIN).content
    check_run(fab, _fused(fab, {}), ADMIN_PUB)
    for key, value in [("secure-aggregation", "none"), ("dp", "local"), ("num-rounds", 4)]:
        with pytest.raises(CredentialError, match=f"run config differs from the one the admin signed \\({key}\\)"):
            check_run(fab, _fused(fab, {key: value}), ADMIN_PUB)


def test_the_signature_file_cannot_smuggle_extra_fields() -> None:
    files = {"pyproject.toml": app_pyproject()}
    record = json.loads(sign_app(files, ADMIN, now=time.time()))
    record["files"]["evil.py"] = "0" * 64  # claims a file the signature does not cover
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pyproject.toml", files["pyproject.toml"])
        z.writestr(SIGNATURE_FILE, json.dumps(record, sort_keys=True, separators=(",", ":")))
    with pytest.raises(CredentialError, match="does not verify"):
        verify_app(archive.getvalue(), KEYS)


def test_a_call_bound_token_names_its_call_and_lives_at_most_five_minutes() -> None:
    from quorumfl.privacy.admin import TOKEN_TTL_S, call_digest

    call = call_digest("POST", "/v1/control/list-runs", b"")
    verified = verify_token(issue_token(ADMIN, audience=FED, now=NOW, call=call), KEYS, audience=FED, now=NOW)
    assert verified.call == call and len(verified.nonce) == 24
    with pytest.raises(CredentialError, match="invalid lifetime"):
        verify_token(issue_token(ADMIN, audience=FED, now=NOW, ttl=TOKEN_TTL_S + 1, call=call), KEYS, audience=FED,
                     now=NOW)
    with pytest.raises(CredentialError, match="invalid lifetime"):  # a session token: 8 hours at most
        verify_token(issue_token(ADMIN, audience=FED, now=NOW, ttl=9 * 3600), KEYS, audience=FED, now=NOW)
    assert verify_token(issue_token(ADMIN, audience=FED, now=NOW, ttl=8 * 3600), KEYS, audience=FED, now=NOW).call == ""


def test_a_nonce_is_claimed_once_while_its_token_lives() -> None:
    from quorumfl.privacy.admin import TokenNonces

    nonces = TokenNonces()
    token = verify_token(issue_token(ADMIN, audience=FED, now=NOW, call="c" * 64), KEYS, audience=FED, now=NOW)
    nonces.claim(token, now=NOW)
    with pytest.raises(CredentialError, match="already used"):
        nonces.claim(token, now=NOW + 200)
    nonces.claim(verify_token(issue_token(ADMIN, audience=FED, now=NOW, call="c" * 64), KEYS, audience=FED, now=NOW),
                 now=NOW)  # another token for the same call: its own nonce
