"""The QuorumFL ClientApp: a department node trains and evaluates on its own partition only.

The node's partition directory comes from its node config (``data-path``), its name from
``department`` (else the partition's own label). Each message runs in a fresh process, so the
partition is read per message (it is small and local).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quorumfl.aggregation.errors import DataError

from .data.store import Partition, read_partition
from .models import arrays_to_model, build_model, model_to_arrays
from .training import evaluate, train
from .wire import ARRAYS, CONFIG, METRICS, NODE, TrainConfig, from_array_record, to_array_record

__all__ = ["app"]

log = logging.getLogger(__name__)
app = ClientApp()


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


def _received_model(msg: Message, part: Partition) -> tuple[TrainConfig, torch.nn.Module]:
    """The round's config and the global model it carries, built for this partition's data."""
    config = TrainConfig.from_record(msg.content.config_records[CONFIG])
    model = build_model(config.model, part.train.input_shape, part.train.num_classes)
    arrays_to_model(model, from_array_record(msg.content.array_records[ARRAYS]))
    return config, model


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    part, department = _partition(context)
    config, model = _received_model(msg, part)
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
    metrics = MetricRecord(
        {
            "num-examples": result.num_examples,
            "train-loss": result.loss,
            "global-accuracy": before.accuracy,
            "global-loss": before.loss,
            "local-accuracy": after.accuracy,
            "train-seconds": seconds,
        }
    )
    content = RecordDict(
        {
            ARRAYS: to_array_record(model_to_arrays(model)),
            METRICS: metrics,
            NODE: ConfigRecord({"department": department}),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    part, department = _partition(context)
    _, model = _received_model(msg, part)
    result = evaluate(model, part.test)
    content = RecordDict(
        {
            METRICS: MetricRecord(
                {"accuracy": result.accuracy, "loss": result.loss, "num-examples": result.num_examples}
            ),
            NODE: ConfigRecord({"department": department}),
        }
    )
    return Message(content=content, reply_to=msg)
