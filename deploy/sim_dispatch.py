"""Flower's simulation engine hands its ClientApp workers their messages in one pass per tick, not
one pass per node.

Flower 1.42's simulation runtime moves messages from its in-memory link state to the ClientApp
workers in ``vce_api.add_messages_to_queue``: every 0.1 s it asks the link state, node by node, for
that node's next undelivered message (``get_message_ins(node_id, limit=1)``), and every such ask
scans all stored messages and re-checks each one's expiry. With N virtual nodes and about N stored
messages that is N² checks per tick under the link state's lock: at 1,000 departments the ServerApp's
process spent most of its CPU there (a py-spy dump showed that thread holding the GIL while the
ClientApp actors idled). ``add_messages_in_one_pass`` does the same thing in one pass: the link
state's own validity check once per stored message (it deletes expired and orphaned ones), then the
first undelivered message of each node, marked delivered and queued, at most one per node per tick
as Flower does. ``one_pass_dispatch`` installs it for the duration of a simulation. Nothing else of
Flower's runtime changes; Flower has no setting for this, which is why it is written here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from queue import Queue
from typing import Any

__all__ = ["add_messages_in_one_pass", "one_pass_dispatch"]

TICK_S = 0.1  # Flower's own interval between passes


def add_messages_in_one_pass(state: Any, queue: Queue[Any], nodes_mapping: Mapping[int, int],
                             f_stop: threading.Event) -> None:
    """Drop-in for ``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue`` (same arguments)."""
    from flwr.supercore.date import now

    while not f_stop.is_set():
        first: dict[int, Any] = {}
        with state.lock:
            state._check_stored_messages(set(state.message_ins_store))  # noqa: SLF001 (Flower's own check)
            for message in state.message_ins_store.values():
                node = message.metadata.dst_node_id
                if node in nodes_mapping and node not in first and message.metadata.delivered_at == "":
                    first[node] = message
            delivered_at = now().isoformat()
            for message in first.values():
                message.metadata.delivered_at = delivered_at
        for message in first.values():
            queue.put(message)
        f_stop.wait(TICK_S)


@contextlib.contextmanager
def one_pass_dispatch() -> Iterator[None]:
    """Use ``add_messages_in_one_pass`` in Flower's simulation runtime while the block runs."""
    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue
    vce_api.add_messages_to_queue = add_messages_in_one_pass
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original
