"""Pulling replies from the SuperLink: one cheap request per poll, and no slow upload holding up a round.

Flower 1.42 registers a reply as soon as a node starts sending it and then uploads its arrays as
separate objects; ``Grid.pull_messages`` returns the reply only after it has pulled every object,
retrying for up to two hours. A department on a slow link would therefore block the call that
pulls its reply, and every other reply pulled in the same call, far past the round's deadline.

Flower has no non-blocking pull, so ``ReplyPuller`` splits Flower's ``HttpGrid.pull_messages`` in
its two steps. Each ``poll`` sends one Runtime API ``PullMessages`` request for every reply still
waiting: the SuperLink answers with the replies that have arrived (message headers and object
trees, a few hundred bytes each) and hands each one out only once. Pulling a listed reply's objects,
confirming it and inflating it (the rest of Flower's ``pull_messages``, repeated here step for step)
runs on a worker thread, at most ``workers`` at once: a reply still uploading occupies one worker,
the others keep arriving, and the caller stops waiting at its deadline. A pull abandoned at the
deadline finishes on its thread and is dropped (its node was already recorded late).

Between polls the caller waits with ``wait``, which returns as soon as a pull in flight hands back a
reply: a listed reply is handed over right after its objects arrive instead of at the next poll
(with a fixed sleep, every reply waited one poll to be listed and another to be collected). An A/B
on ten SuperNodes, three interleaved pairs of 4-round masked runs: the unmask stage took 0.78, 0.87
and 0.70 s against 0.83, 0.91 and 1.06 s with the fixed 0.1 s sleep. Polling every 0.05 s instead
(with the fixed sleep, five pairs) gave 0.68–0.77 s against 0.75–0.86 s, at twice the requests to
the SuperLink; the poll stays at 0.1 s.

Why not one ``grid.pull_messages([id])`` per waiting id on each poll, as this module did before:
with ten replies outstanding and a poll every 0.1 s that is up to 80 requests a second on the
SuperLink while a stage waits, each paying TLS, the middleware and a thread; a masking round waits
through three stages. A grid that is not Flower's ``HttpGrid`` (the simulation engine's in-memory
grid, test doubles) is pulled one id per call on the workers, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from typing import Any, cast

from flwr.app import Message, Metadata
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.common.constant import ErrorCode
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest  # pylint: disable=no-name-in-module
from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=no-name-in-module
from flwr.serverapp import Grid
from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
from flwr.supercore.date import now
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    inflate_object_from_contents,
    pull_objects,
)
from flwr.superlink.grid.http_grid import HttpGrid

__all__ = ["ReplyPuller"]


class ReplyPuller:
    """Replies to the waiting message ids, at most ``workers`` inflated at once; use as a context manager.

    Workers are daemon threads: one abandoned at the deadline (a node that died half-way through
    its upload keeps Flower retrying for up to two hours) must not keep the ServerApp process from
    exiting when the run is over.
    """

    def __init__(self, grid: Grid, *, workers: int = 8) -> None:
        self.grid = grid
        self.workers = max(1, workers)
        self._listing = isinstance(grid, HttpGrid)
        self._listed: deque[tuple[str, Callable[[], list[Message]]]] = deque()  # listed, no worker yet
        self._claimed: set[str] = set()  # ids listed by the SuperLink (handed out once) or being pulled
        self._inflight: dict[str, Future[list[Message]]] = {}
        self._finished = threading.Event()  # set by a worker whose pull handed back a reply or failed

    def poll(self, message_ids: Iterable[str]) -> list[Message]:
        """Ask for the replies to ``message_ids`` not yet on their way; return the replies whose
        pulls finished. A failed request or pull raises here, as a direct call would."""
        self._finished.clear()  # before collecting: a pull ending after this wakes the next ``wait``
        waiting = [m for m in message_ids if m not in self._claimed]
        if self._listing:
            if waiting:
                for mid, pull in self._list(waiting):
                    self._claimed.add(mid)
                    self._listed.append((mid, pull))
        else:
            for mid in waiting:
                self._claimed.add(mid)
                self._listed.append((mid, partial(_pull_one, self.grid, mid)))
        while self._listed and len(self._inflight) < self.workers:
            mid, pull = self._listed.popleft()
            future: Future[list[Message]] = Future()
            threading.Thread(target=_run, args=(pull, future, self._finished), daemon=True,
                             name="quorumfl-pull").start()
            self._inflight[mid] = future
        replies: list[Message] = []
        for mid in [m for m, f in self._inflight.items() if f.done()]:
            got = self._inflight.pop(mid).result()
            if not self._listing and not got:
                self._claimed.discard(mid)  # its reply has not arrived: ask for it again on the next poll
            replies.extend(got)
        return replies

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds`` before the next ``poll``, ending early when a pull in flight hands back
        a reply (or fails): the next ``poll`` then hands it over."""
        self._finished.wait(seconds)

    def _list(self, message_ids: list[str]) -> list[tuple[str, Callable[[], list[Message]]]]:
        """One ``PullMessages`` request: the replies that have arrived, each with the pull of its objects."""
        grid = cast(Any, self.grid)
        response = grid._runtime_client.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
        return [(proto.metadata.reply_to_message_id, partial(_inflate, grid, proto, tree))
                for proto, tree in zip(response.messages_list, response.message_object_trees, strict=True)]

    def __enter__(self) -> ReplyPuller:
        return self

    def __exit__(self, *_: object) -> None:
        self._inflight.clear()  # pulls still running finish on their own threads; their replies are dropped
        self._listed.clear()


def _run(pull: Callable[[], list[Message]], future: Future[list[Message]], finished: threading.Event) -> None:
    """Run one pull into ``future``; wake the caller's ``wait`` when it has something to hand over (a
    reply or an error: a grid pulled one id per call answers an empty list for a reply not yet there,
    and waking on that would turn the caller's wait into a busy loop)."""
    try:
        got = pull()
    except BaseException as exc:  # handed to the caller by ``poll``
        future.set_exception(exc)
        finished.set()
        return
    future.set_result(got)
    if got:
        finished.set()


def _pull_one(grid: Grid, message_id: str) -> list[Message]:
    return list(grid.pull_messages([message_id]))


def _inflate(grid: Any, proto: Any, tree: Any) -> list[Message]:
    """Pull a listed reply's objects, confirm it and inflate it: Flower 1.42's ``HttpGrid.pull_messages``
    loop body for one message, including its error reply when the objects never arrive (a list of one)."""
    run_id = grid.run.run_id
    msg_id = proto.metadata.message_id
    try:
        contents = pull_objects(
            object_ids=[t.object_id for t in iterate_object_tree(tree)],
            pull_object_fn=make_pull_object_fn_protobuf(
                pull_object_protobuf=grid._runtime_client.PullObject, node=grid.node, run_id=run_id))
    except ObjectPullError as exc:
        return [make_message(
            metadata=Metadata(run_id=run_id, message_id="", src_node_id=grid.node.node_id,
                              dst_node_id=grid.node.node_id, message_type=SYSTEM_MESSAGE_TYPE, group_id="",
                              ttl=0, reply_to_message_id=proto.metadata.reply_to_message_id,
                              created_at=now().timestamp()),
            error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE,
                        reason=f"Reply message objects are unavailable. The sender may not have completed the "
                               f"upload before the object-push session expired. {exc}"))]
    grid._runtime_client.ConfirmMessageReceived(
        ConfirmMessageReceivedRequest(node=grid.node, run_id=run_id, message_object_id=msg_id))
    message = cast(Message, inflate_object_from_contents(msg_id, contents))
    message.metadata.__dict__["_message_id"] = msg_id
    return [message]
