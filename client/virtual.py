"""Virtual departments on Flower's simulation engine: the node config a SuperNode would have.

A deployed node gets its partition, its name and its state folder from ``quorumfl node start``
(node config ``data-path``, ``department``, ``state-dir``). Flower's simulation engine gives every
virtual node only ``partition-id`` and ``num-partitions``. ``virtual_department`` is a ClientApp mod
(Flower's middleware) that fills the rest in from the simulation folder ``quorumfl simulate`` lays
out, so the same handlers run unchanged::

    ROOT/simulation.json      {"departments": [[NAME, PARTITION DIR], ...], "node-config": {...}}:
                              partition i is department i; node config every one of them adds
                              (e.g. reproducible-training)
    ROOT/nodes/NAME           the department's node state (key shares, ledgers, checkpoints)

With ``virtual-dropout = P`` in that node config, a virtual department fails each message it is
sent with probability P (drawn from ``virtual-seed``, its name and the message id): its reply is an
error saying so (what a ClientApp that raised sends), which the server records as a dropout at that stage (key set-up, masked input, unmask,
evaluation), so a rehearsal shows what dropouts do to a configuration.

The folder is named by ``$QUORUMFL_SIMULATION_ROOT`` (inherited by the simulation's worker
processes). The mod does nothing unless that variable is set *and* the node config has a
``partition-id`` and no ``data-path``, so a deployed SuperNode is never remapped.
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode

from quorumfl.errors import ConfigError

__all__ = ["DROPOUT_KEY", "LAYOUT_FILE", "SEED_KEY", "SIMULATION_ROOT_ENV", "NodeValue", "drops", "virtual_department",
           "virtual_node_config", "write_layout"]

SIMULATION_ROOT_ENV = "QUORUMFL_SIMULATION_ROOT"
LAYOUT_FILE = "simulation.json"
DROPOUT_KEY = "virtual-dropout"
SEED_KEY = "virtual-seed"
NodeValue = bool | int | float | str


def write_layout(root: Path, partitions: list[tuple[str, Path]], node_config: dict[str, NodeValue]) -> None:
    """Write ``ROOT/simulation.json``: department i's name and partition, and the shared node config."""
    body = {"departments": [[name, str(path)] for name, path in partitions], "node-config": node_config}
    root.mkdir(parents=True, exist_ok=True)
    (root / LAYOUT_FILE).write_text(json.dumps(body))


@functools.cache
def _layout(root: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, NodeValue], ...]]:
    path = Path(root) / LAYOUT_FILE
    try:
        body = json.loads(path.read_text())
        departments = tuple((str(name), str(data)) for name, data in body["departments"])
        extra = body["node-config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"simulation folder {root} has no readable {LAYOUT_FILE} ({exc}); start simulations "
                          "with 'quorumfl simulate'") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"{path}: 'node-config' must be a table of node config keys")
    return departments, tuple(sorted(extra.items()))


def virtual_node_config(node_config: dict[str, NodeValue], root: str) -> dict[str, NodeValue]:
    """The node config of virtual department ``partition-id`` under the simulation folder ``root``."""
    departments, extra = _layout(root)
    index = node_config.get("partition-id")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(departments):
        raise ConfigError(f"virtual node has partition-id {index!r}; the simulation has {len(departments)} departments")
    name, data = departments[index]
    return {**node_config, **dict(extra), "data-path": data, "department": name,
            "state-dir": str(Path(root) / "nodes" / name), "torch-threads": 1}


def drops(node_config: dict[str, NodeValue], message_id: str) -> bool:
    """Whether this virtual department drops out of the message ``message_id`` (``virtual-dropout``)."""
    chance = node_config.get(DROPOUT_KEY, 0.0)
    if isinstance(chance, bool) or not isinstance(chance, int | float) or not 0.0 <= chance < 1.0:
        raise ConfigError(f"node config {DROPOUT_KEY} must be a probability in [0, 1), got {chance!r}")
    if not chance:
        return False
    draw = random.Random(f"{node_config.get(SEED_KEY, 0)}:{node_config.get('department')}:{message_id}").random()
    return draw < chance


def virtual_department(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """ClientApp mod: give a simulated node its department's node config, and play its dropouts
    (module docstring)."""
    root = os.environ.get(SIMULATION_ROOT_ENV, "")
    if root and "partition-id" in context.node_config and "data-path" not in context.node_config:
        context.node_config = virtual_node_config(dict(context.node_config), root)
        if drops(dict(context.node_config), msg.metadata.message_id):
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 reason=f"virtual department {context.node_config['department']} dropped out of this "
                                        f"{msg.metadata.message_type} message (virtual-dropout)"), reply_to=msg)
    return call_next(msg, context)
