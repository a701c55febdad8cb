"""The model-sync gRPC service that edge devices pull artifacts from (``quorumfl edge serve``).

Every call reads the registry afresh, so a newly promoted artifact is offered without a restart.
Downloads stream fixed-size chunks from the requested offset: of the artifact, of the artifact as one
zlib stream, or of its delta against an older version the device names (``quorumfl.edge.delta``).
A zlib stream costs CPU at level 9 (measured on this 2-core Xeon: 0.76 s for a 1.7 MB buffer of INT8
weights, half of them pruned to zero, and 0.99 s for its delta after a tenth of them moved by one
step), and a fleet of devices syncing after a promotion asks for the same few streams: each is
encoded once and kept in a cache of ``cache_bytes`` (least recently used out first), keyed by the
SHA-256 of the artifact and of the base it was encoded from, as their signed manifests give them.
The files are still read and checked against their signed manifests on every request, so a damaged
file is refused whatever the cache holds, and a replaced file is a new key. (A resumed download
relies on the same bytes for the same request: a cached stream is exactly what encoding again would
give, zlib being deterministic.) An offset outside what is streamed is refused with OUT_OF_RANGE, an unknown channel/format/version with INVALID_ARGUMENT/NOT_FOUND, a
file that no longer matches its signed manifest with DATA_LOSS (the server never streams bytes it
cannot vouch for). Every manifest goes out with the signing key's endorsement chain, read afresh
too, so devices given an older key move to the current one after ``edge keys rotate`` without a
restart of this service. TLS is optional (certificate and key PEM files).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from threading import Lock
from typing import Any

import grpc

from quorumfl.edge import delta, sync_pb2, sync_pb2_grpc
from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.keychain import Endorsement
from quorumfl.edge.manifest import Channel
from quorumfl.edge.registry import Registry
from quorumfl.errors import ArtifactError, ConfigError, NotFoundError
from quorumfl.server.state.artifacts import ArtifactRecords

__all__ = ["SyncServer", "SyncService", "start_server"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
CACHE_BYTES = 256 * 1024 * 1024  # encoded streams kept (a pruned cnn-wide artifact: ~1 MB whole, ~0.2 MB a delta)


@dataclass
class SyncService(sync_pb2_grpc.ModelSyncServicer):
    records: ArtifactRecords
    chunk_bytes: int = CHUNK_BYTES
    key_chain: Callable[[], Sequence[Endorsement]] = list  # the signing key's endorsements, oldest first
    # (version, format, offset) of the last 1024 downloads started, for operators and tests
    downloads: deque[tuple[int, str, int]] = field(default_factory=lambda: deque(maxlen=1024))
    deltas: deque[int] = field(default_factory=lambda: deque(maxlen=1024))  # each download's base version (0: none)
    cache_bytes: int = CACHE_BYTES
    encoded: int = 0  # zlib streams encoded so far (a cached one is not counted again)
    _cache: OrderedDict[tuple[str, str], bytes] = field(default_factory=OrderedDict)
    _cached_bytes: int = 0
    _lock: Lock = field(default_factory=Lock)

    @staticmethod
    def _format(context: Any, fmt: str) -> ArtifactFormat:
        try:
            return ArtifactFormat(fmt)
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown format {fmt!r}; formats: onnx, pte")
            raise  # unreachable: abort raises

    @staticmethod
    def _channel(context: Any, channel: str) -> Channel:
        try:
            return Channel(channel)
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown channel {channel!r}; channels: stable, canary")
            raise

    def GetManifest(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC method name)
        channel, fmt = self._channel(context, request.channel), self._format(context, request.format)
        row = self.records.latest(channel.value, fmt.value)
        if row is None:
            return sync_pb2.ManifestReply(available=False, newer=False)
        return sync_pb2.ManifestReply(
            available=True, newer=row.version > request.current_version,
            manifest=row.manifest.encode(), signature=bytes.fromhex(row.signature),
            key_chain=[sync_pb2.KeyEndorsement(statement=e.statement, signature=e.signature) for e in self.key_chain()],
            deltas=True,
        )

    def _payload(self, context: Any, version: int, fmt: ArtifactFormat) -> tuple[bytes, str]:
        """The artifact's bytes, checked against its signed manifest, and the SHA-256 they were checked
        against (the cache's key: hashing them again would repeat that check's work)."""
        try:
            data, manifest = Registry.checked_payload(self.records.get(version, fmt.value))
            return data, manifest.sha256
        except NotFoundError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise
        except ArtifactError as exc:
            log.error("refusing to serve artifact v%s (%s): %s", version, fmt.value, exc)
            context.abort(grpc.StatusCode.DATA_LOSS, f"the server's copy of v{version} is damaged")
            raise

    def _encode(self, payload: tuple[bytes, str], base: tuple[bytes, str] = (b"", "")) -> bytes:
        """``delta.encode`` of a checked payload against a checked base (none: the whole file), from the
        cache when these two files were encoded before; both come with their SHA-256 (``_payload``)."""
        key = (payload[1], base[1])
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        stream = delta.encode(payload[0], base[0])  # outside the lock: other downloads go on meanwhile
        with self._lock:
            self.encoded += 1
            if key not in self._cache and len(stream) <= self.cache_bytes:
                self._cache[key] = stream
                self._cached_bytes += len(stream)
                while self._cached_bytes > self.cache_bytes:
                    _, dropped = self._cache.popitem(last=False)
                    self._cached_bytes -= len(dropped)
        return stream

    def Download(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        fmt = self._format(context, request.format)
        checked = self._payload(context, int(request.version), fmt)
        payload = checked[0]
        base = int(request.base_version)
        if base:  # the delta against the version the device holds (the device checks what it rebuilds)
            if base >= int(request.version):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"base_version {base} is not older than {request.version}")
            payload = self._encode(checked, self._payload(context, base, fmt))
        elif request.compressed:  # the whole artifact, zlib-compressed: a delta against nothing
            payload = self._encode(checked)
        what = f"delta from v{base}" if base else "compressed artifact" if request.compressed else "artifact"
        if not 0 <= request.offset < len(payload):
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"offset {request.offset} is outside the {what} (0..{len(payload) - 1})")
        with self._lock:
            self.downloads.append((int(request.version), fmt.value, int(request.offset)))
            self.deltas.append(base)
        log.info("streaming %s of v%s (%s) from byte %s", what, request.version, fmt.value, request.offset)
        for start in range(int(request.offset), len(payload), self.chunk_bytes):
            yield sync_pb2.Chunk(offset=start, data=payload[start : start + self.chunk_bytes])


@dataclass
class SyncServer:
    server: grpc.Server
    service: SyncService
    port: int

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait()


def start_server(
    records: ArtifactRecords,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int = 8,
    service: SyncService | None = None,
    key_chain: Callable[[], Sequence[Endorsement]] = list,
) -> SyncServer:
    """Start serving on ``host:port`` (0 = a free port); returns the bound port. ``key_chain`` gives
    the signing key's endorsements (``quorumfl.edge.rotation.load_chain``). ``service`` replaces the
    default servicer (a subclass that, say, logs or throttles)."""
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together; pass both for TLS or neither")
    if chunk_bytes < 1:
        raise ConfigError(f"chunk size must be >= 1 byte, got {chunk_bytes}")
    service = service or SyncService(records, chunk_bytes=chunk_bytes, key_chain=key_chain)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    sync_pb2_grpc.add_ModelSyncServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    address = f"{host}:{port}"
    if tls_cert is not None and tls_key is not None:
        try:
            credentials = grpc.ssl_server_credentials([(tls_key.read_bytes(), tls_cert.read_bytes())])
        except OSError as exc:
            raise ConfigError(f"cannot read the TLS certificate/key ({exc})") from exc
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise ConfigError(f"cannot listen on {address}: the port is taken or the host is not local")
    server.start()
    return SyncServer(server, service, bound)
