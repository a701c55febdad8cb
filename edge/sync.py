"""The edge device's side of model sync: pull the newest artifact of a channel, verify it, swap it in.

Device folder::

    DIR/installed.json          current and previous artifact (signed manifest + signature), replaced atomically
    DIR/v7.onnx, DIR/v6.onnx    the current and the previous artifact (older ones are removed)
    DIR/.partial/v8.onnx.part   a download in progress, with v8.onnx.json (the manifest it belongs to);
                                v8.onnx.from-v7.part/.json for a delta against v7, v8.onnx.z.part/.json
                                for the whole file as a zlib stream
    DIR/trust.json              signing keys this device moved to after rotations (their endorsements)

A sync first follows the server's signing-key chain from the newest key the device trusts (the
``--public-key`` it was given, or a key it moved to since: ``quorumfl.edge.keychain``), verifies the
manifest's Ed25519 signature with the newest key only, and records the keys it moved to; then,
before downloading anything, it refuses a version that is not newer, downloads only the delta
against the version it holds when the server offers deltas (``quorumfl.edge.delta``; the whole
artifact, zlib-compressed, when it holds none, the server cannot make one, or a delta of this
version was refused before; uncompressed from a server that predates deltas),
resumes a broken download from the bytes already on disk (when they belong to the same signed
manifest), rebuilds and checks size and SHA-256 of the complete file and that the runtime can load
it, and only then renames it into place and rewrites ``installed.json``. Whatever fails, the
installed model stays as it was.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from quorumfl.core.files import atomic_write
from quorumfl.edge import delta, sync_pb2, sync_pb2_grpc
from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.keychain import (
    Endorsement,
    follow,
    from_json,
    raw_public_key,
    to_json,
    trusted_keys,
)
from quorumfl.edge.manifest import Channel, Manifest, check_newer, check_payload
from quorumfl.edge.runtime import EdgeModel, load_model
from quorumfl.edge.signing import load_public_key, verifies, verify
from quorumfl.errors import ArtifactError, ConfigError

__all__ = ["Installed", "SyncResult", "installed", "load_current", "rollback", "sync"]

STATE = "installed.json"
PARTIAL = ".partial"
TRUST = "trust.json"
_REFUSED = ".delta-refused"  # marks a version whose delta was refused: fetch it whole next time
_NO_DELTA = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INVALID_ARGUMENT)


@dataclass(frozen=True)
class Signed:
    manifest: Manifest
    raw: bytes
    signature: bytes

    def to_json(self) -> dict[str, str]:
        return {"manifest": self.raw.decode(), "signature": self.signature.hex()}

    @classmethod
    def from_json(cls, body: Any) -> Signed:
        try:
            raw, signature = body["manifest"].encode(), bytes.fromhex(body["signature"])
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ArtifactError(f"installed-artifact record is damaged ({exc})") from None
        return cls(Manifest.from_bytes(raw), raw, signature)


@dataclass(frozen=True)
class Installed:
    current: Signed | None
    previous: Signed | None


@dataclass(frozen=True)
class SyncResult:
    status: str  # "updated", "up-to-date" or "none" (the channel has no artifact of this format)
    version: int | None
    previous: int | None
    downloaded_bytes: int
    resumed_from: int
    delta_from: int | None = None  # the installed version the download was a delta against


def installed(directory: Path) -> Installed:
    path = directory / STATE
    if not path.exists():
        return Installed(None, None)
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is unreadable ({exc}); remove the folder and sync again") from exc
    current = Signed.from_json(body["current"]) if body.get("current") else None
    previous = Signed.from_json(body["previous"]) if body.get("previous") else None
    return Installed(current, previous)


def _write_state(directory: Path, state: Installed) -> None:
    body = {"current": state.current.to_json() if state.current else None,
            "previous": state.previous.to_json() if state.previous else None}
    atomic_write(directory / STATE, json.dumps(body, indent=1).encode())


def _prune(directory: Path, state: Installed) -> None:
    keep = {s.manifest.file_name for s in (state.current, state.previous) if s is not None}
    for path in directory.glob("v*.*"):
        if path.name not in keep and path.suffix in (".onnx", ".pte"):
            path.unlink(missing_ok=True)


def accepted_keys(directory: Path, root: bytes) -> list[Endorsement]:
    """The endorsements this device accepted since it was given the key ``root`` (raw bytes),
    re-verified from ``root``; ``[]`` before the first rotation."""
    path = directory / TRUST
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text())
        recorded_root = bytes.fromhex(body["root"])
        accepted = from_json(body["endorsements"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArtifactError(f"{path} is unreadable ({exc}); sync into a fresh --dir") from exc
    if recorded_root != root:
        raise ConfigError(f"{directory} follows the signing keys of another --public-key; pass the key this folder "
                          "was first synced with, or sync into a fresh --dir")
    trusted_keys(root, accepted)  # a damaged or edited record is refused, never believed
    return accepted


def _record_keys(directory: Path, root: bytes, accepted: list[Endorsement]) -> None:
    body = {"root": root.hex(), "endorsements": to_json(accepted)}
    atomic_write(directory / TRUST, json.dumps(body, indent=1).encode())


def _verify_manifest(raw: bytes, signature: bytes, keys: list[bytes]) -> None:
    """Verify with the newest of ``keys``; name a retired key that signed it, for the operator."""
    if verifies(keys[-1], raw, signature):
        return
    retired = next((number for number, old in enumerate(keys[:-1]) if verifies(old, raw, signature)), None)
    if retired is not None:
        raise ArtifactError(f"the manifest is signed by a signing key this device has retired (key {retired} of "
                            f"{len(keys) - 1}); it is refused and the installed model kept")
    verify(Ed25519PublicKey.from_public_bytes(keys[-1]), raw, signature)  # raises the usual refusal


def _has_file(directory: Path, signed: Signed | None) -> bool:
    return signed is not None and (directory / signed.manifest.file_name).is_file()


def _channel(server: str, ca_cert: Path | None) -> grpc.Channel:
    if ca_cert is None:
        return grpc.insecure_channel(server)
    try:
        roots = ca_cert.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--ca-cert {ca_cert} is unreadable ({exc.strerror or exc})") from exc
    return grpc.secure_channel(server, grpc.ssl_channel_credentials(root_certificates=roots))


def _rpc_error(exc: grpc.RpcError, what: str, server: str) -> ArtifactError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return ArtifactError(f"{what} from {server} failed ({code.name if code else 'error'}: {details}); "
                         "the installed model is unchanged")


class _NoDelta(Exception):
    """The server cannot make the delta (base version gone or damaged): download the whole artifact."""


def _download(stub: Any, signed: Signed, directory: Path, *, timeout: float, server: str,
              base: Signed | None = None, compressed: bool = False) -> tuple[bytes, int, int]:
    """Fetch the artifact into ``.partial`` (resuming), returning (payload, bytes fetched, resume
    offset). With ``base`` (the installed artifact) fetch its delta instead and rebuild the artifact
    from it (``quorumfl.edge.delta``); with ``compressed`` the artifact as a zlib stream (a delta
    against nothing); either way the result is checked against the signed manifest."""
    m = signed.manifest
    partial = directory / PARTIAL
    partial.mkdir(exist_ok=True)
    suffix = f".from-v{base.manifest.version}" if base is not None else ".z" if compressed else ""
    part, owner = partial / f"{m.file_name}{suffix}.part", partial / f"{m.file_name}{suffix}.json"
    encoded = base is not None or compressed
    # a zlib stream's length is known only at its end; its worst case is a few bytes over its input
    limit = m.size + m.size // 64 + 1024 if encoded else m.size
    offset = 0
    if part.exists() and owner.exists() and owner.read_bytes() == signed.raw:
        offset = part.stat().st_size
        if offset > limit:
            offset = 0
    if offset == 0:
        for stale in partial.iterdir():
            if not stale.name.endswith(_REFUSED):
                stale.unlink()
        atomic_write(owner, signed.raw)
        part.write_bytes(b"")
    start, fetched = offset, 0
    if encoded or offset < m.size:
        request = sync_pb2.DownloadRequest(version=m.version, format=m.format.value, offset=offset,
                                           base_version=base.manifest.version if base is not None else 0,
                                           compressed=compressed and base is None)
        with open(part, "r+b") as fh:
            fh.truncate(offset)
            fh.seek(offset)
            try:
                for chunk in stub.Download(request, timeout=timeout):
                    if chunk.offset != offset or offset + len(chunk.data) > limit:
                        raise ArtifactError(f"server sent bytes {chunk.offset}..{chunk.offset + len(chunk.data)} of "
                                            f"v{m.version} where {offset} was expected; the download is refused")
                    fh.write(chunk.data)
                    offset += len(chunk.data)
                    fetched += len(chunk.data)
            except grpc.RpcError as exc:
                fh.flush()
                os.fsync(fh.fileno())
                code = exc.code() if hasattr(exc, "code") else None
                if base is not None and code in _NO_DELTA:
                    part.unlink(missing_ok=True)
                    owner.unlink(missing_ok=True)
                    raise _NoDelta(str(code)) from None
                # OUT_OF_RANGE past a delta's first byte: all of it was on disk already (a sync that
                # stopped before rebuilding), so rebuild it now
                if not (encoded and code is grpc.StatusCode.OUT_OF_RANGE and offset > 0):
                    raise ArtifactError(
                        f"download of v{m.version} broke off at byte {offset} of "
                        f"{'its delta' if base is not None else 'its zlib stream' if compressed else m.size} "
                        f"({code.name if code else 'error'}); "
                        "run the sync again to resume from there; the installed model is unchanged"
                    ) from None
            fh.flush()
            os.fsync(fh.fileno())
    try:
        payload = part.read_bytes()
        if base is not None:
            held = (directory / base.manifest.file_name).read_bytes()
            check_payload(base.manifest, held)
            payload = delta.decode(payload, held, m.size)
        elif compressed:
            payload = delta.decode(payload, b"", m.size)
        check_payload(m, payload)
    except ArtifactError:
        part.unlink(missing_ok=True)
        owner.unlink(missing_ok=True)
        if base is not None:  # the next sync downloads the whole artifact instead
            (partial / f"{m.file_name}{_REFUSED}").write_bytes(b"")
        raise
    if encoded:  # the rebuilt artifact takes the place a plain download would have
        atomic_write(partial / f"{m.file_name}.part", payload)
        part.unlink(missing_ok=True)
        owner.unlink(missing_ok=True)
    return payload, fetched, start


def sync(
    server: str,
    directory: Path,
    *,
    channel: Channel,
    fmt: ArtifactFormat = ArtifactFormat.ONNX,
    public_key: Path,
    ca_cert: Path | None = None,
    timeout: float = 60.0,
) -> SyncResult:
    """One sync against ``server`` (HOST:PORT); see the module docstring for what is checked."""
    root = raw_public_key(load_public_key(public_key))
    directory.mkdir(parents=True, exist_ok=True)
    accepted = accepted_keys(directory, root)
    state = installed(directory)
    if state.current is not None and (state.current.manifest.channel, state.current.manifest.format) != (channel, fmt):
        held = state.current.manifest
        raise ConfigError(f"{directory} holds a {held.channel}/{held.format} model; sync {channel}/{fmt} into "
                          "another --dir (one folder per channel and format)")
    current_version = state.current.manifest.version if state.current else 0
    with _channel(server, ca_cert) as grpc_channel:
        stub = sync_pb2_grpc.ModelSyncStub(grpc_channel)  # type: ignore[no-untyped-call]
        try:
            reply = stub.GetManifest(sync_pb2.ManifestRequest(
                channel=channel.value, format=fmt.value, current_version=current_version), timeout=timeout)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, "manifest request", server) from None
        if not reply.available:
            return SyncResult("none", None, None, 0, 0)
        raw, signature = bytes(reply.manifest), bytes(reply.signature)
        chain = [Endorsement.parse(bytes(e.statement), bytes(e.signature)) for e in reply.key_chain]
        moved = follow(accepted[-1].public_key if accepted else root, chain)
        keys = trusted_keys(root, [*accepted, *moved])
        _verify_manifest(raw, signature, keys)  # before trusting a single field of it
        if moved:  # the newest key signed this manifest: the device moves to it for good
            _record_keys(directory, root, [*accepted, *moved])
        offered = Signed(Manifest.from_bytes(raw), raw, signature)
        if not check_newer(offered.manifest, state.current.manifest if state.current else None,
                           channel=channel, fmt=fmt):
            return SyncResult("up-to-date", current_version or None, None, 0, 0)
        base = state.current if reply.deltas and _has_file(directory, state.current) else None
        if base is not None and (directory / PARTIAL / f"{offered.manifest.file_name}{_REFUSED}").exists():
            base = None
        try:
            payload, fetched, resumed = _download(stub, offered, directory, timeout=timeout, server=server, base=base,
                                                  compressed=reply.deltas)
        except _NoDelta:
            base = None
            payload, fetched, resumed = _download(stub, offered, directory, timeout=timeout, server=server,
                                                  compressed=reply.deltas)
    load_model(payload, fmt, offered.manifest.input_shape, input_dtype=offered.manifest.input_dtype)  # refuse a file the runtime cannot load
    partial = directory / PARTIAL
    os.replace(partial / f"{offered.manifest.file_name}.part", directory / offered.manifest.file_name)
    (partial / f"{offered.manifest.file_name}.json").unlink(missing_ok=True)
    (partial / f"{offered.manifest.file_name}{_REFUSED}").unlink(missing_ok=True)
    new_state = Installed(offered, state.current)
    _write_state(directory, new_state)
    _prune(directory, new_state)
    return SyncResult("updated", offered.manifest.version, current_version or None, fetched, resumed,
                      base.manifest.version if base is not None else None)


def rollback(directory: Path) -> Installed:
    """Make the previous artifact current again (the current one becomes previous)."""
    state = installed(directory)
    if state.previous is None or state.current is None:
        raise ArtifactError(f"{directory} has no previous artifact to roll back to")
    payload = (directory / state.previous.manifest.file_name).read_bytes()
    check_payload(state.previous.manifest, payload)
    swapped = Installed(state.previous, state.current)
    _write_state(directory, swapped)
    return swapped


def load_current(directory: Path, *, public_key: Path | None = None, threads: int = 1) -> tuple[Manifest, EdgeModel]:
    """The installed model, checked against its manifest (and signature, given the public key)."""
    state = installed(directory)
    if state.current is None:
        raise ArtifactError(f"{directory} holds no model yet; run 'quorumfl edge sync' first")
    if public_key is not None:  # signed by the key the device was given or one it moved to since
        root = raw_public_key(load_public_key(public_key))
        keys = trusted_keys(root, accepted_keys(directory, root))
        if not any(verifies(key, state.current.raw, state.current.signature) for key in keys):
            raise ArtifactError(f"the installed manifest in {directory} is not signed by --public-key {public_key} or "
                                "a key it endorsed; it is refused")
    m = state.current.manifest
    try:
        payload = (directory / m.file_name).read_bytes()
    except OSError as exc:
        raise ArtifactError(f"installed artifact {directory / m.file_name} is unreadable ({exc.strerror or exc})") from exc
    check_payload(m, payload)
    return m, load_model(payload, m.format, m.input_shape, threads=threads, input_dtype=m.input_dtype)
