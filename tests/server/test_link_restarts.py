"""A message taken by a node that restarted since gets an answer from the SuperLink, not the round's
timeout (``quorumfl.deploy.link_restarts``), on both link states Flower ships: in memory and SQL.

Played on Flower's own link state, as the SuperLink drives it: the ServerApp pushes a train message,
the department's node takes it, the node's process dies and a new one (same key, same node id)
activates; the ServerApp's pulls must then get Flower's "node unavailable" error for it. Without
the wrapper the pull returns nothing until the message's TTL (12 h).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager

from quorumfl.deploy.link_restarts import install, restarted_since_delivery

SUPERLINK = 1  # Flower's node id of the SuperLink, the sender of every instruction


@pytest.fixture(params=["memory", "sqlite"])
def state(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    install()
    database = FLWR_IN_MEMORY_DB_NAME if request.param == "memory" else str(tmp_path / "link.db")
    yield LinkStateFactory(database, NoOpFederationManager(), ObjectStoreFactory()).state()


def _push(state: Any, run_id: int, node_id: int) -> str:
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)  # type: ignore[attr-defined]
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, 1, 0
    try:
        message = Message(RecordDict(), dst_node_id=node_id, message_type="train")
    finally:
        TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved  # type: ignore[attr-defined]
    message.metadata.__dict__["_src_node_id"] = SUPERLINK
    message.metadata.__dict__["_message_id"] = message.object_id
    assert state.store_message_ins(message) is not None
    return str(message.metadata.message_id)


def _federation(state: Any) -> tuple[int, int, int]:
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
    tax = state.create_node("admin", "admin", b"tax-office-key", 2.0)
    parks = state.create_node("admin", "admin", b"parks-key", 2.0)
    assert state.activate_node(tax, 2.0) and state.activate_node(parks, 2.0)
    return run_id, tax, parks


def test_a_message_taken_before_its_node_restarted_is_answered_as_unavailable(state: Any) -> None:
    run_id, tax, parks = _federation(state)
    lost, kept = _push(state, run_id, tax), _push(state, run_id, parks)
    assert [m.metadata.message_id for m in state.get_message_ins(tax, 1)] == [lost]
    assert [m.metadata.message_id for m in state.get_message_ins(parks, 1)] == [kept]
    assert state.get_message_res({lost, kept}, run_id) == []  # both still training: nothing yet

    # the tax office's node dies and comes back as a new process with the same key
    assert state.deactivate_node(tax) and state.activate_node(tax, 2.0)
    replies = state.get_message_res({lost, kept}, run_id)
    assert [(r.metadata.reply_to_message_id, r.has_error()) for r in replies] == [(lost, True)]
    assert replies[0].error.code == ErrorCode.NODE_UNAVAILABLE  # as Flower answers for an offline node
    assert state.get_message_res({kept}, run_id) == []  # parks' node is still working on its message


def test_a_reply_from_the_node_is_never_replaced(state: Any) -> None:
    """The node answered before it restarted: the ServerApp gets the answer, not an error."""
    run_id, tax, _ = _federation(state)
    asked = _push(state, run_id, tax)
    (taken,) = state.get_message_ins(tax, 1)
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)  # type: ignore[attr-defined]
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, 2, tax
    try:
        reply = Message(RecordDict(), reply_to=taken)
    finally:
        TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved  # type: ignore[attr-defined]
    reply.metadata.__dict__["_message_id"] = reply.object_id
    assert state.store_message_res(reply) is not None
    assert state.deactivate_node(tax) and state.activate_node(tax, 2.0)
    (got,) = state.get_message_res({asked}, run_id)
    assert not got.has_error() and got.metadata.reply_to_message_id == asked


def test_a_message_not_yet_taken_waits_for_the_new_process() -> None:
    """Only a delivered message is lost: one still queued goes to the node's new process."""
    assert restarted_since_delivery("2026-12-04T10:00:00+00:00", "2026-12-04T10:00:05+00:00")
    assert not restarted_since_delivery("2026-12-04T10:00:05+00:00", "2026-12-04T10:00:00+00:00")
    assert not restarted_since_delivery("", "2026-12-04T10:00:05+00:00")
    assert not restarted_since_delivery("2026-12-04T10:00:00+00:00", "")
    assert not restarted_since_delivery("yesterday", "2026-12-04T10:00:05+00:00")
