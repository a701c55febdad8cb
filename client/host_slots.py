"""Host slots: at most K ClientApps train at once on one machine that hosts several department nodes.

A city often runs the nodes of small departments on one shared server. Flower starts a fresh
ClientApp process per message on every node, so a round would start one torch process per node at
the same moment; with ``QUORUMFL_CLIENTAPP_SLOTS=K`` (``quorumfl node start --host-slots K``) a
ClientApp takes one of K ``flock`` slots in ``QUORUMFL_CLIENTAPP_SLOTS_DIR`` before it loads torch and
holds it until its process ends (the kernel frees it even after ``kill -9``). Flower's task
heartbeat runs in its own thread meanwhile, so a waiting ClientApp is not taken for a dead one.
Nothing in the standard library or Flower bounds processes across independent nodes; a lock file
per slot is the smallest thing that does.
"""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from quorumfl.aggregation.errors import ConfigError

__all__ = ["SLOTS_DIR_ENV", "SLOTS_ENV", "hold_host_slot"]

SLOTS_ENV = "QUORUMFL_CLIENTAPP_SLOTS"
SLOTS_DIR_ENV = "QUORUMFL_CLIENTAPP_SLOTS_DIR"
_held: list[int] = []  # the slot's file descriptor, kept open for the life of the process


def hold_host_slot(env: Mapping[str, str] = os.environ) -> int | None:
    """Block until one of the host's K slots is free and keep it; None when no limit is set (or this
    process already holds a slot)."""
    spec = env.get(SLOTS_ENV, "").strip()
    if not spec or _held:
        return None
    if not spec.isdigit() or not 1 <= int(spec) <= 4096:
        raise ConfigError(f"{SLOTS_ENV}={spec!r} must be a whole number of slots between 1 and 4096")
    slots = int(spec)
    directory = Path(env.get(SLOTS_DIR_ENV) or Path(tempfile.gettempdir()) / "quorumfl-clientapp-slots")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    while True:
        for slot in random.sample(range(slots), slots):
            fd = os.open(directory / f"slot-{slot}", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _held.append(fd)
            return slot
        time.sleep(0.05 + random.random() * 0.2)
