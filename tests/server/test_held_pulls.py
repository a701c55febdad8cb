"""Held pulls (``quorumfl.deploy.held_pulls``): the SuperLink holds a node's empty pull until a message
for it is stored, never changes an answer, and cannot be made to hold by someone replaying node ids.

The tracker is fed by Flower's own link states (in memory and SQL) as the SuperLink drives them; the
middleware is called as uvicorn calls it, with a Flower ``PullMessagesRequest`` body, in front of a
recording app that stands in for Flower's stack. The SuperNode half (``quorumfl.deploy.supernode``)
is checked on a stand-in for Flower's loop module.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.proto.fleet_pb2 import PullMessagesRequest
from flwr.proto.node_pb2 import Node
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager

from quorumfl.deploy import held_pulls, supernode
from quorumfl.deploy.held_pulls import PULL_PATH, HeldPulls, PullTracker, hold_seconds, install

from .test_link_restarts import _federation, _push


@pytest.fixture
def pulls() -> PullTracker:
    return install(PullTracker())


@pytest.fixture(params=["memory", "sqlite"])
def state(request: pytest.FixtureRequest, tmp_path: Path, pulls: PullTracker) -> Iterator[Any]:
    database = FLWR_IN_MEMORY_DB_NAME if request.param == "memory" else str(tmp_path / "link.db")
    yield LinkStateFactory(database, NoOpFederationManager(), ObjectStoreFactory()).state()


def test_a_node_is_idle_only_between_an_empty_pull_and_the_next_message_for_it(state: Any, pulls: PullTracker) -> None:
    run_id, tax, parks = _federation(state)
    assert not pulls.idle(tax)  # never asked: nothing is known about it
    assert state.get_message_ins(tax, 1) == []
    assert pulls.idle(tax) and not pulls.idle(parks)
    _push(state, run_id, tax)
    _push(state, run_id, tax)
    assert not pulls.idle(tax)
    assert len(state.get_message_ins(tax, 1)) == 1  # one of two taken: the next pull must not wait
    assert not pulls.idle(tax)
    assert len(state.get_message_ins(tax, 1)) == 1
    assert not pulls.idle(tax)
    assert state.get_message_ins(tax, 1) == []
    assert pulls.idle(tax)


def _push_with_objects(state: Any, run_id: int, node_id: int) -> tuple[str, list[tuple[str, bytes]]]:
    """Store a train message the way the ServerApp pushes one (message and object tree first); its
    id and the (object id, content) pairs still to push."""
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)  # type: ignore[attr-defined]
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, 1, 0
    try:
        message = Message(RecordDict({"config": ConfigRecord({"lr": 0.1})}), dst_node_id=node_id,
                          message_type="train")
    finally:
        TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved  # type: ignore[attr-defined]
    message.metadata.__dict__["_src_node_id"] = 1
    message.metadata.__dict__["_message_id"] = message.object_id
    session = state.start_session(run_id)
    stored, missing = state.store_message_and_object_tree(message, get_object_tree(message), session)
    assert stored and missing
    contents = {i: o.deflate() for i, o in get_all_nested_objects(message).items()}
    return session, [(i, contents[i]) for i in missing]


def test_a_message_counts_for_its_node_only_once_its_objects_are_all_pushed(state: Any, pulls: PullTracker) -> None:
    run_id, tax, _ = _federation(state)
    assert state.get_message_ins(tax, 1) == []
    session, objects = _push_with_objects(state, run_id, tax)
    assert len(objects) >= 2
    for object_id, content in objects[:-1]:
        assert pulls.idle(tax)  # a pull now would be held: the node is not sent a half-pushed message
        assert state.store_object(run_id, session, object_id, content)
    assert pulls.idle(tax)
    last_id, last = objects[-1]
    assert state.store_object(run_id, session, last_id, last)
    assert not pulls.idle(tax)  # complete: a held pull goes on and gets it
    assert len(state.get_message_ins(tax, 1)) == 1


class Recorder:
    """Stands in for Flower's stack: records when it was called and the body it read."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.calls.append((time.monotonic(), body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"answer"})


def _pull_body(node: int) -> bytes:
    return bytes(PullMessagesRequest(node=Node(node_id=node)).SerializeToString())


async def _ask(app: Any, body: bytes, *, path: str = PULL_PATH, chunks: int = 1) -> tuple[float, bytes]:
    """One request through ``app``; (seconds it took, response body)."""
    size = max(1, -(-len(body) // chunks))
    parts = [body[i: i + size] for i in range(0, len(body), size)] or [b""]
    queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    started = time.monotonic()
    await app({"type": "http", "method": "POST", "path": path}, receive, send)
    return time.monotonic() - started, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_held_pull_goes_on_as_soon_as_a_message_is_stored_with_its_body_unchanged(
    state: Any, pulls: PullTracker
) -> None:
    run_id, tax, _ = _federation(state)
    assert state.get_message_ins(tax, 1) == []  # the node's last pull found nothing
    inner = Recorder()
    app = HeldPulls(inner, pulls, hold=30.0)
    body = _pull_body(tax)
    stored_at: list[float] = []

    def push_later() -> None:
        time.sleep(0.3)
        stored_at.append(time.monotonic())
        _push(state, run_id, tax)  # as the ServerApp's push reaches the link state, from another thread

    pusher = threading.Thread(target=push_later)
    pusher.start()
    took, answer = asyncio.run(_ask(app, body, chunks=3))
    pusher.join()
    assert answer == b"answer"
    [(called_at, seen)] = inner.calls
    assert seen == body  # Flower's stack reads exactly what the node sent
    assert called_at >= stored_at[0] and took < 10.0  # it waited for the message, not for the 30 s hold
    assert len(state.get_message_ins(tax, 1)) == 1  # and Flower's answer is the message


def test_a_pull_is_held_at_most_the_hold(state: Any, pulls: PullTracker) -> None:
    _, tax, _ = _federation(state)
    assert state.get_message_ins(tax, 1) == []
    inner = Recorder()
    took, answer = asyncio.run(_ask(HeldPulls(inner, pulls, hold=0.3), _pull_body(tax)))
    assert answer == b"answer" and len(inner.calls) == 1
    assert 0.25 <= took < 10.0


def test_an_attacker_cannot_make_the_superlink_hold(state: Any, pulls: PullTracker) -> None:
    """Pulls for node ids that never passed Flower's node authentication (no empty pull on record),
    a second pull for a node whose pull is held, malformed bodies and other paths all go straight on."""
    _, tax, parks = _federation(state)
    assert state.get_message_ins(tax, 1) == []
    inner = Recorder()
    app = HeldPulls(inner, pulls, hold=30.0)

    async def attack() -> list[tuple[float, bytes]]:
        held = asyncio.ensure_future(_ask(app, _pull_body(tax)))  # the genuine node's pull, held
        await asyncio.sleep(0.2)
        quick = [
            await _ask(app, _pull_body(tax)),  # a replay of the same node id while its pull is held
            await _ask(app, _pull_body(parks)),  # registered, but never found its queue empty
            await _ask(app, _pull_body(987654321)),  # no such node
            await _ask(app, b"\xff\x00 not a protobuf"),
            await _ask(app, b"x" * (held_pulls.MAX_BODY + 10), chunks=4),
            await _ask(app, _pull_body(tax), path="/v1/fleet/pull-object"),
        ]
        pulls.stored(tax)  # let the genuine pull go
        await held
        return quick

    quick = asyncio.run(attack())
    assert all(took < 5.0 and answer == b"answer" for took, answer in quick)
    bodies = [body for _, body in inner.calls]
    assert b"\xff\x00 not a protobuf" in bodies and b"x" * (held_pulls.MAX_BODY + 10) in bodies  # passed on whole
    assert len(inner.calls) == 7


def test_hold_setting_is_checked() -> None:
    assert hold_seconds(None) == held_pulls.DEFAULT_HOLD_S and hold_seconds(" ") == held_pulls.DEFAULT_HOLD_S
    assert hold_seconds("0") == 0.0 and hold_seconds("2.5") == 2.5
    for bad in ("soon", "-1", "11", "nan"):
        with pytest.raises(ValueError, match="QUORUMFL_PULL_HOLD_S"):
            hold_seconds(bad)


def _loop_module(pulls: list[tuple[int | None, float]]) -> types.ModuleType:
    """A stand-in for Flower's SuperNode loop module whose pulls return, in turn, ``(run id or None,
    seconds the pull takes)``."""
    module = types.ModuleType("loop")
    queue = list(pulls)

    def _pull_and_store_message(*_: Any, **__: Any) -> int | None:
        result, seconds = queue.pop(0)
        time.sleep(seconds)
        return result

    module._pull_and_store_message = _pull_and_store_message  # type: ignore[attr-defined]
    module.time = time  # type: ignore[attr-defined]
    return module


class _Woken:
    def __init__(self) -> None:
        self.count = 0

    def wake(self) -> None:
        self.count += 1


@pytest.mark.parametrize(("pulls", "hold", "again"), [
    ([(None, 0.3)], 0.5, True),  # the SuperLink held this empty pull: ask again at once
    ([(None, 0.0)], 0.5, False),  # answered at once with nothing, not after a message: poll
    ([(7, 0.0), (None, 0.0)], 0.5, True),  # the first empty pull after a message is never held
    ([(7, 0.0), (None, 0.0), (None, 0.0)], 0.5, False),  # ... but the one after it should have been
    ([(7, 0.0), (None, 0.0)], 0.0, False),  # a SuperLink that does not hold: poll as before
    ([(None, 0.3)], 0.0, False),
])
def test_the_supernode_asks_again_at_once_only_when_its_next_pull_will_be_held(
    pulls: list[tuple[int | None, float]], hold: float, again: bool
) -> None:
    module = _loop_module(pulls)
    waits = supernode.patch_waits(module, poll=1.0)
    woken = _Woken()
    supernode.wake_after_store(module, woken, waits, hold=hold)  # type: ignore[arg-type]
    for _ in pulls:
        module._pull_and_store_message()
    assert waits.again is again and woken.count == sum(r is not None for r, _ in pulls)
    assert module.time.monotonic() > 0  # the rest of the time module is still there for Flower's loop
    started = time.monotonic()
    module.time.sleep(3)  # Flower's sleep after an empty pull
    slept = time.monotonic() - started
    assert (slept < 0.5) if again else (slept >= 0.95)  # at once (0.05 s), else the poll interval
