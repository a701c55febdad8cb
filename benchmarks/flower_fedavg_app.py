"""Baseline for ``round_overhead.py``: a bare Flower Message-API app, written as Flower's own examples are.

Shipped inside a Flower app bundle by the benchmark (not part of the QuorumFL package). The server is
Flower's ``flwr.serverapp.strategy.FedAvg`` driven by ``strategy.start`` (Flower's own round loop
and its default reply polling); the client is a ``@app.train()`` function that imports torch at
module level, as Flower's PyTorch examples do, and trains QuorumFL's model with QuorumFL's local
training on the node's partition — so the work per round matches the QuorumFL runs and only the
framework around it differs. No central evaluation, no federated evaluation (``fraction_evaluate``
0), nothing stored: the cheapest round Flower offers.

Each round's wall time (``configure_train`` → ``aggregate_train`` done) and the slowest node's
local training time (as each node measured it) are appended to the JSON-lines file ``timings-file``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch  # at import, as in Flower's examples
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

server = ServerApp()
client = ClientApp()


def _model(config: dict[str, Any]) -> Any:
    from quorumfl.core.models import build_model

    return build_model(str(config["model"]), (1, 8, 8), 10, seed=int(config["seed"]))


class TimedFedAvg(FedAvg):  # type: ignore[misc]
    """Flower's FedAvg, timing each round from configuring it to the aggregate."""

    def __init__(self, timings: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timings = timings
        self.started = 0.0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.started = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
        replies = list(replies)
        result = super().aggregate_train(server_round, replies)
        train_s = max(float(r.content["metrics"]["train-seconds"]) for r in replies if not r.has_error())
        with self.timings.open("a") as out:
            out.write(json.dumps({"round_s": time.perf_counter() - self.started, "train_s": train_s}) + "\n")
        return result


@server.main()
def main(grid: Grid, context: Context) -> None:
    config = dict(context.run_config)
    nodes = int(config["num-nodes"])
    strategy = TimedFedAvg(Path(str(config["timings-file"])), fraction_train=1.0, fraction_evaluate=0.0,
                           min_train_nodes=nodes, min_available_nodes=nodes)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(_model(config).state_dict()),
                   num_rounds=int(config["num-rounds"]), timeout=float(config["round-timeout"]))


@client.train()
def train(msg: Message, context: Context) -> Message:
    from quorumfl.core.data.store import read_partition
    from quorumfl.training.local import train as local_train

    run = dict(context.run_config)
    torch.set_num_threads(1)
    part = read_partition(Path(str(context.node_config["data-path"])))
    model = _model(run)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    started = time.perf_counter()
    result = local_train(model, part.train, epochs=int(run["local-epochs"]), batch_size=int(run["batch-size"]),
                         learning_rate=float(run["learning-rate"]), seed=int(run["seed"]))
    seconds = time.perf_counter() - started
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"num-examples": result.num_examples, "train-seconds": seconds}),
    })
    return Message(content=content, reply_to=msg)
