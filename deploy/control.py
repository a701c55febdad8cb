"""Client of the SuperLink's Control API: submit, list and stop runs of the QuorumFL app; list,
register and unregister SuperNode keys.

Submitting a run is what ``flwr run`` does: build a FAB (Flower app bundle) and call StartRun. The
QuorumFL code is installed on every SuperNode and on the SuperLink side, so the FAB carries only the
app's ``pyproject.toml`` (components and default run config) — a few hundred bytes.

With the admin's key (``admin_key``) every call carries a fresh admin-signed token (the SuperLink's
Control API refuses calls without one, ``admin_access``), and a submitted bundle is signed: the
run's whole config goes inside the signed ``pyproject.toml`` and no override travels beside it, so
nodes can check that they run exactly what the admin approved (``quorumfl.deploy.app_guard``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import httpx
import tomli_w
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.cli.build import build_fab_from_files
from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
from flwr.common.serde import fab_to_proto, user_config_to_proto
from flwr.proto.control_pb2 import (
    ListNodesRequest,
    ListRunsRequest,
    RegisterNodeRequest,
    StartRunRequest,
    StopRunRequest,
    UnregisterNodeRequest,
)
from flwr.supercore.control import ControlHttpClient
from flwr.supercore.fab import Fab
from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

from quorumfl.deploy.certs import Credentials, check_admin_key, roster_json, roster_version
from quorumfl.errors import ConfigError, CredentialError, FederationError
from quorumfl.privacy.admin import (
    SIGNATURE_FILE,
    call_digest,
    federation_id,
    issue_token,
    load_admin_private,
    run_stamp,
    sign_app,
)
from quorumfl.protocol.wire import ROSTER_KEY
from quorumfl.server.config import DEFAULTS, expand_auto_rounds

__all__ = ["Control", "FlowerNode", "FlowerRun", "app_pyproject", "build_fab", "sign_app_dir", "stamp_pyproject",
           "store_flwr_token"]


def app_pyproject(config: Mapping[str, Any] | None = None) -> bytes:
    """The Flower app manifest of QuorumFL (same components and defaults as the repo's pyproject);
    ``config``: the run config to carry instead of the defaults."""
    manifest = {
        "build-system": {"requires": ["setuptools"], "build-backend": "setuptools.build_meta"},
        "project": {
            "name": "quorumfl",
            "version": package_version("quorumfl"),
            "description": "QuorumFL federation app",
            "dependencies": [],
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "quorumfl",
                    "components": {
                        "serverapp": "quorumfl.server.app:app",
                        "clientapp": "quorumfl.client.app:app",
                    },
                    "config": dict(DEFAULTS if config is None else config),
                }
            }
        },
    }
    return tomli_w.dumps(manifest).encode()


def stamp_pyproject(pyproject: bytes, stamp: Mapping[str, Any], *, source: str = "pyproject.toml") -> bytes:
    """A Flower app manifest with ``stamp`` (``privacy.admin.run_stamp``) written into its run config."""
    import tomllib

    try:
        manifest = tomllib.loads(pyproject.decode())
        app = manifest["tool"]["flwr"]["app"]
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{source} is not a Flower app manifest with a [tool.flwr.app] table ({exc})") from exc
    app["config"] = {**app.get("config", {}), **stamp}
    return tomli_w.dumps(manifest).encode()


def build_fab(files: Mapping[str, bytes] | None = None, *, admin_key: Ed25519PrivateKey | None = None) -> Fab:
    """A Flower app bundle: QuorumFL's manifest, or the given files (``pyproject.toml`` + code);
    signed by ``admin_key`` when given."""
    content = dict(files) if files is not None else {"pyproject.toml": app_pyproject()}
    if admin_key is not None:
        content[SIGNATURE_FILE] = sign_app(content, admin_key, now=time.time())
    fab_bytes, _ = build_fab_from_files(content)
    return Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})


class _AdminToken:
    """Adds a fresh admin-signed bearer token, bound to the call (method, path and body), to every
    Control API call."""

    def __init__(self, key: Ed25519PrivateKey, audience: str) -> None:
        self.key, self.audience = key, audience

    def intercept(self, context: Any, call_next: Any) -> Any:
        request = context.request
        call = call_digest(request.method, request.url.path, request.content)
        token = issue_token(self.key, audience=self.audience, now=time.time(), call=call)
        context.request.headers["Authorization"] = f"Bearer {token}"
        return call_next(context)


@dataclass(frozen=True)
class FlowerRun:
    run_id: int
    status: str
    sub_status: str
    details: str


@dataclass(frozen=True)
class FlowerNode:
    node_id: int
    name: str
    status: str
    public_key: bytes


class Control:
    """Thin typed wrapper over Flower's Control API HTTP client."""

    def __init__(self, address: str, *, insecure: bool = True, root_certificates: str | None = None,
                 admin_key: Path | None = None, roster: Callable[[], str] | None = None,
                 roster_version: Callable[[], int] | None = None) -> None:
        """``root_certificates``: path of the CA certificate that signed the SuperLink's TLS
        certificate (with ``insecure=False``); ``admin_key``: the admin's private key, which signs a
        token for every call and every submitted bundle (needs ``root_certificates``: the token names
        the federation by its CA); ``roster``: gives the admin's current roster of departments
        (``certs.roster_json``), written into every run it signs; ``roster_version``: its version
        (``certs.roster_version``), stamped with a fresh nonce and an expiry into every run it signs."""
        self.address = address
        self.roster = roster
        self.roster_version = roster_version
        self.insecure = insecure
        self.root_certificates = root_certificates
        self._admin: Ed25519PrivateKey | None = None
        self._interceptors: list[Any] = [CliClientHttpInterceptor(),
                                         RuntimeVersionHttpInterceptor(component_name="flwr CLI")]
        if admin_key is not None:
            if root_certificates is None:
                raise CredentialError("an admin key needs the federation CA certificate (the token names the federation)")
            try:
                self._admin = load_admin_private(admin_key.read_bytes(), source=str(admin_key))
                audience = federation_id(Path(root_certificates).read_bytes())
            except OSError as exc:
                raise CredentialError(f"cannot read {exc.filename}: {exc.strerror}; the admin's files live in the "
                                      "credentials folder ('quorumfl certs init')") from exc
            self._interceptors.append(_AdminToken(self._admin, audience))

    @classmethod
    def for_federation(cls, address: str, creds: Credentials | None) -> Control:
        """The client a federation's own tooling uses: TLS against its CA, and the admin's key and
        current roster when the admin key is on this machine (``creds=None``: an insecure federation)."""
        if creds is None:
            return cls(address)
        admin = creds.admin_key if creds.admin_key.exists() else None
        return cls(address, insecure=False, root_certificates=str(creds.ca_cert), admin_key=admin,
                   roster=lambda: roster_json(creds), roster_version=lambda: roster_version(creds))

    @contextmanager
    def _client(self) -> Iterator[Any]:
        try:
            # What flwr's CLI builds, minus its account-login plugin and its banner on every call.
            client = ControlHttpClient.from_server_address(
                server_address=self.address,
                insecure=self.insecure,
                root_certificates=self.root_certificates,
                interceptors=list(self._interceptors),
            )
        except Exception as exc:
            raise FederationError(f"cannot connect to the SuperLink at {self.address}: {exc}") from exc
        try:
            yield client
        except FederationError:
            raise
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == httpx.codes.UNAUTHORIZED:
                raise CredentialError(
                    f"the SuperLink at {self.address} refused the call: it obeys only calls signed with the "
                    "federation admin's key (HOME/certs/admin.key on the admin's machine)") from exc
            raise FederationError(f"SuperLink Control API at {self.address} failed: {exc}") from exc
        except Exception as exc:
            raise FederationError(
                f"SuperLink Control API at {self.address} failed: {exc.__class__.__name__}: {exc}; "
                "is 'quorumfl server start' running there?"
            ) from exc
        finally:
            client.close()

    def start_run(self, overrides: Mapping[str, Any], *, files: Mapping[str, bytes] | None = None) -> int:
        """Submit a run of the QuorumFL app (or of the app made of ``files``: ``pyproject.toml`` +
        code). With the admin key the bundle is signed for this one run, and QuorumFL's run config
        travels inside it."""
        return self.submit(self.start_request(overrides, files=files))

    def start_request(self, overrides: Mapping[str, Any], *, files: Mapping[str, bytes] | None = None
                      ) -> StartRunRequest:
        """The StartRun request ``start_run`` sends (signed, with a fresh run stamp, given the admin key)."""
        overrides = expand_auto_rounds(overrides)  # the nodes check numbers, not "auto"
        if self._admin is not None and files is None:
            unknown = sorted(set(overrides) - set(DEFAULTS))
            if unknown:
                raise ConfigError(f"unknown run-config key(s) {', '.join(unknown)}; 'quorumfl runs start --help' "
                                  "lists the keys")
            config = {**DEFAULTS, **overrides}
            if self.roster is not None and not config.get(ROSTER_KEY):
                config[ROSTER_KEY] = self.roster()
            files, overrides = {"pyproject.toml": app_pyproject({**config, **self._stamp()})}, {}
        elif self._admin is not None and overrides:
            raise ConfigError("a signed custom app carries its config in its pyproject.toml; pass no overrides")
        elif self._admin is not None and files is not None:
            files = {**files, "pyproject.toml": stamp_pyproject(files.get("pyproject.toml", b""), self._stamp())}
        return StartRunRequest(fab=fab_to_proto(build_fab(files, admin_key=self._admin)),
                               override_config=user_config_to_proto(overrides), federation="")

    def submit(self, request: StartRunRequest) -> int:
        """Send a StartRun request; the new Flower run's id."""
        with self._client() as client:
            response = client.StartRun(request)
        if not response.HasField("run_id"):
            raise FederationError(f"the SuperLink at {self.address} did not start the run")
        return int(response.run_id)

    def _stamp(self) -> dict[str, str | int]:
        """A fresh nonce, expiry and roster version for one signed run (nodes serve it once)."""
        return run_stamp(now=time.time(), roster_version=self.roster_version() if self.roster_version else 0)

    def stop_run(self, run_id: int) -> None:
        with self._client() as client:
            response = client.StopRun(StopRunRequest(run_id=run_id))
        if not getattr(response, "success", True):
            raise FederationError(f"the SuperLink refused to stop run {run_id} (already finished?)")

    def list_runs(self, run_id: int | None = None) -> list[FlowerRun]:
        request = ListRunsRequest(run_id=run_id) if run_id is not None else ListRunsRequest()
        with self._client() as client:
            response = client.ListRuns(request)
        return [
            FlowerRun(int(key), run.status.status, run.status.sub_status, run.status.details)
            for key, run in response.run_dict.items()
        ]

    def run_finished(self, run_id: int) -> bool:
        """True once the SuperLink reports the run as finished (or does not know it)."""
        runs = self.list_runs(run_id)
        return not runs or runs[0].status == "finished"

    def online_nodes(self) -> list[int]:
        """Ids of the SuperNodes the SuperLink currently sees online."""
        with self._client() as client:
            response = client.ListNodes(ListNodesRequest())
        return [int(n.node_id) for n in response.nodes_info if n.status == "online"]

    def nodes(self) -> list[FlowerNode]:
        """Every SuperNode the SuperLink knows (registered keys and their status)."""
        with self._client() as client:
            response = client.ListNodes(ListNodesRequest())
        return [FlowerNode(int(n.node_id), n.name if n.HasField("name") else "", n.status, bytes(n.public_key))
                for n in response.nodes_info]

    def register_node(self, public_key: bytes, name: str) -> int:
        """Register a SuperNode's public key (PEM SubjectPublicKeyInfo); returns its node id."""
        with self._client() as client:
            response = client.RegisterNode(RegisterNodeRequest(public_key=public_key, name=name))
        if not response.node_id:
            raise FederationError(f"the SuperLink at {self.address} did not register node {name!r}")
        return int(response.node_id)

    def unregister_node(self, node_id: int) -> None:
        with self._client() as client:
            client.UnregisterNode(UnregisterNodeRequest(node_id=node_id))


def store_flwr_token(creds: Credentials, superlink: str, *, ttl: float) -> Path:
    """An admin-signed token for ``superlink`` in Flower's credential store, where Flower's ``flwr``
    CLI looks for account tokens (as an OIDC login would leave them); returns the store's path."""
    from flwr.cli.constant import (
        ACCESS_TOKEN_STORE_KEY,
        AUTHN_TYPE_STORE_KEY,
        REFRESH_TOKEN_STORE_KEY,
    )
    from flwr.common.constant import AuthnType
    from flwr.supercore.credential_store.file_credential_store import FileCredentialStore
    from flwr.supercore.utils import get_flwr_home

    check_admin_key(creds)
    key = load_admin_private(creds.admin_key.read_bytes(), source=str(creds.admin_key))
    token = issue_token(key, audience=federation_id(creds.ca_cert.read_bytes()), now=time.time(), ttl=ttl)
    path = get_flwr_home() / "credentials.yaml"
    store = FileCredentialStore(path)
    store.set(AUTHN_TYPE_STORE_KEY % superlink, AuthnType.OIDC.encode())
    store.set(ACCESS_TOKEN_STORE_KEY % superlink, token.encode())
    store.set(REFRESH_TOKEN_STORE_KEY % superlink, b"none")  # the SuperLink refreshes nothing; log in again
    return path


def _app_config(manifest: Path) -> dict[str, Any]:
    import tomllib

    try:
        config = tomllib.loads(manifest.read_text())["tool"]["flwr"]["app"].get("config", {})
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError):
        return {}  # stamp_pyproject says what is wrong with it
    return config if isinstance(config, dict) else {}


def sign_app_dir(directory: Path, creds: Credentials) -> Path:
    """Sign the Flower app in ``directory`` for one ``flwr run DIRECTORY`` (without ``-c``: the run
    config is the one in its pyproject.toml): a fresh run nonce, expiry and roster version (and, for
    QuorumFL's app, the departments' current keys as its roster) are first written into that config
    (nodes serve a signed run once: sign again for the next run), and the
    signature covers the files exactly as Flower's builder puts them in the bundle, written as
    ``directory/quorumfl-signature.json``."""
    import io
    import zipfile

    from flwr.cli.utils import collect_files

    check_admin_key(creds)
    key = load_admin_private(creds.admin_key.read_bytes(), source=str(creds.admin_key))
    if not (directory / "pyproject.toml").is_file():
        raise ConfigError(f"{directory} holds no pyproject.toml; point at a Flower app directory")
    manifest = directory / "pyproject.toml"
    stamp = run_stamp(now=time.time(), roster_version=roster_version(creds))
    if ROSTER_KEY in _app_config(manifest):  # QuorumFL's app: the departments' keys now, as 'runs start' signs them
        stamp[ROSTER_KEY] = roster_json(creds)
    manifest.write_bytes(stamp_pyproject(manifest.read_bytes(), stamp, source=str(manifest)))
    files = {name: path for name, path in collect_files(directory).items() if name != SIGNATURE_FILE}
    fab, _ = build_fab_from_files(files)
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        content = {i.filename: archive.read(i) for i in archive.infolist() if i.filename != ".info/CONTENT"}
    target = directory / SIGNATURE_FILE
    target.write_bytes(sign_app(content, key, now=time.time()))
    return target
