"""A ClientApp's reply reaches its SuperNode even when Flower's HTTP retry repeats an object push.

Flower 1.42's ClientApp sends its reply to the SuperNode in two steps (``run_clientapp.push_message``):
the message itself (``PushMessages``: the node opens a push session listing the objects it still
lacks), then each object (``PushObject``). Its HTTP client repeats a request after a transport
error or a 502/503/504. When the first attempt of an object push was stored and only its answer
was lost, the repeat is answered ``stored=False`` (the object is no longer pending in the session,
or the session is gone once nothing was), and ``push_message`` raises ``ObjectPushError``. The
ClientApp then exits with code 250 and the reply's other objects never arrive, while the
SuperNode's sender waits for them with no deadline (``start_client_internal._push_messages``): that
node sends no reply again until it is restarted, and each round waits for it until its timeout.
Seen once in a ten-node benchmark run on two cores (``Connection attempt failed, retrying`` just
before the error); reproduced with Flower's own node state in tests/client/test_reply_push.py.

``retry_reply_push()`` wraps ``push_message`` in the calling process so that an ``ObjectPushError``
sends the whole reply again, at most ``ATTEMPTS`` times in all: the SuperNode keeps the message it
already stored, opens a new session (dropping the old one's bookkeeping) and lists only the objects
still missing, so nothing stored is sent twice. Nothing else changes: the reply, its id and what the
node forwards are Flower's. It is called by the ClientApp entry points (``app_guard`` and the warm
server, whose forked tasks inherit it).

The SuperNode's own push of that reply to the SuperLink (``start_client_internal._push_messages``)
goes through the same HTTP retry: a repeated object push answered ``stored=False`` makes Flower log
``Failed to send message`` and drop the reply, and the server, which never gets the reply's
objects, waits for that node until the round's deadline (``server.pulling``).
``retry_link_push(module)``, which ``quorumfl.deploy.supernode`` applies to Flower's SuperNode loop,
sends the reply again on an ``ObjectPushError``, at most ``ATTEMPTS`` times in all, before Flower's
``finally`` deletes it: the SuperLink answers a repeated ``PushMessages`` for a reply it holds (both
of Flower's LinkStates take it as the same reply) with a new session listing only the objects it
still lacks, which are pushed from the node's object store. tests/client/test_reply_push.py drives
Flower's own LinkState and fleet handlers.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from types import ModuleType
from typing import Any

__all__ = ["ATTEMPTS", "retry_link_push", "retry_reply_push"]

ATTEMPTS = 3
_WRAPPED = "_quorumfl_retries_reply_push"
_CONTENT_WAIT_S = 0.05  # an object still arriving from the ClientApp: as Flower's sender waits, more often

log = logging.getLogger(__name__)


def retry_reply_push() -> None:
    """Wrap Flower's ``run_clientapp.push_message`` (once per process) as the module docstring says."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError
    from flwr.supernode.runtime import run_clientapp

    push: Any = run_clientapp.push_message
    if getattr(push, _WRAPPED, False):
        return
    if list(inspect.signature(push).parameters) != ["client", "message", "context"]:
        raise RuntimeError("flwr's run_clientapp.push_message no longer takes (client, message, context) as Flower "
                           "1.42's did; remove quorumfl.protocol.reply_push")

    def push_message(client: Any, message: Any, context: Any) -> None:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                push(client, message, context)
                return
            except ObjectPushError as exc:
                if attempt == ATTEMPTS:
                    raise
                log.warning("reply push failed (%s); pushing the reply again (attempt %d of %d)", exc, attempt + 1,
                            ATTEMPTS)

    setattr(push_message, _WRAPPED, True)
    run_clientapp.push_message = push_message


def retry_link_push(module: ModuleType) -> None:
    """Make ``module``'s ``_push_messages`` (Flower 1.42's SuperNode loop, ``start_client_internal``) push a
    reply to the SuperLink again after an ``ObjectPushError``, as the module docstring says."""
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    push_messages: Any = getattr(module, "_push_messages", None)
    push_contents: Any = getattr(module, "push_object_contents_from_iterable", None)
    if getattr(push_messages, _WRAPPED, False):
        return
    if (push_messages is None or push_contents is None
            or list(inspect.signature(push_messages).parameters) != ["state", "object_store", "send", "push_object"]):
        raise RuntimeError(f"{module.__name__} no longer pushes replies through _push_messages(state, object_store, "
                           "send, push_object) and push_object_contents_from_iterable as Flower 1.42 did; "
                           "remove quorumfl.protocol.reply_push.retry_link_push")
    pushing: dict[str, Any] = {}  # the reply being pushed: Flower's loop pushes one at a time, in one thread

    def push_again(contents: Any, push_object_fn: Any, **kwargs: Any) -> None:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                push_contents(contents, push_object_fn, **kwargs)
                return
            except ObjectPushError as exc:
                if attempt == ATTEMPTS or "reply" not in pushing:
                    raise
                log.warning("pushing a reply to the SuperLink failed (%s); pushing it again (attempt %d of %d)", exc,
                            attempt + 1, ATTEMPTS)
                message, tree, runtime = pushing["reply"]
                missing, session = pushing["send"](message, tree, runtime)  # the SuperLink lists what it lacks
                contents = [(t.object_id, _content(pushing["store"], t.object_id)) for t in iterate_object_tree(tree)
                            if t.object_id in missing]
                push_object_fn = functools.partial(pushing["push_object"], message.metadata.run_id, session)

    def push_messages_again(state: Any, object_store: Any, send: Any, push_object: Any) -> None:
        def recorded_send(message: Any, object_tree: Any, runtime: float) -> Any:
            pushing["reply"] = (message, object_tree, runtime)
            return send(message, object_tree, runtime)

        pushing.update(send=send, store=object_store, push_object=push_object)
        try:
            push_messages(state=state, object_store=object_store, send=recorded_send, push_object=push_object)
        finally:
            pushing.clear()

    setattr(push_messages_again, _WRAPPED, True)
    module.push_object_contents_from_iterable = push_again  # type: ignore[attr-defined]
    module._push_messages = push_messages_again  # type: ignore[attr-defined]


def _content(store: Any, object_id: str) -> bytes:
    """An object of the reply from the node's store, waiting while it is still arriving (``b""``), as
    Flower's sender does."""
    while (content := store.get(object_id)) == b"":
        time.sleep(_CONTENT_WAIT_S)
    if content is None:
        raise RuntimeError(f"object {object_id} of the reply is no longer in the node's store")
    return bytes(content)
