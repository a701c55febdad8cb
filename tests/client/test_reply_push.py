"""A ClientApp's reply reaches the SuperNode's node state whole although Flower's HTTP retry repeated an
object push that had been stored (its answer lost): with ``retry_reply_push`` the reply is pushed
again and only the missing objects travel; without it Flower gives up with objects missing. The
node side is Flower's own in-memory node state and Runtime API handlers; only the transport between
them is this test's, and it repeats the first object push as the retry does. Flower pushes a reply's
objects from two threads, so whether any are still missing when the repeated push fails depends on
timing; these tests push from one thread (Flower's ``FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES=1``) so
that the outcome is fixed: the first object's repeated push fails before any other object is sent.

The same for the next hop, the SuperNode's push of that reply to the SuperLink (``retry_link_push``
on Flower's SuperNode loop, ``start_client_internal._push_messages``): the SuperLink side is Flower's
own LinkState (in memory and SQLite) and fleet handlers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
from flwr.app.message import make_message, remove_content_from_message
from flwr.common.serde import message_to_proto
from flwr.proto.fleet_pb2 import PushMessagesRequest  # pylint: disable=no-name-in-module
from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.date import now
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_object import get_object_tree, iterate_object_tree
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_push_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import ObjectPushError
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.servicer.fleet import fleet_handlers
from flwr.supernode import start_client_internal
from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState
from flwr.supernode.runtime import run_clientapp
from flwr.supernode.servicer.runtime import runtime_handlers

from quorumfl.deploy import orphan_replies
from quorumfl.deploy.launch_gate import WARM_ENV
from quorumfl.protocol import reply_push

from ..server.test_link_restarts import _federation, _push

RUN, NODE = 7, 3


class _RepeatedPushes:
    """A transport whose first ``repeats`` object pushes are each handled twice and answered by the
    second (the first attempt stored, its answer lost, the HTTP client's retry answered)."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.stored: list[str] = []  # object ids each push actually stored
        self.messages = 0  # PushMessages requests: one per attempt at the reply

    def _handle_push(self, handle: Callable[[Any], Any], request: Any) -> Any:
        answer = handle(request)
        if answer.stored:
            self.stored.append(request.object_id)
        if self.repeats:
            self.repeats -= 1
            answer = handle(request)
        return answer


class _Transport(_RepeatedPushes):
    """The Runtime API calls of one ClientApp, straight into the SuperNode's handlers."""

    def __init__(self, state: InMemoryNodeState, repeats: int, run_id: int = RUN) -> None:
        super().__init__(repeats)
        self.state, self.task = state, Task(run_id=run_id)

    def PushMessages(self, request: Any) -> Any:  # noqa: N802 (Flower's RPC name)
        self.messages += 1
        return runtime_handlers.push_messages(request, self.state, self.task)

    def PushObject(self, request: Any) -> Any:  # noqa: N802
        return self._handle_push(lambda r: runtime_handlers.push_object(r, self.state, self.task), request)


def _reply() -> tuple[Message, Context]:
    incoming = make_message(metadata=Metadata(run_id=RUN, message_id="", src_node_id=0, dst_node_id=NODE,
                                              reply_to_message_id="", group_id="1", created_at=now().timestamp(),
                                              ttl=3600.0, message_type="train"), content=RecordDict())
    incoming.metadata.__dict__["_message_id"] = incoming.object_id
    content = RecordDict({"arrays": ArrayRecord([np.arange(300_000, dtype=np.float32), np.ones(700, dtype=np.float32)]),
                          "config": ConfigRecord({"round": 1})})
    return Message(content, reply_to=incoming), Context(run_id=RUN, node_id=NODE, node_config={}, state=RecordDict(),
                                                       run_config={})


def _missing(state: InMemoryNodeState, message_id: str) -> list[str]:
    tree = state.object_store.get_object_tree(message_id)
    return [t.object_id for t in iterate_object_tree(tree) if state.object_store.get(t.object_id) == b""]


@pytest.fixture
def flower_push(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Flower's own ``push_message``, put back after the test (the wrapper patches the module), pushing
    objects from one thread."""
    monkeypatch.setattr(inflatable_utils, "get_num_workers", lambda _most: 1)
    original = run_clientapp.push_message
    yield original
    run_clientapp.push_message = original


def test_flower_alone_leaves_the_reply_incomplete_at_the_node(flower_push: Any) -> None:
    state = InMemoryNodeState(InMemoryObjectStore())
    reply, context = _reply()
    with pytest.raises(ObjectPushError, match="push session may have expired or been replaced"):
        flower_push(_Transport(state, repeats=1), reply, context)
    missing = _missing(state, reply.metadata.message_id)
    assert len(missing) == len(list(iterate_object_tree(state.object_store.get_object_tree(
        reply.metadata.message_id)))) - 1  # all but the first: the SuperNode's sender would wait forever


def test_the_reply_is_pushed_again_and_arrives_whole(flower_push: Any) -> None:
    reply_push.retry_reply_push()
    reply_push.retry_reply_push()  # once per process: a second call wraps nothing more
    assert run_clientapp.push_message is not flower_push
    state = InMemoryNodeState(InMemoryObjectStore())
    reply, context = _reply()
    transport = _Transport(state, repeats=1)
    run_clientapp.push_message(transport, reply, context)
    assert _missing(state, reply.metadata.message_id) == []
    assert transport.messages == 2
    assert len(transport.stored) == len(set(transport.stored))  # nothing stored was sent again
    assert len(transport.stored) > 1  # the second attempt sent what the first left missing
    forwarded = state.get_messages_legacy(is_reply=True)
    assert [m.metadata.message_id for m in forwarded] == [reply.metadata.message_id]


def test_a_reply_that_keeps_failing_fails_after_the_last_attempt(flower_push: Any) -> None:
    reply_push.retry_reply_push()
    state = InMemoryNodeState(InMemoryObjectStore())
    reply, context = _reply()
    transport = _Transport(state, repeats=10**6)  # every object push repeated: every attempt fails
    with pytest.raises(ObjectPushError):
        run_clientapp.push_message(transport, reply, context)
    assert transport.messages == reply_push.ATTEMPTS  # then it gives up


def test_warm_tasks_inherit_the_wrapped_push() -> None:
    code = ("from quorumfl.deploy.warm import _preload; _preload(); "
            "from flwr.supernode.runtime import run_clientapp; "
            "print(getattr(run_clientapp.push_message, '_quorumfl_retries_reply_push', False))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "True"


# ---- the SuperNode's push of a reply to the SuperLink (``retry_link_push``) ------------------------


class _Link(_RepeatedPushes):
    """The SuperNode's two fleet calls of a reply push, straight into Flower's fleet handlers on its
    LinkState (in memory or SQLite)."""

    def __init__(self, state: Any, node_id: int, repeats: int) -> None:
        super().__init__(repeats)
        self.state, self.node = state, Node(node_id=node_id)

    def send(self, message: Message, object_tree: Any, runtime: float) -> tuple[set[str], str]:
        self.messages += 1
        request = PushMessagesRequest(node=self.node, messages_list=[message_to_proto(remove_content_from_message(message))],
                                      message_object_trees=[object_tree], clientapp_runtime_list=[runtime])
        response = fleet_handlers.push_messages(request, self.state)
        return set(response.objects_to_push), response.session_id

    def _push_object(self, request: Any) -> Any:
        return self._handle_push(lambda r: fleet_handlers.push_object(r, self.state), request)

    def push_object(self, run_id: int, session_id: str, object_id: str, contents: bytes) -> None:
        make_push_object_fn_protobuf(self._push_object, self.node, run_id, session_id)(object_id, contents)


@pytest.fixture(params=["memory", "sqlite"])
def link(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Flower's LinkState of a SuperLink in memory (local federations) or in SQLite (``--database``)."""
    database = FLWR_IN_MEMORY_DB_NAME if request.param == "memory" else str(tmp_path / "link.db")
    return LinkStateFactory(database, NoOpFederationManager(), ObjectStoreFactory()).state()


@pytest.fixture
def supernode_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """Flower's SuperNode loop module, its push functions put back after the test; objects pushed from
    one thread."""
    monkeypatch.setattr(inflatable_utils, "get_num_workers", lambda _most: 1)
    for name in ("_push_messages", "push_object_contents_from_iterable"):
        monkeypatch.setattr(start_client_internal, name, getattr(start_client_internal, name))
    yield start_client_internal


def _reply_at_the_node(link: Any, flower_push: Any) -> tuple[InMemoryNodeState, Message, int]:
    """A train instruction stored at the SuperLink for a node, and the node's reply to it in the
    SuperNode's node state, as its ClientApp pushed it; the run is running."""
    run_id, node_id, _ = _federation(link)
    task_id = _primary_task(link, run_id)
    assert link.claim_task(task_id) and link.activate_task(task_id)
    instruction_id = _push(link, run_id, node_id)
    [instruction] = link.get_message_ins(node_id, 1)
    assert instruction.metadata.message_id == instruction_id
    node_state = InMemoryNodeState(InMemoryObjectStore())
    content = RecordDict({"arrays": ArrayRecord([np.arange(300_000, dtype=np.float32), np.ones(700, dtype=np.float32)]),
                          "config": ConfigRecord({"round": 1})})
    reply = Message(content, reply_to=instruction)
    context = Context(run_id=run_id, node_id=node_id, node_config={}, state=RecordDict(), run_config={})
    flower_push(_Transport(node_state, repeats=0, run_id=run_id), reply, context)  # the ClientApp's push to its SuperNode
    assert _missing(node_state, reply.metadata.message_id) == []  # whole at the node
    return node_state, reply, run_id


def _primary_task(link: Any, run_id: int) -> int:
    runs = getattr(link, "run_ids", None)
    if runs is not None:  # in memory
        return int(runs[run_id].run.primary_task_id)
    return int(link.get_run_info(run_ids=[run_id])[0].primary_task_id)


def _at_the_link(link: Any, reply: Message) -> list[str]:
    """Object ids of the reply that the SuperLink lacks."""
    tree = get_object_tree(reply)
    return [t.object_id for t in iterate_object_tree(tree) if link.object_store.get(t.object_id) in (None, b"")]


def test_flower_alone_drops_the_reply_with_objects_missing_at_the_superlink(
        link: Any, flower_push: Any, supernode_loop: ModuleType) -> None:
    node_state, reply, _ = _reply_at_the_node(link, flower_push)
    transport = _Link(link, reply.metadata.src_node_id, repeats=1)
    supernode_loop._push_messages(state=node_state, object_store=node_state.object_store, send=transport.send,
                                  push_object=transport.push_object)
    missing = _at_the_link(link, reply)
    assert len(missing) == len(list(iterate_object_tree(get_object_tree(reply)))) - 1  # all but the first
    # dropped at the node: the SuperLink never gets the rest, and the server's pull of it waits out the round
    assert transport.messages == 1 and node_state.get_messages_legacy(is_reply=True) == []


def test_the_supernode_pushes_the_reply_again_and_the_superlink_gets_it_whole(
        link: Any, flower_push: Any, supernode_loop: ModuleType) -> None:
    reply_push.retry_link_push(supernode_loop)
    wrapped = supernode_loop._push_messages
    reply_push.retry_link_push(supernode_loop)  # once per module: a second call wraps nothing more
    assert supernode_loop._push_messages is wrapped
    node_state, reply, run_id = _reply_at_the_node(link, flower_push)
    transport = _Link(link, reply.metadata.src_node_id, repeats=1)
    supernode_loop._push_messages(state=node_state, object_store=node_state.object_store, send=transport.send,
                                  push_object=transport.push_object)
    assert _at_the_link(link, reply) == []
    assert transport.messages == 2
    assert len(transport.stored) == len(set(transport.stored)) > 1  # nothing stored twice; the rest sent
    [got] = link.get_message_res({reply.metadata.reply_to_message_id}, run_id)
    assert got.metadata.message_id == reply.metadata.message_id and not got.has_error()
    assert node_state.get_messages_legacy(is_reply=True) == []  # sent, then deleted at the node as Flower does


def test_a_link_push_that_keeps_failing_is_dropped_after_the_last_attempt(
        link: Any, flower_push: Any, supernode_loop: ModuleType) -> None:
    reply_push.retry_link_push(supernode_loop)
    node_state, reply, _ = _reply_at_the_node(link, flower_push)
    transport = _Link(link, reply.metadata.src_node_id, repeats=10**6)  # every object push repeated
    supernode_loop._push_messages(state=node_state, object_store=node_state.object_store, send=transport.send,
                                  push_object=transport.push_object)  # Flower logs the failure and goes on
    assert transport.messages == reply_push.ATTEMPTS
    assert _at_the_link(link, reply)  # incomplete, as without the wrapper


def test_the_quorumfl_supernode_wraps_flowers_link_push() -> None:
    """``python -m quorumfl.deploy.supernode`` wraps the loop before Flower's SuperNode starts (here
    Flower's entry point only reports what it would run)."""
    code = ("import flwr.supernode.cli as cli; from flwr.supernode import start_client_internal as loop; "
            "cli.flower_supernode = lambda: print(*(getattr(loop._push_messages, mark, False) for mark in "
            "('_quorumfl_retries_reply_push', '_quorumfl_skips_orphan_replies'))); "
            "from quorumfl.deploy import supernode; supernode.main()")
    env = {k: v for k, v in os.environ.items() if k != WARM_ENV}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["True", "True"]


# A stray second reply: a ClientApp of a stopped run pushes its reply again after its node dropped the
# first one (and the instruction it answered). Flower's loop, waiting for the reply to the message it
# has just pulled, takes the stray one instead and leaves the awaited reply behind.

def _pulled(state: InMemoryNodeState, group: str) -> Message:
    """An instruction the SuperNode pulled and stored, and its ClientApp took."""
    instruction = make_message(metadata=Metadata(run_id=RUN, message_id="", src_node_id=0, dst_node_id=NODE,
                                                 reply_to_message_id="", group_id=group, created_at=now().timestamp(),
                                                 ttl=3600.0, message_type="train"), content=RecordDict())
    instruction.metadata.__dict__["_message_id"] = instruction.object_id
    state.store_message(instruction)
    assert [m.metadata.message_id for m in state.get_messages_legacy(is_reply=False)] == [instruction.object_id]
    return instruction


def _answer(state: InMemoryNodeState, flower_push: Any, instruction: Message) -> Message:
    """The ClientApp's reply to ``instruction``, pushed into the node state through Flower's Runtime API."""
    reply = Message(RecordDict({"config": ConfigRecord({"round": int(instruction.metadata.group_id)})}),
                    reply_to=instruction)
    context = Context(run_id=RUN, node_id=NODE, node_config={}, state=RecordDict(), run_config={})
    flower_push(_Transport(state, repeats=0), reply, context)
    return reply


def _a_stray_then_the_awaited_reply(flower_push: Any) -> tuple[InMemoryNodeState, Message, Message, Any]:
    """A node state with a stray reply (its instruction answered and deleted) and a pulled instruction
    whose reply its ClientApp pushes 0.3 s later, from another thread."""
    state = InMemoryNodeState(InMemoryObjectStore())
    answered = _pulled(state, "2")
    stray = _answer(state, flower_push, answered)
    state.delete_messages(message_ids=[answered.metadata.message_id])  # the node dropped the first reply with it
    awaited = _pulled(state, "3")
    replies: list[Message] = []
    later = threading.Timer(0.3, lambda: replies.append(_answer(state, flower_push, awaited)))
    later.start()
    return state, stray, awaited, (later, replies)


def _pushed_once(loop: ModuleType, state: InMemoryNodeState) -> list[str]:
    """Ids of the instructions whose replies one pass of the loop's push sent to the SuperLink."""
    sent: list[str] = []

    def send(message: Message, _tree: Any, _runtime: float) -> tuple[set[str], str]:
        sent.append(message.metadata.reply_to_message_id)
        return set(), "session"

    loop._push_messages(state=state, object_store=state.object_store, send=send, push_object=lambda *_: None)
    return sent


def test_flower_alone_pushes_a_stray_reply_in_place_of_the_awaited_one(
        flower_push: Any, supernode_loop: ModuleType) -> None:
    state, stray, awaited, (later, replies) = _a_stray_then_the_awaited_reply(flower_push)
    assert _pushed_once(supernode_loop, state) == [stray.metadata.reply_to_message_id]
    later.join()
    # the awaited reply stays at the node until another message is pulled: every later reply is one late
    assert [m.metadata.message_id for m in state.get_messages_legacy(is_reply=True)] == [replies[0].metadata.message_id]


def test_the_supernode_drops_the_stray_reply_and_pushes_the_awaited_one(
        flower_push: Any, supernode_loop: ModuleType) -> None:
    orphan_replies.skip_orphan_replies(supernode_loop)
    wrapped = supernode_loop._push_messages
    orphan_replies.skip_orphan_replies(supernode_loop)  # once per module
    assert supernode_loop._push_messages is wrapped
    state, stray, awaited, (later, _) = _a_stray_then_the_awaited_reply(flower_push)
    assert _pushed_once(supernode_loop, state) == [awaited.metadata.message_id]
    later.join()
    assert state.msg_store == {}  # the stray reply deleted, the awaited one and its instruction as Flower does
    assert state.object_store.get(stray.metadata.message_id) is None
