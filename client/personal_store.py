"""A node's own state between rounds: FedPer's personal layers, Ditto's personal model, and the
error-feedback residual of update compression.

Flower runs each message in a fresh process, so what a department keeps for itself lives on its own
disk: one ``.npz`` per run under the node's state directory (node config ``state-dir``, else
``$QUORUMFL_HOME/node-state/<node id>``), written to a temporary name, fsynced and renamed, so a crash
leaves the previous state whole. It never leaves the node.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.files import atomic_write, default_home
from quorumfl.errors import DataError

__all__ = ["PersonalStore", "node_state_dir"]

Arrays = dict[str, NDArray[np.generic]]
_RUN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def node_state_dir(node_config: Mapping[str, object], node_id: int) -> Path:
    """Where a node keeps what is its own: node config ``state-dir``, else ``$QUORUMFL_HOME/node-state/<id>``."""
    configured = node_config.get("state-dir")
    if isinstance(configured, str) and configured:
        return Path(configured).expanduser()
    home = default_home()
    return home / "node-state" / str(node_id)


class PersonalStore:
    def __init__(self, directory: Path, *, kind: str = "personal") -> None:
        self.directory = directory
        self.kind = kind  # "personal" (FedPer/Ditto state) or "residual" (compression error feedback)

    @classmethod
    def for_node(cls, node_config: Mapping[str, object], node_id: int, *, kind: str = "personal") -> PersonalStore:
        return cls(node_state_dir(node_config, node_id), kind=kind)

    def _path(self, run: str) -> Path:
        if not _RUN.match(run):
            raise DataError(f"personal state: run key {run!r} is not a plain name")
        return self.directory / f"{self.kind}-{run}.npz"

    def load(self, run: str) -> Arrays | None:
        """The stored state of ``run``, or None before the node's first round of it."""
        path = self._path(run)
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.kind} state {path} is unreadable ({exc}); remove it to start it afresh") from exc

    def save(self, run: str, arrays: Arrays) -> Path:
        path = self._path(run)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)  # type: ignore[arg-type]
        atomic_write(path, buffer.getvalue(), mode=0o600)
        return path
