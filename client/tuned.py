"""The department's own final model: the federation's model fine-tuned on the department's data.

A single shared model serves departments whose data differ (other label mixes, other price levels)
less well than it could; a few epochs on the department's own examples, starting from what the
federation learned, adapt it (FedAvg plus local fine-tuning, the simplest personalisation, e.g. Yu et
al. 2020, "Salvaging federated learning by local adaptation"). At the run's final evaluation each node
fine-tunes the federation's model for it (global, its cluster's, or shared + its personal layers) for
``finetune-epochs`` epochs with the run's optimizer, batch size and learning rate, keeps it in its
state folder (``PersonalStore`` kind ``tuned``, under the run's state key: the department's to use),
and reports ``tuned-<metric>`` on its test split. Only that number leaves the node.

The number of epochs is the admin-signed run config's where it holds the key (a server cannot make a
node train longer than the admin allowed), else the request's. The department-alone model
(``client.alone``) trains the same extra epochs before it is measured, so both had the same budget.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quorumfl.client.personal_store import PersonalStore
from quorumfl.core.data.datasets import Dataset
from quorumfl.core.models import model_to_arrays
from quorumfl.protocol.wire import TrainConfig
from quorumfl.training.engine import EngineSettings, TrainJob, train_model
from quorumfl.training.local import evaluate

__all__ = ["KIND", "TUNED_PREFIX", "finetune_epochs", "tune"]

KIND = "tuned"
TUNED_PREFIX = "tuned-"


def finetune_epochs(run_config: Mapping[str, object], config: TrainConfig) -> int:
    """The epochs to fine-tune for: the signed run config's ``finetune-epochs`` where it has one."""
    signed = run_config.get("finetune-epochs")
    if isinstance(signed, int) and not isinstance(signed, bool):
        return max(0, signed)
    return max(0, config.finetune_epochs)


def extra_job(config: TrainConfig, epochs: int, *, seed: int) -> TrainJob:
    """The fine-tuning job: the run's recipe for ``epochs`` epochs (no proximal pull, no warm-up)."""
    return TrainJob(epochs=epochs, batch_size=config.batch_size, learning_rate=config.learning_rate,
                    optimizer=config.optimizer, seed=seed, clip_norm=config.clip_norm,
                    lr_reference_batch=config.lr_reference_batch)


def tune(model: torch.nn.Module, store: PersonalStore, run: str, config: TrainConfig, epochs: int,
         train_data: Dataset, test_data: Dataset, engine: EngineSettings | None = None) -> dict[str, float]:
    """Fine-tune ``model`` (the federation's model for this department, modified in place) on the
    department's own data, keep it, and return ``tuned-<metric>`` for each of the task's metrics."""
    train_model(model, train_data, extra_job(config, epochs, seed=config.seed + 104729), engine)
    store.save(run, model_to_arrays(model))
    return {f"{TUNED_PREFIX}{k}": v for k, v in evaluate(model, test_data).metrics.items()}
