"""Virtual departments on Flower's simulation engine: the node config a SuperNode would have.

A deployed node gets its partition, its name and its state folder from ``quorumfl node start``
(node config ``data-path``, ``department``, ``state-dir``). Flower's simulation engine gives every
virtual node only ``partition-id`` and ``num-partitions``. ``virtual_department`` is a ClientApp mod
(Flower's middleware) that fills the rest in from the simulation folder ``quorumfl simulate`` lays
out, so the same handlers run unchanged::

    ROOT/simulation.json      {"departments": [[NAME, PARTITION DIR], ...], "node-config": {...},
                               "speeds": [S, ...]}: partition i is department i; node config every one
                              of them adds (e.g. reproducible-training); department i's speed factor
                              (``virtual-speed``; the list is absent when all run at this machine's speed)
    ROOT/nodes/NAME           the department's node state (key shares, ledgers, checkpoints)

With ``virtual-dropout = P`` in that node config, a virtual department fails each message it is
sent with probability P (drawn from ``virtual-seed``, its name and the message id): its reply is an
error saying so (what a ClientApp that raised sends), which the server records as a dropout at that
stage (key set-up, masked input, unmask, evaluation), so a rehearsal shows what dropouts do to a
configuration.

With ``virtual-speed = S`` (0 < S ≤ 1, per department: ``simulate --speeds``), the department is S
times as fast as this machine: after its ClientApp has handled a message in T seconds, the reply
waits another T·(1/S − 1) before it leaves, so it reaches the server when a department that slow
would have sent it. The server's deadlines, its late and straggler records and the selectors'
duration estimates (arrival times at the server) see the slow department as they would see a real
one. Everything a department computes (training, masking, evaluation) slows by the same factor; a
message that costs nothing to handle adds nothing.

With ``virtual-availability = PERIOD`` (seconds; ``simulate --availability``), every department
is offline for a quarter of every PERIOD seconds of the simulation's wall clock (counted from
``virtual-start``), at a phase of its own drawn from ``virtual-seed`` and its name, as
``benchmarks/selection.py`` models availability cycles: a message that reaches it while it is offline
is answered with an error saying so, recorded as a dropout at that stage like ``virtual-dropout``'s,
but clustered in time, so the same department keeps failing until its window ends and selectors that
learn from failures (Oort, RL) can learn the pattern.

With ``virtual-payload-log = DIR`` (a rehearsal's audit, for tests and for checking a secure
configuration on synthetic data), each virtual department in a masked or CKKS round writes what it
fed the secure sum, before masking or encryption, with the model it received, to
``DIR/round-RRRR-node-ID.npz``: the server's revealed sum can then be checked against a plain numpy
sum of the departments the round counted. Only a virtual department does this (its config carries
the ``virtual-root`` this mod set); a deployed node never writes its update out.

The folder is named by ``$QUORUMFL_SIMULATION_ROOT`` (inherited by the simulation's worker
processes). The mod does nothing unless that variable is set *and* the node config has a
``partition-id`` and no ``data-path`` (or one this mod mapped from that folder, marked ``virtual-root``:
a virtual node keeps its Context between messages), so a deployed SuperNode is never remapped.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode
from numpy.typing import NDArray

from quorumfl.aggregation.secagg import flatten
from quorumfl.errors import ConfigError

__all__ = ["AVAILABILITY_KEY", "DROPOUT_KEY", "LAYOUT_FILE", "OFFLINE_SHARE", "PAYLOAD_LOG_KEY", "ROOT_KEY",
           "SEED_KEY", "SIMULATION_ROOT_ENV", "SPEED_KEY", "START_KEY", "NodeValue", "drops", "offline",
           "record_payload", "slowdown", "virtual_department", "virtual_node_config", "write_layout"]

SIMULATION_ROOT_ENV = "QUORUMFL_SIMULATION_ROOT"
LAYOUT_FILE = "simulation.json"
DROPOUT_KEY = "virtual-dropout"
SEED_KEY = "virtual-seed"
SPEED_KEY = "virtual-speed"
AVAILABILITY_KEY = "virtual-availability"
START_KEY = "virtual-start"
PAYLOAD_LOG_KEY = "virtual-payload-log"
ROOT_KEY = "virtual-root"  # set on a mapped config: the simulation folder it was mapped from
OFFLINE_SHARE = 0.25  # of each availability period, as benchmarks/selection.py's departments
NodeValue = bool | int | float | str


def write_layout(root: Path, partitions: list[tuple[str, Path]], node_config: dict[str, NodeValue],
                 speeds: Sequence[float] | None = None) -> None:
    """Write ``ROOT/simulation.json``: department i's name and partition, the shared node config and,
    with ``speeds``, department i's speed factor."""
    body: dict[str, object] = {"departments": [[name, str(path)] for name, path in partitions],
                               "node-config": node_config}
    if speeds is not None:
        if len(speeds) != len(partitions):
            raise ConfigError(f"{len(speeds)} speed(s) for {len(partitions)} departments")
        body["speeds"] = [float(s) for s in speeds]
    root.mkdir(parents=True, exist_ok=True)
    (root / LAYOUT_FILE).write_text(json.dumps(body))


@functools.cache
def _layout(root: str) -> tuple[tuple[tuple[str, str, float], ...], tuple[tuple[str, NodeValue], ...]]:
    path = Path(root) / LAYOUT_FILE
    try:
        body = json.loads(path.read_text())
        speeds = body.get("speeds") or [1.0] * len(body["departments"])
        departments = tuple((str(name), str(data), float(speed))
                            for (name, data), speed in zip(body["departments"], speeds, strict=True))
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
    name, data, speed = departments[index]
    mapped: dict[str, NodeValue] = {**node_config, **dict(extra), "data-path": data, "department": name,
                                    "state-dir": str(Path(root) / "nodes" / name), "torch-threads": 1, ROOT_KEY: root}
    if speed != 1.0:
        mapped[SPEED_KEY] = speed
    return mapped


def slowdown(node_config: dict[str, NodeValue], handled_s: float) -> float:
    """Seconds a virtual department of ``virtual-speed`` S waits after handling a message in
    ``handled_s`` seconds: handled_s·(1/S − 1), so the reply leaves after handled_s / S in all."""
    speed = node_config.get(SPEED_KEY, 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.0 < speed <= 1.0:
        raise ConfigError(f"node config {SPEED_KEY} must be a speed factor in (0, 1], got {speed!r}")
    return max(0.0, handled_s) * (1.0 / speed - 1.0)


def offline(node_config: dict[str, NodeValue], now: float) -> bool:
    """Whether this virtual department is in the offline quarter of its availability period at wall
    time ``now`` (``virtual-availability``; never without one)."""
    period = node_config.get(AVAILABILITY_KEY, 0.0)
    if isinstance(period, bool) or not isinstance(period, int | float) or not 0.0 <= period < math.inf:
        raise ConfigError(f"node config {AVAILABILITY_KEY} must be a period in seconds (0: always online), "
                          f"got {period!r}")
    if not period:
        return False
    start = node_config.get(START_KEY, 0.0)
    if isinstance(start, bool) or not isinstance(start, int | float):
        raise ConfigError(f"node config {START_KEY} must be a time in seconds, got {start!r}")
    phase = random.Random(f"{node_config.get(SEED_KEY, 0)}:{node_config.get('department')}:availability").random()
    return ((now - start) / period + phase) % 1.0 < OFFLINE_SHARE


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
    if root and "partition-id" in context.node_config and (
        "data-path" not in context.node_config or context.node_config.get(ROOT_KEY) == root
    ):
        # A simulated node keeps its Context between messages, so from its second message on the
        # config is already mapped (it has a data-path, and the root mark says whose): dropouts,
        # speed and availability apply to every message, not only to the first.
        context.node_config = virtual_node_config(dict(context.node_config), root)
        if drops(dict(context.node_config), msg.metadata.message_id):
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 reason=f"virtual department {context.node_config['department']} dropped out of this "
                                        f"{msg.metadata.message_type} message (virtual-dropout)"), reply_to=msg)
        if offline(dict(context.node_config), time.time()):
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 reason=f"virtual department {context.node_config['department']} is offline "
                                        "(virtual-availability)"), reply_to=msg)
        started = time.monotonic()
        reply = call_next(msg, context)
        wait = slowdown(dict(context.node_config), time.monotonic() - started)
        if wait > 0:
            time.sleep(wait)
        return reply
    return call_next(msg, context)


def record_payload(node_config: Mapping[str, NodeValue], *, round_number: int, node: int,
                   received: Mapping[str, NDArray[np.generic]], payload: NDArray[np.float64]) -> None:
    """``virtual-payload-log``: write the vector a virtual department feeds the secure sum and the model
    it received, flattened as the payload is (module docstring); nothing, and no work, for a node this
    mod did not map or without the key."""
    folder = node_config.get(PAYLOAD_LOG_KEY)
    root = os.environ.get(SIMULATION_ROOT_ENV, "")
    if not folder or not root or node_config.get(ROOT_KEY) != root:
        return
    if not isinstance(folder, str):
        raise ConfigError(f"node config {PAYLOAD_LOG_KEY} must be a folder, got {folder!r}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / f"round-{round_number:04d}-node-{node}.npz", payload=payload, received=flatten(received))
