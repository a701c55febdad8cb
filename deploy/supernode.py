"""Flower's ``flower-supernode`` with shorter waits between its polls.

Flower 1.42's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps a fixed 3 s after
every pull from the SuperLink that brought no message, and 0.5 s at a time while it waits for the
ClientApp's reply to appear in its own local state; neither is configurable. Every message of a
round (train, each secure-aggregation stage, evaluate) waits on average 1.5 s, and up to 3.5 s, in
those sleeps alone: in a masked round of four departments the consistency and unmask stages took
3.3-3.9 s each for messages of a few hundred bytes.

``python -m quorumfl.deploy.supernode <flower-supernode arguments>`` runs Flower's SuperNode
unchanged except for those two waits in that module: the pull from the SuperLink is repeated every
``QUORUMFL_SUPERNODE_POLL_S`` seconds (0.5 by default; a larger value costs latency, a smaller one
more requests on the SuperLink: one small RPC per idle node per interval), and the local wait for
a reply checks every 0.05 s (no network); its pulls of a message's objects retry after 0.05 s
instead of 1 s (``pull_backoff``); and once a message from the SuperLink is stored, it wakes the
SuperExec it started (``task_wake``), which otherwise asks for new tasks only every second. With
warm ClientApps (``launch_gate.WARM_ENV`` set) it starts the warm server as it starts
(``warm.prestart``), so a run's first tasks do not all start cold together. A reply whose push to
the SuperLink failed on a repeated object push is pushed again (``reply_push.retry_link_push``)
instead of dropped, and a stray second reply to a message it has already answered cannot take the
place of the reply its loop waits for (``orphan_replies``). It beats every few seconds instead of
every ~20 (``QUORUMFL_HEARTBEAT_S``), ends with the ``quorumfl`` command that started it, and stops
the processes below it as it ends (``liveness``). Nothing else of Flower's behaviour changes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import ModuleType
from typing import Any

from quorumfl.deploy.held_pulls import HOLD_ENV, env_seconds, hold_seconds
from quorumfl.deploy.launch_gate import WARM_ENV
from quorumfl.deploy.liveness import (
    end_with_parent,
    heartbeat_interval,
    shorten_node_heartbeat,
    stop_below_on_exit,
)
from quorumfl.deploy.orphan_replies import skip_orphan_replies
from quorumfl.deploy.task_wake import WAKE_ENV, Waker, new_wake_name
from quorumfl.protocol.pull_backoff import shorten_pull_backoff
from quorumfl.protocol.reply_push import retry_link_push

__all__ = ["POLL_ENV", "main", "patch_waits", "poll_interval", "wake_after_store"]

POLL_ENV = "QUORUMFL_SUPERNODE_POLL_S"
DEFAULT_POLL_S = 0.5
LOCAL_WAIT_S = 0.05
_FLOWER_IDLE_SLEEP_S = 3  # the one sleep in Flower's loop that follows an empty pull from the SuperLink


def poll_interval(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """The SuperLink poll interval from ``QUORUMFL_SUPERNODE_POLL_S``; raises ValueError naming it."""
    return env_seconds(POLL_ENV, env.get(POLL_ENV), default=DEFAULT_POLL_S, low=0.05, high=3)


class _Waits:
    """Stands in for the ``time`` module inside Flower's SuperNode loop: only ``sleep`` differs. After
    an empty pull the SuperLink held, or the first empty pull after a message (which the SuperLink
    never holds: another message may be waiting), it asks again at once (``again``, set by
    ``wake_after_store``); the next pull is then held."""

    def __init__(self, poll: float) -> None:
        self.poll = poll
        self.again = False

    def sleep(self, seconds: float) -> None:
        if seconds >= _FLOWER_IDLE_SLEEP_S:
            time.sleep(LOCAL_WAIT_S if self.again else self.poll)
        else:
            time.sleep(min(seconds, LOCAL_WAIT_S))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def patch_waits(module: ModuleType, poll: float) -> _Waits:
    """Make ``module``'s sleeps (Flower's SuperNode loop) wait ``poll`` after an empty pull and
    ``LOCAL_WAIT_S`` in its local waits."""
    if getattr(module, "time", None) is not time:
        raise RuntimeError(f"{module.__name__} no longer uses the time module as Flower 1.42 did; "
                           "run Flower's flower-supernode directly")
    waits = _Waits(poll)
    module.time = waits  # type: ignore[attr-defined]
    return waits


def wake_after_store(module: ModuleType, waker: Waker, waits: _Waits | None = None, hold: float = 0.0) -> None:
    """Make ``module``'s ``_pull_and_store_message`` (Flower's SuperNode loop) wake the SuperExec
    after each message it has stored, and tell ``waits`` to ask again at once after an empty pull
    that the SuperLink held (it took at least half of ``hold``: ``quorumfl.deploy.held_pulls``) or
    that followed a message, when the SuperLink holds pulls (``hold`` > 0)."""
    pull_and_store = getattr(module, "_pull_and_store_message", None)
    if pull_and_store is None:
        raise RuntimeError(f"{module.__name__} no longer has _pull_and_store_message as Flower 1.42 did; "
                           "run Flower's flower-supernode directly")

    after_message = False

    def pull_store_and_wake(*args: Any, **kwargs: Any) -> Any:
        nonlocal after_message
        started = time.monotonic()
        run_id = pull_and_store(*args, **kwargs)
        if run_id is not None:
            waker.wake()
        if waits is not None:
            held = time.monotonic() - started >= hold / 2
            waits.again = run_id is None and hold > 0 and (held or after_message)
        after_message = run_id is not None
        return run_id

    module._pull_and_store_message = pull_store_and_wake  # type: ignore[attr-defined]


def main() -> None:
    try:
        poll = poll_interval()
        hold = hold_seconds(os.environ.get(HOLD_ENV))
        heartbeat = heartbeat_interval()
    except ValueError as exc:
        print(f"quorumfl supernode: {exc}", file=sys.stderr)
        sys.exit(78)
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli import flower_supernode

    shorten_node_heartbeat(heartbeat)
    end_with_parent()
    stop_below_on_exit()
    waits = patch_waits(start_client_internal, poll)
    shorten_pull_backoff()
    retry_link_push(start_client_internal)
    skip_orphan_replies(start_client_internal)
    if os.environ.get(WARM_ENV):  # this node's ClientApps are warm: have the server ready before the first task
        from quorumfl.deploy.warm import prestart

        threading.Thread(target=prestart, args=(dict(os.environ), os.getpid()), name="warm-clientapp-prestart",
                         daemon=True).start()
    wake_name = new_wake_name()
    os.environ[WAKE_ENV] = wake_name  # for the SuperExec that Flower's SuperNode starts
    wake_after_store(start_client_internal, Waker(wake_name), waits, hold)
    sys.argv = ["flower-supernode", *sys.argv[1:]]
    flower_supernode()


if __name__ == "__main__":
    main()
