"""What a node does with a received model on its own data: train it, evaluate it (torch lives here).

Kept apart from ``app`` so that the ClientApp module imports without torch: Flower starts a fresh
process per message, and the secure-aggregation messages that carry no model then start in under a
second instead of paying torch's import.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, Message
from numpy.typing import NDArray

from quorumfl.aggregation.errors import DataError

from .data.store import Partition, read_partition
from .models import arrays_to_model, build_model, model_to_arrays
from .training import EvalResult, evaluate, train
from .wire import ARRAYS, CONFIG, TrainConfig, from_array_record

__all__ = ["LocalTraining", "evaluate_received", "train_received"]

log = logging.getLogger(__name__)
Arrays = dict[str, NDArray[np.generic]]


def _partition(context: Context) -> tuple[Partition, str]:
    # Several nodes often share one machine: one intra-op thread each unless the node says otherwise.
    threads = context.node_config.get("torch-threads", 1)
    torch.set_num_threads(threads if isinstance(threads, int) and threads > 0 else 1)
    path = context.node_config.get("data-path")
    if not isinstance(path, str) or not path:
        raise DataError(
            "node config has no 'data-path'; start the node with "
            "--node-config \"data-path='DIR'\" (or 'quorumfl node start --data DIR')"
        )
    part = read_partition(Path(path))
    department = context.node_config.get("department")
    return part, department if isinstance(department, str) and department else part.department


def _received_model(msg: Message, part: Partition) -> tuple[TrainConfig, torch.nn.Module, Arrays]:
    """The round's config and the global model it carries, built for this partition's data."""
    config = TrainConfig.from_record(msg.content.config_records[CONFIG])
    model = build_model(config.model, part.train.input_shape, part.train.num_classes)
    arrays = from_array_record(msg.content.array_records[ARRAYS])
    arrays_to_model(model, arrays)
    return config, model, arrays


@dataclass(frozen=True)
class LocalTraining:
    """The received global arrays, the locally trained ones, and the node's metrics."""

    config: TrainConfig
    department: str
    received: Arrays
    trained: Arrays
    num_examples: int
    train_loss: float
    metrics: dict[str, float]


def train_received(msg: Message, context: Context) -> LocalTraining:
    part, department = _partition(context)
    config, model, received = _received_model(msg, part)
    before = evaluate(model, part.test)
    started = time.perf_counter()
    result = train(
        model,
        part.train,
        epochs=config.local_epochs,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        proximal_mu=config.proximal_mu,
        seed=config.seed + config.server_round,
    )
    seconds = time.perf_counter() - started
    after = evaluate(model, part.test)
    log.info("round %s: %s trained on %s examples", config.server_round, department, result.num_examples)
    metrics = {
        "num-examples": float(result.num_examples),
        "train-loss": result.loss,
        "global-accuracy": before.accuracy,
        "global-loss": before.loss,
        "local-accuracy": after.accuracy,
        "train-seconds": seconds,
    }
    return LocalTraining(config, department, received, model_to_arrays(model), result.num_examples, result.loss, metrics)


def evaluate_received(msg: Message, context: Context) -> tuple[EvalResult, str]:
    part, department = _partition(context)
    _, model, _ = _received_model(msg, part)
    return evaluate(model, part.test), department
