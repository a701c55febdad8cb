"""ReplyPuller: a pull that blocks (a reply still uploading) holds up neither the other replies nor
the caller, and is abandoned without waiting when the caller is done."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from quorumfl.server.pulling import ReplyPuller


class BlockingGrid:
    """``pull_messages([id])`` returns ``["reply-" + id]``; the id ``slow`` blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[list[str]] = []

    def pull_messages(self, message_ids: list[str]) -> list[str]:
        self.calls.append(list(message_ids))
        if message_ids == ["slow"]:
            self.release.wait(30)
        return [f"reply-{m}" for m in message_ids]


def test_a_blocked_pull_holds_up_neither_the_others_nor_the_caller() -> None:
    grid = BlockingGrid()
    got: list[str] = []
    started = time.monotonic()
    with ReplyPuller(grid, workers=4) as puller:  # type: ignore[arg-type]
        while len(got) < 3 and time.monotonic() - started < 10:
            got += puller.poll(["a", "b", "slow", "c"])  # type: ignore[arg-type]
            time.sleep(0.01)
    assert sorted(got) == ["reply-a", "reply-b", "reply-c"]
    assert time.monotonic() - started < 5  # it never waited for the blocked pull
    assert all(len(call) == 1 for call in grid.calls)  # one id per call
    grid.release.set()


def test_at_most_workers_pulls_run_at_once_and_errors_reach_the_caller() -> None:
    grid = BlockingGrid()
    with ReplyPuller(grid, workers=1) as puller:  # type: ignore[arg-type]
        assert puller.poll(["slow", "a"]) == []  # type: ignore[arg-type]
        time.sleep(0.1)
        assert grid.calls == [["slow"]]  # "a" waits for the one worker
        grid.release.set()
        deadline = time.monotonic() + 5
        got: list[str] = []
        while len(got) < 2 and time.monotonic() < deadline:
            got += puller.poll(["slow", "a"] if not got else ["a"])  # type: ignore[arg-type]
            time.sleep(0.01)
        assert got == ["reply-slow", "reply-a"]

    class Failing:
        def pull_messages(self, _ids: list[str]) -> list[str]:
            raise ConnectionError("SuperLink unreachable")

    with ReplyPuller(Failing()) as puller, pytest.raises(ConnectionError, match="unreachable"):  # type: ignore[arg-type]
        for _ in range(500):
            puller.poll(["x"])  # type: ignore[arg-type]
            time.sleep(0.01)


def test_an_id_whose_reply_has_not_arrived_is_asked_for_again() -> None:
    class Late:
        """No reply for ``x`` on the first two calls, then one."""

        def __init__(self) -> None:
            self.calls = 0

        def pull_messages(self, message_ids: list[str]) -> list[str]:
            self.calls += 1
            return [f"reply-{m}" for m in message_ids] if self.calls > 2 else []

    grid = Late()
    got: list[str] = []
    with ReplyPuller(grid) as puller:  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got += puller.poll(["x"])  # type: ignore[arg-type]
            time.sleep(0.01)
    assert got == ["reply-x"]
    assert grid.calls == 3


class FakeRuntime:
    """The SuperLink's Runtime API as Flower's ``HttpGrid`` calls it, serving real reply messages:
    ``PullMessages`` hands each stored reply out once; ``PullObject`` of a reply whose id is in
    ``slow`` blocks until ``release`` is set (its upload has not finished)."""

    def __init__(self, replies: list[Any], slow: set[str]) -> None:
        from flwr.app.message import remove_content_from_message
        from flwr.common.serde import message_to_proto
        from flwr.supercore.inflatable.inflatable_object import (
            get_all_nested_objects,
            get_object_tree,
        )

        self.stored = {r.metadata.reply_to_message_id: (message_to_proto(remove_content_from_message(r)),
                                                        get_object_tree(r)) for r in replies}
        self.objects = {oid: obj.deflate() for r in replies for oid, obj in get_all_nested_objects(r).items()}
        self.owner = {oid: r.metadata.reply_to_message_id for r in replies for oid in get_all_nested_objects(r)}
        self.slow = slow
        self.release = threading.Event()
        self.listed: list[list[str]] = []
        self.confirmed: list[str] = []

    def PullMessages(self, request: Any) -> Any:  # noqa: N802 - Flower's RPC name
        from flwr.proto.runtime_pb2 import PullAppMessagesResponse

        ids = list(request.message_ids)
        self.listed.append(ids)
        found = [self.stored.pop(i) for i in ids if i in self.stored]
        return PullAppMessagesResponse(messages_list=[p for p, _ in found], message_object_trees=[t for _, t in found])

    def PullObject(self, request: Any) -> Any:  # noqa: N802
        from flwr.proto.message_pb2 import PullObjectResponse

        if self.owner[request.object_id] in self.slow:
            self.release.wait(30)
        return PullObjectResponse(object_found=True, object_available=True,
                                  object_content=self.objects[request.object_id])

    def ConfirmMessageReceived(self, request: Any) -> Any:  # noqa: N802
        from flwr.proto.message_pb2 import ConfirmMessageReceivedResponse

        self.confirmed.append(request.message_object_id)
        return ConfirmMessageReceivedResponse()


def _http_grid(runtime: FakeRuntime) -> Any:
    from flwr.supercore.run import Run
    from flwr.superlink.grid.http_grid import HttpGrid

    class Grid(HttpGrid):
        @property
        def _runtime_client(self) -> Any:
            return runtime

    grid = Grid(token="test")
    grid.set_run(Run.create_empty(7))
    return grid


def _replies(count: int) -> list[Any]:
    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

    replies = []
    for i in range(count):
        ask = Message(RecordDict({"c": ConfigRecord({"i": i})}), dst_node_id=100 + i, message_type="train")
        ask.metadata.__dict__["_message_id"] = ask.object_id
        reply = Message(RecordDict({"arrays": ArrayRecord([np.full(5, float(i))])}), reply_to=ask)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        replies.append(reply)
    return replies


def test_flowers_http_grid_is_asked_once_per_poll_and_a_slow_upload_holds_up_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):  # as in a ServerApp process
        monkeypatch.setattr(TaskIdentity, name, value)

    replies = _replies(3)
    asked = [r.metadata.reply_to_message_id for r in replies]
    slow = asked[1]
    runtime = FakeRuntime(replies, {slow})
    got: list[Any] = []
    started = time.monotonic()
    with ReplyPuller(_http_grid(runtime), workers=4) as puller:
        # at least two polls: the second must not ask again for what the first listed (a first poll
        # can already hand back both fast replies when their pulls finish at once)
        while (len(got) < 2 or len(runtime.listed) < 2) and time.monotonic() - started < 10:
            got += puller.poll(asked + ["not-yet"])
            time.sleep(0.01)
        polls = len(runtime.listed)
        assert time.monotonic() - started < 5  # it never waited for the blocked pull
        assert runtime.listed[0] == asked + ["not-yet"]  # one request for every waiting reply
        assert all(ids == ["not-yet"] for ids in runtime.listed[1:])  # a listed reply is not asked for again
        runtime.release.set()
        while len(got) < 3 and time.monotonic() - started < 10:
            got += puller.poll(asked + ["not-yet"])
            time.sleep(0.01)
    assert polls >= 2
    by_request = {m.metadata.reply_to_message_id: m for m in got}
    assert sorted(by_request) == sorted(asked)
    for reply in replies:  # the inflated reply is the one the node sent, content included
        pulled = by_request[reply.metadata.reply_to_message_id]
        assert pulled.metadata.message_id == reply.metadata.message_id
        assert pulled.metadata.src_node_id == reply.metadata.src_node_id
        np.testing.assert_array_equal(pulled.content["arrays"].to_numpy_ndarrays()[0],
                                      reply.content["arrays"].to_numpy_ndarrays()[0])
    assert sorted(runtime.confirmed) == sorted(r.metadata.message_id for r in replies)


def test_wait_ends_when_a_pull_has_a_reply_and_not_for_an_empty_one() -> None:
    """The caller's wait between polls ends as soon as a pull in flight hands back a reply (so the
    reply is collected then, not a whole poll interval later); a pull that finds nothing yet (a grid
    pulled one id per call) does not end it, so polling never becomes a busy loop."""
    grid = BlockingGrid()
    with ReplyPuller(grid, workers=2) as puller:  # type: ignore[arg-type]
        assert puller.poll(["slow"]) == []  # type: ignore[arg-type]
        threading.Timer(0.2, grid.release.set).start()
        started = time.monotonic()
        puller.wait(30.0)
        assert time.monotonic() - started < 10  # woken by the pull, not after 30 s
        assert puller.poll([]) == ["reply-slow"]  # type: ignore[arg-type]

    class NothingYet:
        def __init__(self) -> None:
            self.calls = 0

        def pull_messages(self, _ids: list[str]) -> list[str]:
            self.calls += 1
            return []

    empty = NothingYet()
    with ReplyPuller(empty, workers=2) as puller:  # type: ignore[arg-type]
        assert puller.poll(["a"]) == []  # type: ignore[arg-type]
        time.sleep(0.1)  # its pull has come back empty by now
        started = time.monotonic()
        puller.wait(0.5)
        assert time.monotonic() - started >= 0.45  # not woken by an empty pull
        assert empty.calls == 1
