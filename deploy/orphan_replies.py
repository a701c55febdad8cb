"""The SuperNode pushes only replies to messages it still holds, so a stray reply cannot take the
place of the one its loop waits for.

Flower 1.42's SuperNode loop (``flwr/supernode/start_client_internal.py``) pulls one message from
the SuperLink, then waits in ``_push_messages`` until *a* reply is in its node state, pushes every
reply it finds there, deletes each with the message it answers, and only then pulls again. It takes
whichever reply it finds as the awaited one. A second reply to a message already answered and
deleted is such a reply: a ClientApp of a run that was stopped at the SuperLink pushes its reply,
the node drops it ("Run … is not in `RUNNING` status") and deletes its objects while the ClientApp
is still sending them, and the ClientApp pushes the whole reply again (``protocol.reply_push``).
The loop then pushes that stray reply (refused), goes back to pulling, and the reply it was
waiting for stays in the node state until the next message arrives: every later reply of that node
is one message late. Seen when an admin stopped a run mid-round and resumed it: rounds 2 and 3 of
the resumed run each waited for their deadline with the keys of one of three departments.

``skip_orphan_replies(module)`` hands Flower's ``_push_messages`` a view of the node state in which
a reply whose instruction the node no longer holds is deleted, with its objects, instead of
returned, so the loop keeps waiting for the reply it pulled a message for. Flower keeps an
instruction in its node state until its reply has been pushed (``_push_messages`` deletes both in
its ``finally``) and makes its own error replies only for instructions it holds, so no reply Flower
would push to a waiting server is skipped. Flower has no hook for this, hence the wrapping.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["HeldReplies", "skip_orphan_replies"]

_WRAPPED = "_quorumfl_skips_orphan_replies"

log = logging.getLogger(__name__)


class HeldReplies:
    """Flower's in-memory node state, except that asking for replies drops those whose instruction is
    gone (the module docstring says why)."""

    def __init__(self, state: Any, object_store: Any) -> None:
        if not hasattr(state, "msg_store") or not hasattr(state, "lock_msg_store"):
            raise RuntimeError(f"Flower's {type(state).__name__} no longer keeps messages in msg_store as Flower "
                               "1.42's InMemoryNodeState did; remove quorumfl.deploy.orphan_replies")
        self._state = state
        self._objects = object_store

    def get_messages_legacy(self, **kwargs: Any) -> Sequence[Any]:
        messages: Sequence[Any] = self._state.get_messages_legacy(**kwargs)
        if kwargs.get("is_reply") is not True:
            return messages
        with self._state.lock_msg_store:
            held = set(self._state.msg_store)
        kept = [m for m in messages if m.metadata.reply_to_message_id in held]
        for stray in (m for m in messages if m.metadata.reply_to_message_id not in held):
            log.warning("dropping a reply of run %s to message %s, which this node has already answered",
                        stray.metadata.run_id, stray.metadata.reply_to_message_id)
            self._state.delete_messages(message_ids=[stray.metadata.message_id])
            self._objects.delete(stray.metadata.message_id)
        return kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


def skip_orphan_replies(module: ModuleType) -> None:
    """Make ``module``'s ``_push_messages`` (Flower 1.42's SuperNode loop) see the node state through
    ``HeldReplies``."""
    push_messages: Any = getattr(module, "_push_messages", None)
    if getattr(push_messages, _WRAPPED, False):
        return
    if push_messages is None or list(inspect.signature(push_messages).parameters) != [
            "state", "object_store", "send", "push_object"]:
        raise RuntimeError(f"{module.__name__} no longer pushes replies through _push_messages(state, object_store, "
                           "send, push_object) as Flower 1.42 did; remove quorumfl.deploy.orphan_replies")

    @functools.wraps(push_messages)  # keeps the marks of the wrappers below (``reply_push``)
    def push_held_replies(state: Any, object_store: Any, send: Any, push_object: Any) -> None:
        push_messages(state=HeldReplies(state, object_store), object_store=object_store, send=send,
                      push_object=push_object)

    setattr(push_held_replies, _WRAPPED, True)
    module._push_messages = push_held_replies  # type: ignore[attr-defined]
