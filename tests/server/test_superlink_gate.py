"""The SuperLink's middleware gate: a single-API Flower layer is skipped only by the other APIs' paths.

Flower's own middleware list (``flwr.superlink.main._get_middleware``) is gated as the SuperLink
process gates it; a layer that records what it sees stands in front of a real Starlette app.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flwr.superlink import main as flower_main
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from quorumfl.deploy.admin_access import PathGated, gate_middleware

SEEN: list[str] = []


class Recorder(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: Any) -> Response:
        SEEN.append(request.url.path)
        return await call_next(request)  # type: ignore[no-any-return]


def _ok(request: Request) -> Response:
    return PlainTextResponse("ok")


def test_flowers_single_api_layers_are_gated_and_nothing_else_moves() -> None:
    stack = flower_main._get_middleware()
    gated = gate_middleware(stack)
    assert len(gated) == len(stack)
    names = [getattr(m.cls, "__name__", "") for m in stack]
    # Flower 1.42's layers that act on one API only: if an upgrade renames or drops them, look again.
    control = {"ControlSensitiveResponseMiddleware", "ControlAuthenticationMiddleware", "ControlLicenseMiddleware",
               "ControlEventLogMiddleware"}
    fleet = {"NodeAuthMiddleware", "FleetEventLogMiddleware"}
    assert control | fleet <= set(names), names
    for before, after in zip(stack, gated, strict=True):
        name = getattr(before.cls, "__name__", "")
        if name in control | fleet:
            assert after.cls is PathGated and after.kwargs["inner"] is before.cls
            other = ("/v1/fleet/", "/v1/runtime/") if name in control else ("/v1/control/", "/v1/runtime/")
            assert after.kwargs["bypass"] == other
        else:
            assert after is before  # the protobuf translation and the error translator run for every path


class _Next:
    """The next ASGI layer: answers 200."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class _Layer:
    """A Flower-style layer over ``app`` that records each path it sees."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        SEEN.append(scope["path"])
        await self.app(scope, receive, send)


def _through(gate: PathGated, path: str, root_path: str = "") -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": path, "root_path": root_path, "headers": []}
    asyncio.run(gate(scope, receive, send))


def test_only_the_other_apis_paths_bypass_a_gated_layer() -> None:
    gate = PathGated(_Next(), inner=_Layer, bypass=("/v1/fleet/", "/v1/runtime/"))
    SEEN.clear()
    for path in ("/v1/fleet/pull-messages", "/v1/runtime/pull-task-input"):
        _through(gate, path)
    assert SEEN == []
    tried = ["/v1/control/list-runs", "//v1/fleet/pull", "/v1/fleetx", "/V1/fleet/pull", "/v1/control/../fleet/x",
             "/", ""]
    for path in tried:
        _through(gate, path)
    assert SEEN == tried  # everything that is not plainly another API's path goes through the layer


def test_a_root_path_never_bypasses() -> None:
    gate = PathGated(_Next(), inner=_Layer, bypass=("/v1/fleet/",))
    SEEN.clear()
    _through(gate, "/v1/fleet/pull", root_path="/mounted")
    assert SEEN == ["/v1/fleet/pull"]  # with a root path the layer's own view of the path differs: it runs


def test_a_gated_flower_layer_still_answers_its_own_api() -> None:
    """End to end through Starlette with a real BaseHTTPMiddleware inside the gate."""
    routes = [Route(p, _ok, methods=["POST"]) for p in ("/v1/control/list-runs", "/v1/fleet/pull")]
    app = Starlette(routes=routes, middleware=[Middleware(PathGated, inner=Recorder, bypass=("/v1/fleet/",))])
    client = TestClient(app)
    SEEN.clear()
    assert client.post("/v1/fleet/pull").status_code == 200
    assert client.post("/v1/control/list-runs").status_code == 200
    assert SEEN == ["/v1/control/list-runs"]
