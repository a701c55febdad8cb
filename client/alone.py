"""The department alone: what this department would get without the federation, measured beside it.

A department joins a federation to get a better model than it could train on its own data. Whether
it does is a fact only the department can measure (only it holds its data), so each node keeps a
second model of the run's architecture that never leaves it and never sees another department's
data: the *alone* model. It starts from the run's seeded initial weights, standardises its inputs
(tabular tasks) with this department's own statistics, and every round the node trains in, it takes
the same local epochs, batch size and learning rate as the federated training did, on the same
examples, with the node's engine. So it gets the same budget as the department spent in the
federation. Differential privacy does not apply to it: it never leaves the node, and a department
alone would not need it.

At the run's final evaluation the node measures it on its own test split and reports
``alone-<metric>`` beside the federation's model's figure. Only that number leaves the node, as the
federation's model's figure already does. The run config's ``local-baseline`` turns it on (the
default); a node whose admin-signed run config says ``local-baseline = false`` keeps no alone model,
whatever the server asks.

The model is kept in the node's state folder (``PersonalStore`` kind ``alone``) under the run's state
key, so a resumed run continues it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from quorumfl.client.personal_store import PersonalStore
from quorumfl.client.tuned import extra_job
from quorumfl.core.data.datasets import Dataset
from quorumfl.core.models import arrays_to_model, model_to_arrays
from quorumfl.core.tasks import ModelSpec
from quorumfl.core.tasks.modules import find_statistics
from quorumfl.protocol.wire import TrainConfig
from quorumfl.training.engine import EngineSettings, TrainJob, train_model
from quorumfl.training.local import evaluate

__all__ = ["ALONE_PREFIX", "KIND", "advance_alone", "alone_metrics", "wanted"]

ALONE_PREFIX = "alone-"
KIND = "alone"


def wanted(run_config: Mapping[str, object], config: TrainConfig) -> bool:
    """Whether this node keeps the alone model: the request asks for it and the signed run config (where
    it holds the key) does not refuse it."""
    signed = run_config.get("local-baseline")
    return config.local_baseline and signed is not False


def _fresh(spec: ModelSpec, config: TrainConfig, train_data: Dataset) -> torch.nn.Module:
    """The run's seeded initial model, standardised with this department's own statistics."""
    model = spec.build(seed=config.seed)
    stats = find_statistics(model)
    if stats is not None and stats.needs_statistics() and len(train_data):
        stats.set_statistics(torch.from_numpy(np.asarray(train_data.x, dtype=np.float32)))
    return model


def advance_alone(store: PersonalStore, run: str, spec: ModelSpec, config: TrainConfig, train_data: Dataset,
                  engine: EngineSettings | None = None) -> None:
    """One more round of the alone model: the round's local epochs on this department's own data."""
    model = _fresh(spec, config, train_data)
    stored = store.load(run)
    if stored is not None:
        arrays_to_model(model, stored)
    job = TrainJob(epochs=config.local_epochs, batch_size=config.batch_size, learning_rate=config.learning_rate,
                   optimizer=config.optimizer,
                   seed=config.seed + 7919 * config.server_round, clip_norm=config.clip_norm,
                   warmup_steps=config.warmup_steps, lr_reference_batch=config.lr_reference_batch)
    train_model(model, train_data, job, engine)
    store.save(run, model_to_arrays(model))


def alone_metrics(store: PersonalStore, run: str, spec: ModelSpec, config: TrainConfig, train_data: Dataset,
                  test_data: Dataset, *, extra_epochs: int = 0, engine: EngineSettings | None = None) -> dict[str, float]:
    """``alone-<metric>`` for each of the task's metrics on the test split, after ``extra_epochs`` more
    on its own data (those the federation's model was fine-tuned for: ``client.tuned``); nothing before
    the alone model has trained (a node that never trained in the run has nothing to compare)."""
    stored = store.load(run)
    if stored is None:
        return {}
    model = _fresh(spec, config, train_data)
    arrays_to_model(model, stored)
    if extra_epochs:
        train_model(model, train_data, extra_job(config, extra_epochs, seed=config.seed + 104729), engine)
    return {f"{ALONE_PREFIX}{k}": v for k, v in evaluate(model, test_data).metrics.items()}
