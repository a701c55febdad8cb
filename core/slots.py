"""Host slots, the primitive: K ``flock`` lock files that the ClientApps of several department nodes
on one machine share, so that at most K of them run at once (``deploy/host_slots.py`` says how a
node is set up for it, ``deploy/launch_gate.py`` takes a slot before Flower's ``flwr-clientapp``
starts). It sits in the core layer because both sides of that seam take slots: the launch gate, and
the ClientApp's handler when it was started without the gate (``hold_host_slot``).

Standard library (and the error tree) only: the launch gate imports this before anything heavy.
"""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from quorumfl.errors import ConfigError

__all__ = [
    "SLOTS_DIR_ENV",
    "SLOTS_ENV",
    "SLOT_HELD_ENV",
    "acquire_slot",
    "hold_host_slot",
    "slot_count",
    "slot_directory",
]

SLOTS_ENV = "QUORUMFL_CLIENTAPP_SLOTS"
SLOTS_DIR_ENV = "QUORUMFL_CLIENTAPP_SLOTS_DIR"
SLOT_HELD_ENV = "QUORUMFL_CLIENTAPP_SLOT_HELD"  # set for the exec'd ClientApp: it already holds a slot

_held: list[int] = []  # the slot's file descriptor, kept open for the life of the process


def slot_count(env: Mapping[str, str]) -> int | None:
    """K from the environment; None when no limit is set. Raises ValueError naming the variable."""
    spec = env.get(SLOTS_ENV, "").strip()
    if not spec:
        return None
    if not spec.isdigit() or not 1 <= int(spec) <= 4096:
        raise ValueError(f"{SLOTS_ENV}={spec!r} must be a whole number of slots between 1 and 4096")
    return int(spec)


def slot_directory(env: Mapping[str, str]) -> Path:
    return Path(env.get(SLOTS_DIR_ENV) or Path(tempfile.gettempdir()) / "quorumfl-clientapp-slots")


def acquire_slot(directory: Path, slots: int, *, timeout: float | None = None) -> tuple[int, int] | None:
    """Take one of ``slots`` lock files in ``directory``: (open fd holding it, slot number); None
    after ``timeout`` seconds (None: wait as long as it takes)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for slot in random.sample(range(slots), slots):
            fd = os.open(directory / f"slot-{slot}", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd, slot
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(0.05 + random.random() * 0.2)


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

