"""Which departments are really there: short heartbeats, and processes that end with their parent.

Flower 1.42's SuperNode tells the SuperLink every ~20 s that it is alive (``HEARTBEAT_DEFAULT_INTERVAL``
30 s), and the SuperLink counts a node online for ``HEARTBEAT_PATIENCE`` (2) intervals after its last
heartbeat: a department whose machine vanished was selected for about a minute, and a node started
again with the same key was refused as "still online" for as long. Neither value is a setting.
QuorumFL's SuperNode (``deploy.supernode``) announces a ``QUORUMFL_HEARTBEAT_S`` interval (5 s by
default) and beats at that pace, and QuorumFL's SuperLink (``deploy.admin_access``) accepts intervals
down to 1 s (Flower's floor is 10 s): a vanished node leaves selection 2 intervals after its last
beat. A node that stops cleanly (Ctrl-C, SIGTERM) tells the SuperLink at once: Flower's SuperNode
deactivates itself on a graceful exit.

A process started by ``quorumfl node start`` or ``server start`` (``ProcessGroup``) carries its
starter's pid (``PARENT_ENV``); QuorumFL's SuperNode and SuperLink watch it and end gracefully (so
the node deactivates) when the starter is gone, however it ended (SIGKILL included), and on their
way out stop every process below them (Flower's SuperExec and the apps it started).

Written here because neither Flower nor a library offers it: the values are module constants of
Flower's, replaced in these two processes before Flower reads them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from quorumfl.deploy.held_pulls import env_seconds

__all__ = ["HEARTBEAT_ENV", "PARENT_ENV", "accept_short_heartbeats", "end_with_parent", "heartbeat_interval",
           "offline_after", "shorten_node_heartbeat", "stop_below_on_exit"]

HEARTBEAT_ENV = "QUORUMFL_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 5.0
MIN_HEARTBEAT_S = 1.0
PARENT_ENV = "QUORUMFL_PARENT_PID"
PARENT_POLL_S = 0.2
PATIENCE = 2  # Flower's HEARTBEAT_PATIENCE: intervals after the last beat before a node counts as offline


def heartbeat_interval(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """The SuperNode heartbeat interval from ``QUORUMFL_HEARTBEAT_S``; raises ValueError naming it."""
    return env_seconds(HEARTBEAT_ENV, env.get(HEARTBEAT_ENV), default=DEFAULT_HEARTBEAT_S, low=MIN_HEARTBEAT_S,
                       high=600)


def offline_after(interval: float = DEFAULT_HEARTBEAT_S) -> float:
    """Seconds after a SuperNode's last heartbeat until the SuperLink counts it offline."""
    return PATIENCE * interval


def _set(module: Any, name: str, value: float) -> None:
    if not hasattr(module, name):
        raise RuntimeError(f"{module.__name__} no longer has {name} as Flower 1.42 did; run Flower's own process")
    setattr(module, name, value)


def shorten_node_heartbeat(interval: float) -> None:
    """In this SuperNode process: announce ``interval`` to the SuperLink and beat at that pace (each
    call waits at most half of it)."""
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_client, fleet_http_connection

    _set(fleet_http_connection, "HEARTBEAT_DEFAULT_INTERVAL", interval)  # what the SuperLink is told
    _set(heartbeat, "HEARTBEAT_DEFAULT_INTERVAL", interval)  # the sender's pace: (interval − timeout) × ~0.8
    _set(heartbeat, "HEARTBEAT_CALL_TIMEOUT", interval / 2)
    _set(fleet_http_client, "HEARTBEAT_CALL_TIMEOUT", interval / 2)


def accept_short_heartbeats() -> None:
    """In this SuperLink process: accept heartbeat intervals down to ``MIN_HEARTBEAT_S``."""
    from flwr.superlink.servicer.fleet import fleet_handlers

    _set(fleet_handlers, "HEARTBEAT_MIN_INTERVAL", MIN_HEARTBEAT_S)


def end_with_parent(env: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """When ``PARENT_ENV`` names this process's starter: a daemon thread sends this process SIGTERM
    (Flower's graceful exit) as soon as it is no longer this process's parent (it ended)."""
    raw = env.get(PARENT_ENV, "")
    if not raw.isdigit():
        return  # not started by a QuorumFL command

    def watch(parent: int) -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, args=(int(raw),), name="end-with-parent", daemon=True).start()


def stop_below_on_exit() -> None:
    """On Flower's graceful exit of this process: SIGTERM every process below it, SIGKILL any left
    after a few seconds."""
    from flwr.supercore.exit import add_exit_handler

    from quorumfl.deploy.processes import stop_descendants

    def stop_below() -> None:
        # Flower's handler put the default handlers back: another SIGINT (its heartbeat thread sends one
        # when the SuperLink drops this node's key) must not cut the clean-up short or change the exit code.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_descendants(os.getpid())

    add_exit_handler(stop_below)
