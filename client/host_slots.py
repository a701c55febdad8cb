"""Host slots: at most K ClientApps run at once on one machine that hosts several department nodes.

A city often runs the nodes of small departments on one shared server. Flower starts a fresh
ClientApp process per message on every node, so a round would start one process per node at the
same moment. With ``quorumfl node start --host-slots K`` (``host_slot_env``) the nodes' ClientApps
share K ``flock`` slots in one directory:

- Flower's ``flwr-clientapp`` is reached through the launch gate (``launch_gate.py``), which takes a
  slot before Flower's code starts and hands it to the ClientApp, which holds it until it ends;
- a ClientApp started without the gate (Flower found its own ``flwr-clientapp`` first on PATH)
  takes a slot in its handler, before it loads torch (``hold_host_slot``). Flower's task heartbeat
  runs in its own thread meanwhile, so a waiting ClientApp is not taken for a dead one.

The kernel frees a slot when its process ends, even after ``kill -9``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL

from quorumfl.aggregation.errors import ConfigError

from .launch_gate import (
    CLIENTAPP,
    GATE_REAL_ENV,
    GATE_WAIT_ENV,
    SLOT_HELD_ENV,
    SLOTS_DIR_ENV,
    SLOTS_ENV,
    acquire_slot,
    slot_count,
    slot_directory,
    write_gate,
)

__all__ = ["GATE_WAIT_S", "SLOTS_DIR_ENV", "SLOTS_ENV", "hold_host_slot", "host_slot_env"]

# The gate gives up well inside Flower's claim window, leaving time for Flower's own start-up.
GATE_WAIT_S = 0.6 * HEARTBEAT_DEFAULT_INTERVAL
_held: list[int] = []  # the slot's file descriptor, kept open for the life of the process


def host_slot_env(
    slots: int, directory: Path, *, path: str, real_clientapp: Path = Path(CLIENTAPP)
) -> dict[str, str]:
    """Environment for SuperNodes whose ClientApps share ``slots`` slots in ``directory``: the
    launch gate (written to ``directory/bin``) first on ``path``; ``real_clientapp``: Flower's
    ``flwr-clientapp`` (a bare name, the default, is looked up on ``path``)."""
    if not 1 <= slots <= 4096:
        raise ConfigError(f"host slots must be between 1 and 4096, got {slots}")
    real = str(real_clientapp) if real_clientapp.is_absolute() else shutil.which(str(real_clientapp), path=path)
    if real is None or not os.access(real, os.X_OK):
        raise ConfigError(f"Flower's {real_clientapp} is not an executable on PATH; install flwr in this environment")
    gate_dir = write_gate(directory / "bin")
    return {
        SLOTS_ENV: str(slots),
        SLOTS_DIR_ENV: str(directory),
        GATE_REAL_ENV: real,
        GATE_WAIT_ENV: str(GATE_WAIT_S),
        "PATH": os.pathsep.join([str(gate_dir), path]),
    }


def hold_host_slot(env: Mapping[str, str] = os.environ) -> int | None:
    """Block until one of the host's K slots is free and keep it; None when no limit is set or this
    process already holds a slot (taken here before, or by the launch gate)."""
    try:
        slots = slot_count(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if slots is None or _held or env.get(SLOT_HELD_ENV):
        return None
    held = acquire_slot(slot_directory(env), slots)
    assert held is not None  # no timeout: it waits
    fd, slot = held
    _held.append(fd)
    return slot

