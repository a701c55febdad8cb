"""Host slots: at most K ClientApps run at once on one machine that hosts several department nodes.

A city often runs the nodes of small departments on one shared server. Flower starts a fresh
ClientApp process per message on every node, so a round would start one process per node at the
same moment. With ``quorumfl node start --host-slots K`` (``host_slot_env``) the nodes' ClientApps
share K ``flock`` slots in one directory:

- Flower's ``flwr-clientapp`` is reached through the launch gate (``launch_gate.py``), which takes a
  slot before Flower's code starts and hands it to the ClientApp, which holds it until it ends;
- a ClientApp started without the gate (Flower found its own ``flwr-clientapp`` first on PATH)
  takes a slot in its handler, before it loads torch (``quorumfl.core.slots.hold_host_slot``). Flower's task heartbeat
  runs in its own thread meanwhile, so a waiting ClientApp is not taken for a dead one.

The kernel frees a slot when its process ends, even after ``kill -9``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL

from quorumfl.core.slots import SLOTS_DIR_ENV, SLOTS_ENV
from quorumfl.deploy.launch_gate import CLIENTAPP, GATE_REAL_ENV, GATE_WAIT_ENV, write_gate
from quorumfl.errors import ConfigError

__all__ = ["GATE_WAIT_S", "SLOTS_DIR_ENV", "SLOTS_ENV", "host_slot_env"]

# The gate gives up well inside Flower's claim window, leaving time for Flower's own start-up.
GATE_WAIT_S = 0.6 * HEARTBEAT_DEFAULT_INTERVAL


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
