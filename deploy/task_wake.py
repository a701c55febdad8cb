"""The SuperNode wakes its SuperExec when a message has arrived, instead of the SuperExec polling fast.

Flower 1.42's SuperExec asks its SuperNode for a new app task every
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds (``flwr/supercore/superexec/run_superexec.py``), and
each ask is an HTTP request through both processes' protocol stacks. Asking often costs CPU on
every idle node; asking rarely adds the wait to every message of a round (train, each
secure-aggregation stage, evaluate). Measured A/B in a masking run of ten nodes on two cores
(about 40 s): the ten SuperExecs used 2.2-2.9 s of CPU asking every 0.25 s and 0.9-1.0 s when woken,
and their SuperNodes, which answer the asks, 15.8-18.1 s against 13.7-14.9 s. Flower has no
notification between the two processes, and the SuperNode is the one that knows when a message has
been stored.

So the SuperNode (``quorumfl.deploy.supernode``) picks a random name for a Unix datagram socket in
Linux's abstract namespace (no file to clean up after a crash), passes it through
``QUORUMFL_TASK_WAKE`` to the SuperExec it starts, and sends one byte there each time it has stored
a message from the SuperLink. The SuperExec (``launch_gate.superexec_main``) binds that name and
waits on it between asks, for at most ``FALLBACK_POLL_S`` (1 s, Flower's default), so a lost or
early wake-up costs at most Flower's own default wait. It counts only datagrams whose sender
(``SO_PASSCRED``) is its own user, and asks at most 50 times a second however many arrive. A
wake-up only makes the SuperExec ask sooner; what it launches is still what the SuperNode's Runtime
API answers. Nothing changes when the variable is unset or the name cannot be bound (the SuperExec
then polls as configured).

Standard library only: the SuperExec imports this before Flower.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import struct
import time
from typing import Any

__all__ = ["FALLBACK_POLL_S", "WAKE_ENV", "Waker", "WakeableSleep", "new_wake_name"]

WAKE_ENV = "QUORUMFL_TASK_WAKE"
FALLBACK_POLL_S = 1.0
_MIN_GAP_S = 0.02  # a flood of wake-ups cannot make the SuperExec ask more than 50 times a second
_PREFIX = "quorumfl-task-wake-"
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def new_wake_name() -> str:
    """A fresh random name for the abstract socket (128 bits, so no other SuperNode picks it)."""
    return _PREFIX + secrets.token_hex(16)


def _address(name: str) -> bytes:
    return b"\0" + name.encode("ascii")


class Waker:
    """The SuperNode's end: one datagram to the SuperExec's socket per stored message; errors are
    ignored (the SuperExec still asks every ``FALLBACK_POLL_S``)."""

    def __init__(self, name: str) -> None:
        self.address = _address(name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendto(b"w", self.address)


class WakeableSleep:
    """The SuperExec's end, standing in for the ``time`` module inside Flower's SuperExec loop:
    ``sleep`` returns at the first wake-up from this user or after ``FALLBACK_POLL_S``."""

    def __init__(self, name: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.sock.bind(_address(name))
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.uid = os.getuid()
        self._last = 0.0

    @classmethod
    def from_env(cls) -> WakeableSleep | None:
        """The socket named by ``QUORUMFL_TASK_WAKE``; None when unset, malformed or taken."""
        name = os.environ.get(WAKE_ENV, "")
        if not name.startswith(_PREFIX) or not name.isascii() or len(name) > 100:
            return None
        try:
            return cls(name)
        except OSError:
            return None

    def sleep(self, seconds: float) -> None:
        del seconds  # the configured interval: a wake-up or the fallback ends the wait instead
        gap = _MIN_GAP_S - (time.monotonic() - self._last)
        if gap > 0:
            time.sleep(gap)
        deadline = time.monotonic() + FALLBACK_POLL_S
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self.sock], [], [], left)
            if readable and self._drain():
                break
        self._last = time.monotonic()

    def _drain(self) -> bool:
        """Read every queued datagram; whether one came from this user."""
        ours = False
        while True:
            try:
                _data, ancillary, _flags, _addr = self.sock.recvmsg(16, socket.CMSG_SPACE(_CREDS.size))
            except OSError:  # nothing queued (BlockingIOError) or the socket failed: what was read counts
                return ours
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _CREDS.size:
                    ours = ours or _CREDS.unpack(payload[: _CREDS.size])[1] == self.uid

    def close(self) -> None:
        self.sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)
