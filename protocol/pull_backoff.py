"""Shorter waits when a Flower process pulls a message's objects before they have arrived.

Flower 1.42 moves a message's content as separate objects (``flwr/supercore/inflatable``): the
receiver gets the message first and then pulls each object, retrying an object that is not there
yet after an exponential backoff that starts at 1 s (``PULL_INITIAL_BACKOFF``) and grows to 10 s.
That happens on every hop of a round: the SuperNode stores a message before it has pulled its
objects from the SuperLink, so the ClientApp that Flower starts for it usually asks too early and
sleeps a whole second; likewise the ServerApp pulling a reply whose objects are still being
pushed. For a 4.5 MB model that wait is most of a message's latency.

``shorten_pull_backoff()`` changes only the defaults of Flower's two pull functions in the calling
process: the first retry after 0.05 s, doubling up to 1 s (every retry is one small local or
loopback RPC), with Flower's own limits on tries and total time unchanged. It is called by the
SuperNode (``quorumfl.deploy.supernode``), the ClientApp entry points (``app_guard`` and the warm
server) and the ServerApp.
"""

from __future__ import annotations

__all__ = ["BACKOFF_CAP_S", "INITIAL_BACKOFF_S", "shorten_pull_backoff"]

INITIAL_BACKOFF_S = 0.05
BACKOFF_CAP_S = 1.0


def shorten_pull_backoff() -> None:
    """Set Flower's object-pull backoff to ``INITIAL_BACKOFF_S`` doubling to ``BACKOFF_CAP_S`` in this process."""
    from flwr.supercore.inflatable import inflatable_utils

    for function in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        defaults = function.__kwdefaults__
        if not defaults or "initial_backoff" not in defaults or "backoff_cap" not in defaults:
            raise RuntimeError(f"flwr's {function.__name__} no longer takes initial_backoff/backoff_cap as "
                               "Flower 1.42 did; remove quorumfl.protocol.pull_backoff")
        defaults["initial_backoff"] = INITIAL_BACKOFF_S
        defaults["backoff_cap"] = BACKOFF_CAP_S
