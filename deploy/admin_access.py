"""Admin-only Control API: Flower's SuperLink with an account-authentication plugin that accepts only
tokens signed by the federation admin's Ed25519 key.

Flower 1.42 serves the Fleet, Control and Runtime APIs on one port, and its open package ships only
a no-op Control authentication plugin (its OIDC plugin is part of Flower Enterprise and needs an OIDC
provider). Every Control route already goes through the configured plugin
(``ControlAuthenticationMiddleware``), so QuorumFL supplies one: ``AdminTokenPlugin`` checks the
``Authorization: Bearer`` token with ``quorumfl.privacy.admin.verify_token`` against the admin's
public key(s) and the federation id (the CA certificate's SHA-256), and refuses everything else
with Flower's own 401 answer. In front of it, ``AdminCalls`` holds each token to the one call it was
signed for (method, path and body) and to one use; a session token for Flower's own CLI is accepted
for listing, logs and starting runs only. FastAPI's ``/openapi.json`` and ``/docs`` pages are
removed. The SuperLink never holds the admin's private key.

``python -m quorumfl.deploy.admin_access --admin-keys admin.pub <flower-superlink arguments>`` is the
SuperLink process (with ``--insecure`` too, without the keys): it makes the link state answer for
messages lost to a node's restart (``quorumfl.deploy.link_restarts``), it installs the plugin where Flower's CLI loads its own, keeps the Runtime API
(which Flower leaves unauthenticated in subprocess isolation) to this host's own processes
(``RuntimeFromThisHost``), holds SuperNodes' empty pulls until a message for them is ready
(``quorumfl.deploy.held_pulls``, ``QUORUMFL_PULL_HOLD_S``), then runs Flower's ``flower-superlink``
unchanged. A SuperLink started with TLS but without ``--admin-keys`` refuses
to start (fails closed); ``--insecure`` keeps Flower's no-op plugin, as documented for trusted
networks only.

Flower stacks eight ``BaseHTTPMiddleware`` layers in front of every route. Six of them act on one
API only (four on Control, two on Fleet) and pass every other request on untouched, yet each layer
still costs every request a task group and memory streams. With ten SuperNodes polling and
moving model updates that was most of the SuperLink's CPU: in a three-round plaintext run of ten
nodes on two cores it used 20-26 s of CPU with every layer and 12-15 s with the gate, and a round
took 7.4-9.8 s against 5.7-7.6 s. ``gate_middleware`` routes a request around such a
layer when its path belongs to another API (``/v1/fleet/`` or ``/v1/runtime/`` for the Control
layers; ``/v1/control/`` or ``/v1/runtime/`` for the Fleet ones): exactly the requests the layer
itself would pass on unchanged. Any other path, including ones no route serves, still goes
through every layer.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flwr.common.constant import ACCESS_TOKEN_KEY, NOOP_FLWR_AID
from flwr.supercore.auth.typing import AccountAuthCredentials, AccountAuthLoginDetails, AccountInfo
from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.superlink.auth_plugin import ControlAuthnPlugin

from quorumfl.deploy import held_pulls
from quorumfl.errors import CredentialError
from quorumfl.privacy.admin import (
    TokenNonces,
    call_digest,
    federation_id,
    load_admin_publics,
    verify_token,
)

__all__ = ["ADMIN_KEYS_FLAG", "AdminCalls", "AdminTokenPlugin", "PathGated", "RuntimeFromThisHost", "gate_middleware",
           "main", "runtime_hosts", "without_api_pages"]

ADMIN_KEYS_FLAG = "--admin-keys"
log = logging.getLogger(__name__)


class AdminTokenPlugin(ControlAuthnPlugin):
    """Control API authentication by admin-signed bearer tokens (no login flow: the admin's CLI
    signs a fresh token for every call)."""

    def __init__(self, admin_keys: bytes = b"", *, audience: str = "", source: str = "admin keys") -> None:
        self.keys = load_admin_publics(admin_keys, source=source)
        self.audience = audience

    def get_login_details(self) -> AccountAuthLoginDetails | None:
        raise FlowerError(ApiErrorCode.NO_ACCOUNT_AUTH,
                          "this SuperLink accepts only admin-signed tokens: use 'quorumfl' on the admin's machine, "
                          "or 'quorumfl admin flwr-login' before 'flwr'")

    def validate_tokens_in_metadata(
        self, metadata: Sequence[tuple[str, str | bytes]]
    ) -> tuple[bool, AccountInfo | None]:
        tokens = [v for k, v in metadata if k == ACCESS_TOKEN_KEY]
        if len(tokens) != 1:
            log.warning("Control API call without an admin token refused")
            return False, None
        token = tokens[0].decode("ascii", "replace") if isinstance(tokens[0], bytes) else tokens[0]
        try:
            signer = verify_token(token, self.keys, audience=self.audience, now=time.time()).key
        except CredentialError as exc:
            log.warning("Control API call refused: %s", exc)
            return False, None
        # One account, Flower's default one: runs and nodes keep the owner they have without a plugin.
        return True, AccountInfo(flwr_aid=NOOP_FLWR_AID, account_name=f"admin-{signer}")

    def get_auth_tokens(self, device_code: str) -> AccountAuthCredentials | None:
        raise FlowerError(ApiErrorCode.NO_ACCOUNT_AUTH, "this SuperLink issues no tokens; the admin signs them")

    def refresh_tokens(
        self, metadata: Sequence[tuple[str, str | bytes]]
    ) -> tuple[Sequence[tuple[str, str | bytes]] | None, AccountInfo | None]:
        return None, None


CONTROL_PREFIX = "/v1/control/"
SESSION_CALLS = frozenset({"/v1/control/list-runs", "/v1/control/list-nodes", "/v1/control/stream-logs",
                           "/v1/control/start-run"})  # what Flower's own CLI may do with a session token
MAX_CONTROL_BODY = 256 * 2**20
API_PAGES = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


async def _refuse(send: Any, status: int, reason: str) -> None:
    """Flower's own error answer (what its CLI reads): 401 as its authentication failure, with the reason."""
    code = ApiErrorCode.ACCOUNT_AUTHENTICATION_FAILED
    body = FlowerError(code, reason, public_details=reason).to_json("Authentication failed." if status == 401
                                                                     else "Request refused.")
    headers = [(b"content-type", b"application/json")] + ([(b"www-authenticate", b"Bearer")] if status == 401 else [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


class AdminCalls:
    """ASGI middleware in front of the Control API: a call goes on only with an admin token for that
    very call (its method, path and body: ``privacy.admin.call_digest``) that was never used before
    (``TokenNonces``), or with a session token (``quorumfl certs flwr-login``) for one of
    ``SESSION_CALLS``: listing runs and nodes, their logs, and starting a run (whose bundle each node
    checks against the admin's signature, once). Everything else gets 401 with the reason."""

    def __init__(self, app: Any, keys: Sequence[Any], audience: str) -> None:
        self.app, self.keys, self.audience = app, keys, audience
        self.nonces = TokenNonces()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not path.startswith(CONTROL_PREFIX):
            await self.app(scope, receive, send)
            return
        parts: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > MAX_CONTROL_BODY:
                await _refuse(send, 413, "Control API request too large")
                return
        body = b"".join(parts)
        try:
            self._check(scope, path, body)
        except CredentialError as exc:
            log.warning("Control API call to %s refused: %s", path, exc)
            await _refuse(send, 401, str(exc))
            return
        delivered = False

        async def replay() -> Any:
            nonlocal delivered
            if delivered:
                return await receive()  # the client disconnecting, as Starlette waits for it
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check(self, scope: Any, path: str, body: bytes) -> None:
        tokens = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        if len(tokens) != 1 or not tokens[0].startswith(b"Bearer "):
            raise CredentialError("no admin token")
        now = time.time()
        token = verify_token(tokens[0][7:].decode("ascii", "replace"), self.keys, audience=self.audience, now=now)
        if not token.call:
            if path not in SESSION_CALLS:
                raise CredentialError(f"a session token (flwr-login) is not accepted for {path}; use 'quorumfl'")
            return
        if token.call != call_digest(str(scope.get("method", "")), path, body):
            raise CredentialError("admin token is for another call")
        self.nonces.claim(token, now=now)


def without_api_pages(app: Any) -> Any:
    """The app without FastAPI's schema and documentation pages (they would describe the API to anyone)."""
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in API_PAGES]
    app.openapi_url = app.docs_url = app.redoc_url = None
    return app


class RuntimeFromThisHost:
    """ASGI middleware: the SuperLink's Runtime API (``/v1/runtime``) answers only the addresses its
    own SuperExec and ServerApp processes connect from. In Flower 1.42's subprocess isolation the
    Runtime API has no authentication of its own (its SuperExec secret applies to process isolation
    only), and it shares the public port: without this, anyone who reaches the port could acquire a
    pending ServerApp task and act as the run's server."""

    def __init__(self, app: Any, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith("/v1/runtime"):
            client = scope.get("client") or ("", 0)
            if client[0] not in self.allowed:
                log.warning("Runtime API call from %s refused (only this host's own processes may call it)", client[0])
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"the Runtime API serves this host only"})
                return
        await self.app(scope, receive, send)


class PathGated:
    """ASGI middleware: a request whose path starts with one of ``bypass`` goes straight to the next
    layer; every other request goes through ``inner`` (a middleware class built here over the same
    next layer)."""

    def __init__(self, app: Any, inner: Any, bypass: tuple[str, ...], args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None) -> None:
        self.app, self.bypass = app, bypass
        self.inner = inner(app, *args, **(kwargs or {}))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not scope.get("root_path") and str(scope.get("path", "")).startswith(self.bypass):
            await self.app(scope, receive, send)
        else:
            await self.inner(scope, receive, send)


_CONTROL_ONLY = ("ControlSensitiveResponseMiddleware", "ControlAuthenticationMiddleware", "ControlLicenseMiddleware",
                 "ControlEventLogMiddleware")
_FLEET_ONLY = ("NodeAuthMiddleware", "FleetEventLogMiddleware")


def gate_middleware(stack: list[Any]) -> list[Any]:
    """Flower's middleware list with each single-API layer wrapped in ``PathGated`` (bypassed by the
    other APIs' paths); the order and every other layer stay as they are."""
    from starlette.middleware import Middleware

    gated = []
    for entry in stack:
        cls, args, kwargs = entry
        name = getattr(cls, "__name__", "")
        bypass = (("/v1/fleet/", "/v1/runtime/") if name in _CONTROL_ONLY
                  else ("/v1/control/", "/v1/runtime/") if name in _FLEET_ONLY else None)
        gated.append(entry if bypass is None else
                     Middleware(PathGated, inner=cls, bypass=bypass, args=tuple(args), kwargs=dict(kwargs)))
    return gated


def runtime_hosts(host: str) -> frozenset[str]:
    """Where the SuperLink's own helper processes connect from: its bind host (or loopback for a
    bind-all address) and the loopback addresses, which the kernel picks for local connections."""
    own = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host.strip("[]"))
    return frozenset({own, "127.0.0.1", "::1"})


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value after ``flag`` in Flower's arguments (left in place)."""
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag), None)


def _take_flag(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i: i + 2]
            return value
        if arg.startswith(flag + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    main_module: Any = importlib.import_module("flwr.superlink.main")
    flower_stack = main_module._get_middleware
    main_module._get_middleware = lambda: gate_middleware(flower_stack())  # create_app calls it at start
    keys_path = _take_flag(args, ADMIN_KEYS_FLAG)
    try:
        hold = held_pulls.hold_seconds(os.environ.get(held_pulls.HOLD_ENV))
    except ValueError as exc:
        print(f"quorumfl superlink: {exc}", file=sys.stderr)
        sys.exit(78)
    ca_path = _flag_value(args, "--ssl-ca-certfile")
    if "--insecure" not in args:
        try:
            if keys_path is None or ca_path is None:
                raise CredentialError(f"a SuperLink with TLS needs {ADMIN_KEYS_FLAG} (the admin's admin.pub) and "
                                      "--ssl-ca-certfile: without them its Control API would obey anyone")
            plugin = AdminTokenPlugin(Path(keys_path).read_bytes(), source=keys_path,
                                      audience=federation_id(Path(ca_path).read_bytes()))
        except (OSError, CredentialError) as exc:
            print(f"quorumfl superlink: {exc}", file=sys.stderr)
            sys.exit(78)
        # the module, not the function of the same name that its package exports
        flower: Any = importlib.import_module("flwr.superlink.cli.flower_superlink")
        flower.load_control_authn_plugin = lambda: plugin  # where Flower's CLI loads its own plugin
        host = _flag_value(args, "--host") or "127.0.0.1"
        create_app = main_module.create_app

        def create_guarded_app(*a: Any, **kw: Any) -> Any:
            app = without_api_pages(create_app(*a, **kw))
            app.add_middleware(RuntimeFromThisHost, allowed=runtime_hosts(host))
            app.add_middleware(AdminCalls, keys=plugin.keys, audience=plugin.audience)
            return app

        main_module.create_app = create_guarded_app  # Flower's CLI imports it from there when it starts
    from flwr.superlink.cli import flower_superlink

    from quorumfl.deploy.link_restarts import install
    from quorumfl.deploy.liveness import (
        accept_short_heartbeats,
        end_with_parent,
        stop_below_on_exit,
    )

    install()  # a message taken by a node that restarted since gets an answer, not the round's timeout
    accept_short_heartbeats()  # QuorumFL's SuperNodes beat every few seconds (deploy.liveness)
    end_with_parent()
    stop_below_on_exit()
    pulls = held_pulls.install()
    create = main_module.create_app

    def create_holding_app(*a: Any, **kw: Any) -> Any:
        app = create(*a, **kw)
        app.add_middleware(held_pulls.HeldPulls, pulls=pulls, hold=hold)  # outermost: before Flower's stack
        return app

    main_module.create_app = create_holding_app
    sys.argv = ["flower-superlink", *args]
    flower_superlink()


if __name__ == "__main__":
    main()
