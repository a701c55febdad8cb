"""Baseline for ``secagg.py``: Flower's own SecAgg+ (legacy API) training QuorumFL's model on the same data.

Shipped inside a Flower app bundle by the benchmark (not part of the QuorumFL package). The server is
Flower's ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` with the legacy ``FedAvg``; the
client is a ``NumPyClient`` behind ``secaggplus_mod`` that runs QuorumFL's own local training
(``quorumfl.training.local.train``) on the node's partition, so the work per round matches the
QuorumFL runs and only the aggregation protocol differs. Like the QuorumFL ClientApp it imports torch
only when it trains, so Flower's stages are not charged for an import QuorumFL avoids.
Each fit round's wall time is appended to the JSON-lines file named by the ``timings-file`` config.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

server = ServerApp()


def _model(config: dict[str, Any], input_shape: tuple[int, ...], num_classes: int) -> Any:
    from quorumfl.core.models import build_model

    return build_model(str(config["model"]), input_shape, num_classes, seed=int(config["seed"]))


@server.main()
def main(grid: Grid, context: Context) -> None:
    config = dict(context.run_config)
    nodes = int(config["num-nodes"])
    model = _model(config, (1, 8, 8), 10)
    initial = ndarrays_to_parameters([v.detach().numpy() for v in model.state_dict().values()])
    strategy = FedAvg(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=nodes, min_evaluate_clients=0,
        min_available_clients=nodes, initial_parameters=initial,
    )
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=int(config["num-rounds"])), strategy=strategy)
    secaggplus = SecAggPlusWorkflow(
        num_shares=nodes, reconstruction_threshold=float(config["threshold"]), timeout=float(config["stage-timeout"])
    )
    timings = Path(str(config["timings-file"]))

    def timed_fit(grid: Grid, ctx: Context) -> None:
        start = time.perf_counter()
        secaggplus(grid, ctx)
        with timings.open("a") as out:
            out.write(json.dumps({"round_s": time.perf_counter() - start}) + "\n")

    DefaultWorkflow(fit_workflow=timed_fit)(grid, legacy)


class DepartmentClient(NumPyClient):  # type: ignore[misc]
    def __init__(self, context: Context) -> None:
        self.context = context

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        import torch

        from quorumfl.core.data.store import read_partition
        from quorumfl.training.local import train

        run = dict(self.context.run_config)
        torch.set_num_threads(1)
        part = read_partition(Path(str(self.context.node_config["data-path"])))
        model = _model(run, part.train.input_shape, part.train.num_classes)
        keys = list(model.state_dict())
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in zip(keys, parameters, strict=True)})
        result = train(model, part.train, epochs=int(run["local-epochs"]), batch_size=int(run["batch-size"]),
                       learning_rate=float(run["learning-rate"]), seed=int(run["seed"]))
        return [v.detach().numpy() for v in model.state_dict().values()], result.num_examples, {}


def client_fn(context: Context) -> Any:
    return DepartmentClient(context).to_client()


client = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
