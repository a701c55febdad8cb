"""The SuperLink holds a SuperNode's pull that would come back empty until a message for it arrives.

Flower 1.42's SuperNodes ask the SuperLink for their next message (``POST /v1/fleet/pull-messages``)
and, when there is none, sleep and ask again (``quorumfl.deploy.supernode`` shortened Flower's 3 s
sleep to 0.5 s). Every message of a round therefore waits for its node's next ask: on average half
an interval, and a stage of ten nodes waits for the slowest of ten, about a whole one. A masked
round has three such stages (train, consistency, unmask) and a CKKS round two. Asking more often
does not help on a loaded server: each ask costs the SuperLink about 3.5 ms of CPU (TLS, HTTP,
Flower's middleware, the node's signature), so ten nodes asking every 0.1 s took a third of a core
from the stages themselves. Flower's Fleet API has no push and no long poll.

So the SuperLink answers an ask only when it has something, or after ``hold`` seconds (a long
poll), without changing what Flower answers:

- ``PullTracker`` follows Flower's link state (both stores it ships, wrapped by ``install``): each
  message stored for a node bumps that node's count once all its objects are there (the ServerApp
  pushes a message first and its objects after it: ``store_message_and_object_tree`` says which are
  missing, ``store_object`` stores each; a message stored without a tree, ``store_message_ins``,
  counts at once), and each ask that found nothing (``get_message_ins`` returning no message)
  records the count it started from. Waking a node before its message's objects are there had ten
  nodes retrying pulls of absent objects while the model was still being pushed, which slowed
  the push itself (a train stage's push took 1.6 s).
- ``HeldPulls`` (ASGI, outermost) reads a pull request's small protobuf body, and when that node's
  last ask found nothing and nothing has been stored for it since, waits until a message is stored
  for it or ``hold`` passes; then it hands the request, body unchanged, to Flower's own stack
  (node authentication included), which answers as it always does.

What cannot go wrong: a hold only delays an answer, by at most ``hold``, and never changes it. A
node id that never passed Flower's node authentication cannot be held (it has no empty ask on
record), and a node has at most one held ask: a second ask for it (an attacker replaying its id)
goes straight through, so the worst an attacker on the network can do is return that node to plain
polling. A message that becomes available in a way these wrappers do not see (or whose push never
finishes) reaches its node at most ``hold`` late. The SuperNode (``quorumfl.deploy.supernode``)
asks again at once instead of sleeping after an empty ask that took about ``hold`` and after the
first empty ask that follows a message (never held: another message may be waiting); against a SuperLink that does not hold, it
keeps its poll interval.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

__all__ = ["HOLD_ENV", "PULL_PATH", "HeldPulls", "PullTracker", "env_seconds", "hold_seconds", "install", "tracker"]

HOLD_ENV = "QUORUMFL_PULL_HOLD_S"
DEFAULT_HOLD_S = 1.0
PULL_PATH = "/v1/fleet/pull-messages"
PENDING_TTL_S = 600.0  # a message whose objects are not all pushed by then is no longer waited for
MAX_BODY = 64 * 1024  # a pull request is a node id and a signature; anything larger goes through unheld
_INSTALLED = "_quorumfl_pulls_tracked"


def env_seconds(name: str, raw: str | None, *, default: float, low: float, high: float) -> float:
    """A number of seconds from the environment variable ``name`` (``raw`` its value; unset or blank:
    ``default``); raises ValueError naming the variable and the range."""
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        raise ValueError(f"{name}={raw!r} must be a number of seconds between {low:g} and {high:g}")
    return value


def hold_seconds(raw: str | None) -> float:
    """The hold from ``QUORUMFL_PULL_HOLD_S`` (0 turns holding off); raises ValueError naming it."""
    return env_seconds(HOLD_ENV, raw, default=DEFAULT_HOLD_S, low=0, high=10)


class PullTracker:
    """Per node: how many messages were stored for it (counted once each message's objects are all
    there), and that count when an ask last found nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: dict[int, int] = {}
        self._empty_at: dict[int, int] = {}
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._pending: dict[str, tuple[int, set[str], float]] = {}  # message id -> (node, objects missing, since)
        self._by_object: dict[str, set[str]] = {}  # object id -> messages waiting for it

    def registered(self, message_id: str, node: int, missing: Iterable[str]) -> None:
        """A message for ``node`` was stored whose objects ``missing`` are still to be pushed: it counts
        (and wakes the node) once the last of them is stored, so the node does not pull objects that
        are not there yet (each such pull is retried after a back-off, and ten nodes retrying slowed
        the very push they waited for)."""
        wanted = set(missing)
        if not wanted:
            self.stored(node)
            return
        now = time.monotonic()
        with self._lock:
            for old in [m for m, (_, _, since) in self._pending.items() if now - since > PENDING_TTL_S]:
                self._forget(old)  # a push that never finished: its node gets the message unheld
            self._pending[message_id] = (node, wanted, now)
            for object_id in wanted:
                self._by_object.setdefault(object_id, set()).add(message_id)

    def object_stored(self, object_id: str) -> None:
        """An object was stored: every message it completes now counts for its node."""
        complete = []
        with self._lock:
            for message_id in self._by_object.pop(object_id, set()):
                entry = self._pending.get(message_id)
                if entry is None:
                    continue
                entry[1].discard(object_id)
                if not entry[1]:
                    del self._pending[message_id]
                    complete.append(entry[0])
        for node in complete:
            self.stored(node)

    def _forget(self, message_id: str) -> None:  # the caller holds the lock
        _, missing, _ = self._pending.pop(message_id)
        for object_id in missing:
            waiting = self._by_object.get(object_id)
            if waiting is not None:
                waiting.discard(message_id)
                if not waiting:
                    del self._by_object[object_id]

    def stored_count(self, node: int) -> int:
        with self._lock:
            return self._stored.get(node, 0)

    def stored(self, node: int) -> None:
        """A message for ``node`` was stored: wake its held ask, if any."""
        with self._lock:
            self._stored[node] = self._stored.get(node, 0) + 1
            waiter = self._waiters.get(node)
        if waiter is not None:
            loop, event = waiter
            loop.call_soon_threadsafe(event.set)

    def asked(self, node: int, count_before: int, got: int) -> None:
        """An ask for ``node`` that began when its count was ``count_before`` returned ``got`` messages."""
        if got == 0:
            with self._lock:
                self._empty_at[node] = count_before

    def idle(self, node: int) -> bool:
        """True when the node's last ask found nothing and nothing was stored for it since."""
        with self._lock:
            return self._idle(node)

    def _idle(self, node: int) -> bool:  # the caller holds the lock
        return node in self._empty_at and self._empty_at[node] == self._stored.get(node, 0)

    async def hold(self, node: int, seconds: float) -> bool:
        """Wait until a message is stored for ``node`` or ``seconds`` pass, if the node is idle and no
        other ask of it is held; True when it waited."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._lock:
            if node in self._waiters or not self._idle(node):
                return False
            self._waiters[node] = (loop, event)
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.pop(node, None)
        return True


_current = PullTracker()  # process-wide, whichever link-state object Flower stores through


def tracker() -> PullTracker:
    """The tracker the link states feed (the last one ``install`` was given)."""
    return _current


_in_tree_store = threading.local()  # set while Flower stores a message with its object tree


def _wrap(cls: type) -> None:
    if getattr(cls, _INSTALLED, False):
        return
    for name in ("store_message_ins", "get_message_ins", "store_message_and_object_tree", "store_object"):
        if not callable(getattr(cls, name, None)):
            raise RuntimeError(f"Flower's {cls.__name__} no longer has {name} as Flower 1.42 did; "
                               f"set {HOLD_ENV}=0 and remove quorumfl.deploy.held_pulls")
    store: Callable[..., str | None] = cls.store_message_ins  # type: ignore[attr-defined]
    take: Callable[..., list[Any]] = cls.get_message_ins  # type: ignore[attr-defined]
    store_tree: Callable[..., tuple[bool, list[str]]] = cls.store_message_and_object_tree  # type: ignore[attr-defined]
    store_object: Callable[..., bool] = cls.store_object  # type: ignore[attr-defined]

    def store_message_ins(self: Any, message: Any, *args: Any, **kw: Any) -> str | None:
        stored = store(self, message, *args, **kw)
        if stored is not None and not getattr(_in_tree_store, "active", False):
            _current.stored(int(message.metadata.dst_node_id))
        return stored

    def store_message_and_object_tree(self: Any, message: Any, *args: Any, **kw: Any) -> tuple[bool, list[str]]:
        _in_tree_store.active = True
        try:
            stored, missing = store_tree(self, message, *args, **kw)
        finally:
            _in_tree_store.active = False
        if stored and not message.metadata.reply_to_message_id:  # an instruction for a node
            _current.registered(str(message.metadata.message_id), int(message.metadata.dst_node_id), missing)
        return stored, missing

    def store_object_and_count(self: Any, run_id: int, session_id: str, object_id: str, *args: Any,
                               **kw: Any) -> bool:
        stored = store_object(self, run_id, session_id, object_id, *args, **kw)
        if stored:
            _current.object_stored(object_id)
        return stored

    def get_message_ins(self: Any, node_id: int, limit: int | None, *args: Any, **kw: Any) -> list[Any]:
        pulls = _current
        before = pulls.stored_count(int(node_id))
        delivered = take(self, node_id, limit, *args, **kw)
        pulls.asked(int(node_id), before, len(delivered))
        return delivered

    cls.store_message_ins = store_message_ins  # type: ignore[attr-defined]
    cls.get_message_ins = get_message_ins  # type: ignore[attr-defined]
    cls.store_message_and_object_tree = store_message_and_object_tree  # type: ignore[attr-defined]
    cls.store_object = store_object_and_count  # type: ignore[attr-defined]
    setattr(cls, _INSTALLED, True)


def install(pulls: PullTracker | None = None) -> PullTracker:
    """Feed ``pulls`` (default: the one already fed) from both link states Flower ships; returns it."""
    global _current
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    if pulls is not None:
        _current = pulls
    for cls in (InMemoryLinkState, SqlLinkState):
        _wrap(cls)
    return _current


def _node_of(body: bytes) -> int | None:
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from google.protobuf.message import DecodeError

    request = PullMessagesRequest()
    try:
        request.ParseFromString(body)
    except DecodeError:
        return None
    return int(request.node.node_id) if request.HasField("node") else None


Receive = Callable[[], Awaitable[dict[str, Any]]]


class HeldPulls:
    """ASGI middleware: a SuperNode's pull for which nothing is waiting is held up to ``hold``
    seconds (see the module docstring); everything else passes straight on."""

    def __init__(self, app: Any, pulls: PullTracker, hold: float) -> None:
        self.app, self.pulls, self.hold = app, pulls, hold

    async def __call__(self, scope: Any, receive: Receive, send: Any) -> None:
        if self.hold <= 0 or scope["type"] != "http" or scope.get("path") != PULL_PATH or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        body = b""
        more = True
        while more and len(body) <= MAX_BODY:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
        if not more and messages and messages[-1]["type"] == "http.request":
            node = _node_of(body)
            if node is not None:
                await self.pulls.hold(node, self.hold)
        replay = list(messages)

        async def replayed() -> dict[str, Any]:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)
