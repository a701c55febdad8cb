"""What a node does with a received model on its own data: train it, evaluate it (torch lives here).

Kept apart from ``app`` so that the ClientApp module imports without torch: Flower starts a fresh
process per message, and the secure-aggregation messages that carry no model then start in under a
second instead of paying torch's import.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, Message
from numpy.typing import NDArray
from threadpoolctl import threadpool_limits

from quorumfl.client.alone import KIND as ALONE
from quorumfl.client.alone import advance_alone, alone_metrics, wanted
from quorumfl.client.node_round import (
    Personalisation,
    PrivacyGate,
    evaluate_round,
    federation_model,
    model_spec,
    pick_round,
    train_round,
)
from quorumfl.client.personal_store import PersonalStore, node_state_dir
from quorumfl.client.secure import signed_slot
from quorumfl.client.signed_config import check_train_request
from quorumfl.client.tuned import KIND as TUNED
from quorumfl.client.tuned import finetune_epochs, tune
from quorumfl.core.data.store import Partition, read_partition
from quorumfl.core.tasks import ModelSpec, check_schema_fits, parse_schema
from quorumfl.errors import ConfigError, DataError, PrivacyBudgetError
from quorumfl.privacy.budget import DEFAULT_DP_BUDGET
from quorumfl.protocol.ckks_wire import CKKS, decode_train_request
from quorumfl.protocol.secure_wire import SECAGG, decode_mask_request
from quorumfl.protocol.wire import CONFIG, TrainConfig, candidate_models
from quorumfl.training.engine import EngineSettings

__all__ = ["LocalTraining", "apply_thread_budget", "evaluate_received", "pick_received", "train_received"]

log = logging.getLogger(__name__)
Arrays = dict[str, NDArray[np.generic]]


def _fitting(context: Context, config: TrainConfig) -> tuple[Partition, str]:
    """The node's partition, refused (``DataError`` naming the column or class) unless it was prepared
    for the run's schema; the run's task must also be installed here in the schema's version."""
    part, department = _partition(context)
    if config.schema:
        run_schema = parse_schema(config.schema, where="the run's schema")
        check_schema_fits(part.resolved_schema(), run_schema, where=f"department {department}'s data")
        ModelSpec(config.task, config.model, config.schema).resolve()
    return part, department


def apply_thread_budget(node_config: Mapping[str, object]) -> int:
    """The node's ``torch-threads`` (1 unless set) for torch's intra-op pool and numpy's BLAS pool alike;
    read, like every engine key, by ``EngineSettings``, so a bad value in the node config fails the
    training or evaluation request (``ConfigError`` naming the key) rather than being taken as 1.

    Several nodes often share one machine. numpy's OpenBLAS starts a thread per core, and after one
    large ``np.dot`` (a secure payload's norm) that thread spins ~0.1 s of CPU waiting for more work,
    which ten nodes on one machine take from each other's training."""
    budget = EngineSettings.from_node_config(node_config).threads_per_worker
    torch.set_num_threads(budget)
    threadpool_limits(limits=budget, user_api="blas")
    return budget


def _partition(context: Context) -> tuple[Partition, str]:
    apply_thread_budget(context.node_config)
    path = context.node_config.get("data-path")
    if not isinstance(path, str) or not path:
        raise DataError(
            "node config has no 'data-path'; start the node with "
            "--node-config \"data-path='DIR'\" (or 'quorumfl node start --data DIR')"
        )
    part = read_partition(Path(path))
    department = context.node_config.get("department")
    return part, department if isinstance(department, str) and department else part.department


@dataclass(frozen=True)
class LocalTraining:
    """The received shared arrays, the locally trained ones, and the node's metrics.

    Only shared arrays are here: FedPer's personal layers and Ditto's personal model were saved to the
    node's own disk and are not part of anything that is sent.
    """

    config: TrainConfig
    department: str
    received: Arrays
    trained: Arrays
    num_examples: int
    train_loss: float
    metrics: dict[str, float]
    cluster: int | None = None
    # what the node measured on its test split with the received model: the primary metric in the
    # objective's unit (``Objective.unit``) and the loss; secure rounds sum them like the update
    eval_value: float = math.nan
    eval_loss: float = math.nan


def run_state_key(context: Context) -> str:
    """The key of the node's per-run state (personal model, compression residual, ε reservations,
    training checkpoint): the Flower run id, or, for a run the server resumed as a new Flower run,
    the original run's id (run config ``node-state-key``), so that state carries over."""
    key = context.run_config.get("node-state-key", "")
    if isinstance(key, str) and key.isdigit() and len(key) <= 20:
        return key
    return str(context.run_id)


def _personal(context: Context, config: TrainConfig) -> tuple[PersonalStore | None, Arrays | None]:
    if Personalisation(config.personalisation) is Personalisation.NONE:
        return None, None
    store = PersonalStore.for_node(dict(context.node_config), int(context.node_id))
    return store, store.load(run_state_key(context))


def _privacy_gate(context: Context, config: TrainConfig) -> PrivacyGate | None:
    """The department's ε ledger (in its data directory) as the gate a DP round must pass.

    Node config: ``dp-budget`` (the department's total ε over all runs, default 10) and ``require-dp``
    (refuse every round that is not differentially private).
    """
    node_config = context.node_config
    if config.dp == "none":
        if node_config.get("require-dp") in (True, "true", 1):
            raise PrivacyBudgetError("this department trains only with differential privacy (node config "
                                     "require-dp); start the run with dp = 'local' or 'distributed'")
        return None
    from quorumfl.privacy.ledger import Ledger

    budget = node_config.get("dp-budget", DEFAULT_DP_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ConfigError(f"node config 'dp-budget' must be a number > 0, got {budget!r}")
    ledger = Ledger.open(Path(str(node_config["data-path"])))
    run, number = run_state_key(context), config.server_round
    return PrivacyGate(charge=lambda entry: ledger.reserve(run, number, entry, delta=config.dp_delta,
                                                           budget=float(budget)),
                       noise_for=ledger.noise_for_target, budget=float(budget))


def _admit_secure_round(msg: Message, context: Context, models: list[Arrays], config: TrainConfig) -> int | None:
    """In a secure round: the contribution ledger's verdict (raises on a second participant set for
    the same model unless the earlier input can be released), then this round's training seed from the node's own entropy — unless the
    department set ``reproducible-training`` (its choice: repeats then train identically).
    Plaintext rounds keep the run's seed (None)."""
    records = msg.content.config_records
    slot = ""
    if SECAGG in records:
        request = decode_mask_request(records[SECAGG], node=int(context.node_id))[0]
        participants, slot = request.group, signed_slot(context, request.epoch, request.slot)
    elif CKKS in records:
        participants = decode_train_request(records[CKKS]).participants
    else:
        return None
    from quorumfl.privacy.contributions import ContributionLedger, model_digest

    ledger = ContributionLedger(node_state_dir(context.node_config, int(context.node_id)))
    ledger.admit(model_digest(models), participants, run=run_state_key(context), round_number=config.server_round,
                 slot=slot)
    reproducible = context.node_config.get("reproducible-training", False)
    if not isinstance(reproducible, bool):
        raise ConfigError(f"node config 'reproducible-training' must be true or false, got {reproducible!r}")
    return None if reproducible else secrets.randbits(62)


def train_received(msg: Message, context: Context) -> LocalTraining:
    config = TrainConfig.from_record(msg.content.config_records[CONFIG])
    records = msg.content.config_records
    check_train_request(context.run_config, config, masked=SECAGG in records, encrypted=CKKS in records,
                        node=str(context.node_id))
    part, department = _fitting(context, config)
    store, personal = _personal(context, config)
    node_config = dict(context.node_config)
    engine = EngineSettings.from_node_config(node_config)
    # One checkpoint file per run: its fingerprint ties it to the round's job, so a crash mid-training
    # resumes when the same job is asked again, and any other job starts afresh.
    checkpoint = node_state_dir(node_config, int(context.node_id)) / "checkpoints" / f"train-{run_state_key(context)}.pt"
    models = candidate_models(msg.content)
    fresh_seed = _admit_secure_round(msg, context, models, config)
    work = train_round(config, models, personal, part.train, part.test,
                       engine=engine, checkpoint=checkpoint if engine.checkpoint_every else None,
                       privacy=_privacy_gate(context, config), fresh_seed=fresh_seed)
    if store is not None and work.personal is not None:
        store.save(run_state_key(context), work.personal)
    if wanted(context.run_config, config) and "statistics-round" not in work.metrics:
        advance_alone(PersonalStore.for_node(node_config, int(context.node_id), kind=ALONE),
                      run_state_key(context), model_spec(config, part.train), config, part.train, engine)
    log.info("round %s: %s trained on %s examples", config.server_round, department, work.num_examples)
    objective = part.test.objective
    return LocalTraining(config, department, work.received, work.shared, work.num_examples, work.train_loss,
                         work.metrics, work.cluster,
                         eval_value=work.metrics.get(f"global-{objective.primary}", math.nan) / objective.unit,
                         eval_loss=work.metrics.get("global-loss", math.nan))


def pick_received(msg: Message, context: Context) -> tuple[int, str]:
    """IFCA: the index of the cluster model with the lowest loss on this node's training data."""
    config = TrainConfig.from_record(msg.content.config_records[CONFIG])
    part, department = _fitting(context, config)
    _, personal = _personal(context, config)
    return pick_round(config, candidate_models(msg.content), personal, part.train), department


def evaluate_received(msg: Message, context: Context) -> tuple[dict[str, float], str]:
    config = TrainConfig.from_record(msg.content.config_records[CONFIG])
    part, department = _fitting(context, config)
    _, personal = _personal(context, config)
    models = candidate_models(msg.content)
    metrics = evaluate_round(config, models, personal, part.train, part.test).metrics
    metrics.update(_own_models(context, config, models, personal, part))
    return metrics, department


def _own_models(context: Context, config: TrainConfig, models: list[Arrays], personal: Arrays | None,
                part: Partition) -> dict[str, float]:
    """The department's own final models beside the federation's: the federation's fine-tuned on its data
    (``client.tuned``) and the one it trained alone (``client.alone``), with the same extra epochs."""
    node_config, node, run = dict(context.node_config), int(context.node_id), run_state_key(context)
    engine = EngineSettings.from_node_config(node_config)
    epochs = finetune_epochs(context.run_config, config)
    metrics: dict[str, float] = {}
    if epochs:
        model = federation_model(config, models, personal, part.train)
        metrics.update(tune(model, PersonalStore.for_node(node_config, node, kind=TUNED), run, config, epochs,
                            part.train, part.test, engine))
    if wanted(context.run_config, config):
        metrics.update(alone_metrics(PersonalStore.for_node(node_config, node, kind=ALONE), run,
                                     model_spec(config, part.train), config, part.train, part.test,
                                     extra_epochs=epochs, engine=engine))
    return metrics
