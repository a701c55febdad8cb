"""The SuperLink answers for a message whose node restarted after taking it.

Flower's link state turns a pulled reply into a "node unavailable" error only while the message's
destination node is offline. A department that restarts its SuperNode mid-round (an update, a
crash, a reboot: same key, so the same node id) is offline only between the old process's last
heartbeat running out and the new one's activation; a ServerApp that does not pull in that window
never hears of it. The message the old process took (``delivered_at`` set) is not delivered again
and will never be answered, so the round waited for it until its timeout (241 s instead of 49 s in
the ten-node masked test, where a killed node came back within the window).

``install`` wraps both link states Flower ships (in memory and SQL): each message a node takes is
remembered with its delivery time, and a pulled message with no reply whose node was activated
after that delivery gets the same error reply Flower gives for an offline node
(``create_message_error_unavailable_res_message(…, "node_unavail")``). A reply already stored is
returned as before; the wrapper never hides one. Flower has no hook for this, hence the wrapping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

__all__ = ["install", "restarted_since_delivery"]

_INSTALLED = "_quorumfl_restart_aware"
_TAKEN = "_quorumfl_taken"  # on each link state: message id -> its metadata when its node took it


def restarted_since_delivery(delivered_at: str, last_activated_at: str) -> bool:
    """True when the node's latest activation came after the message was delivered (both ISO 8601
    times as Flower writes them; an empty or unreadable one is never taken as a restart)."""
    try:
        return bool(delivered_at and last_activated_at) and (
            datetime.fromisoformat(last_activated_at) > datetime.fromisoformat(delivered_at))
    except ValueError:
        return False


def _activated_at(state: Any, node_ids: set[int]) -> dict[int, str]:
    return {int(info.node_id): str(info.last_activated_at or "") for info in state.get_node_info(node_ids=node_ids)}


def _wrap(cls: type) -> None:
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    if getattr(cls, _INSTALLED, False):
        return
    take: Callable[..., list[Any]] = cls.get_message_ins  # type: ignore[attr-defined]
    answer: Callable[..., list[Any]] = cls.get_message_res  # type: ignore[attr-defined]
    lock = threading.Lock()

    def taken(state: Any) -> dict[str, Any]:
        mine: dict[str, Any] = state.__dict__.setdefault(_TAKEN, {})
        return mine

    def get_message_ins(self: Any, node_id: int, limit: int | None, **kw: Any) -> list[Any]:
        delivered = take(self, node_id, limit, **kw)
        with lock:
            mine = taken(self)
            now = time.time()
            for stale in [i for i, m in mine.items() if m.created_at + m.ttl < now]:  # past its TTL: never asked
                del mine[stale]
            for message in delivered:
                mine[message.metadata.message_id] = message.metadata
        return delivered

    def get_message_res(self: Any, message_ids: set[str], run_id: int) -> list[Any]:
        asked = set(message_ids)
        replies = answer(self, message_ids, run_id)
        with lock:
            mine = taken(self)
            for reply in replies:
                mine.pop(reply.metadata.reply_to_message_id, None)
            open_ids = asked - {r.metadata.reply_to_message_id for r in replies}
            pending = {i: mine[i] for i in open_ids if i in mine}
        if not pending:
            return replies
        activated = _activated_at(self, {int(m.dst_node_id) for m in pending.values()})
        lost = [i for i, m in pending.items()
                if restarted_since_delivery(m.delivered_at, activated.get(int(m.dst_node_id), ""))]
        with lock:
            for i in lost:
                taken(self).pop(i, None)
        return [*replies, *(create_message_error_unavailable_res_message(pending[i], "node_unavail") for i in lost)]

    cls.get_message_ins = get_message_ins  # type: ignore[attr-defined]
    cls.get_message_res = get_message_res  # type: ignore[attr-defined]
    setattr(cls, _INSTALLED, True)


def install() -> None:
    """Make Flower's in-memory and SQL link states answer for messages lost to a node's restart."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    for cls in (InMemoryLinkState, SqlLinkState):
        _wrap(cls)
