"""What a department node does with one round's request, for every strategy, without Flower.

The request brings one global model, or K cluster models (IFCA: the node evaluates each on its own
training data and trains the lowest-loss one), and says how the node personalises:

- ``none``: train the received model (FedAvg; FedProx with μ > 0).
- ``fedper``: the named personal layers never leave the node; the received shared layers are
  completed with the node's own personal layers, trained together, and only the shared part goes back.
- ``ditto``: the received global model is trained and sent back as in FedAvg; besides, the node's
  personal model is trained on the same data with ``λ/2 · ||v − w_global||²`` and stays on the node.

The personal state (FedPer's layers, Ditto's model) is passed in and returned; ``personal_store``
keeps it on disk between rounds. The Flower handlers (``steps``) and the heterogeneity benchmark
both call these functions, so the benchmark measures the code the nodes run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch
from numpy.typing import NDArray

from quorumfl.aggregation.clustering import choose_cluster
from quorumfl.aggregation.personal import merge_arrays, personal_names, split_arrays
from quorumfl.core.data.datasets import Dataset
from quorumfl.core.models import (
    CONTROL_PREFIX,
    arrays_to_model,
    build_model,
    model_to_arrays,
    split_control,
)
from quorumfl.errors import ConfigError
from quorumfl.protocol.wire import TrainConfig
from quorumfl.training.engine import EngineSettings, TrainJob, plan_devices, train_model
from quorumfl.training.local import evaluate, train

__all__ = [
    "NodeEvaluation", "NodeRound", "Personalisation", "evaluate_round", "pick_round", "train_job", "train_round",
]

Arrays = dict[str, NDArray[np.generic]]


class Personalisation(StrEnum):
    NONE = "none"
    FEDPER = "fedper"
    DITTO = "ditto"
    SCAFFOLD = "scaffold"  # not personal layers: the node's own control variate c_i, kept as personal state


@dataclass(frozen=True)
class NodeRound:
    """One round's work: what goes back to the server, and what the node keeps."""

    cluster: int | None  # the IFCA choice; None when one global model was sent
    received: Arrays  # the shared arrays as received (of the chosen cluster)
    shared: Arrays  # trained shared arrays: the only model data that leaves the node
    personal: Arrays | None  # the node's new personal state (FedPer layers, Ditto model)
    num_examples: int
    train_loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeEvaluation:
    cluster: int | None
    metrics: dict[str, float]


def _mode(config: TrainConfig) -> Personalisation:
    try:
        return Personalisation(config.personalisation)
    except ValueError:
        raise ConfigError(
            f"personalisation must be one of {[p.value for p in Personalisation]}, got {config.personalisation!r}"
        ) from None


def _full(
    config: TrainConfig, model: torch.nn.Module, shared: Mapping[str, NDArray[np.generic]], personal: Arrays | None
) -> tuple[Arrays, frozenset[str]]:
    """The complete arrays the node runs: received shared layers plus its own personal ones (FedPer);
    SCAFFOLD's control variates, which travel with the model, are not part of it."""
    shared = split_control(shared)[0]
    if _mode(config) is not Personalisation.FEDPER:
        return dict(shared), frozenset()
    initial = model_to_arrays(model)  # the seeded initial weights: personal layers before the first round
    names = personal_names(list(initial), config.personal_layers)
    if set(shared) & names:
        raise ConfigError(f"the server sent personal layer(s) {sorted(set(shared) & names)}; they must stay on the node")
    mine = dict(personal) if personal is not None else split_arrays(initial, names)[1]
    return merge_arrays(shared, mine), names


def _pick(
    config: TrainConfig, model: torch.nn.Module, candidates: Sequence[Mapping[str, NDArray[np.generic]]],
    personal: Arrays | None, data: Dataset,
) -> tuple[int | None, Arrays, frozenset[str]]:
    """(cluster or None, full arrays to start from, personal names); IFCA picks by loss on ``data``."""
    if not candidates:
        raise ConfigError("the request carries no model")
    if len(candidates) == 1:
        full, names = _full(config, model, candidates[0], personal)
        return None, full, names
    fulls = [_full(config, model, c, personal) for c in candidates]
    losses = []
    for full, _ in fulls:
        arrays_to_model(model, full)
        losses.append(evaluate(model, data).loss)
    best = choose_cluster(losses)
    return best, fulls[best][0], fulls[best][1]


@dataclass(frozen=True)
class _Scaffold:
    """SCAFFOLD (Karimireddy et al., 2020, option II) on a node: the server's control variate c (sent
    with the model), the node's own c_i (its personal state; zeros at first) and the gradient
    correction c − c_i per parameter."""

    c: Arrays
    c_i: Arrays
    names: list[str]  # the model's parameters, in order
    correction: list[torch.Tensor]
    sent: Arrays  # c as it came, under its control names (what the update is taken against)

    def finish(self, start: Arrays, trained: Arrays, lr_sum: float) -> tuple[Arrays, Arrays]:
        """(the new c_i to keep, the control arrays to send back: c + (c_i+ − c_i))."""
        new_c_i = dict(self.c_i)
        returned: Arrays = {CONTROL_PREFIX + n: v for n, v in self.c.items() if n not in self.names}  # buffers: as sent
        for name in self.names:
            drift = (start[name].astype(np.float64) - trained[name].astype(np.float64)) / max(lr_sum, 1e-12)
            new = self.c_i[name].astype(np.float64) - self.c[name].astype(np.float64) + drift
            new_c_i[name] = new.astype(np.float32)
            delta = new - self.c_i[name].astype(np.float64)
            returned[CONTROL_PREFIX + name] = (self.c[name].astype(np.float64) + delta).astype(np.float32)
        return new_c_i, returned


def _scaffold_start(config: TrainConfig, model: torch.nn.Module, candidates: Sequence[Mapping[str, NDArray[np.generic]]],
                    personal: Arrays | None) -> _Scaffold:
    if len(candidates) != 1:
        raise ConfigError("SCAFFOLD runs with one server model (not IFCA's clusters)")
    c = split_control(candidates[0])[1]
    names = [name for name, _ in model.named_parameters()]
    if not set(names) <= set(c):
        raise ConfigError(f"the server sent no control variate for parameter(s) {sorted(set(names) - set(c))[:3]}; "
                          "SCAFFOLD needs one per parameter")
    c_i: Arrays = dict(personal) if personal is not None else {n: np.zeros_like(c[n], dtype=np.float32) for n in names}
    if set(c_i) != set(names):
        raise ConfigError("this node's stored control variate does not fit the model; remove its state for this run")
    correction = [torch.from_numpy((c[n].astype(np.float32) - c_i[n].astype(np.float32)).copy()) for n in names]
    return _Scaffold(c, c_i, names, correction, {CONTROL_PREFIX + n: c[n] for n in c})


def pick_round(
    config: TrainConfig,
    candidates: Sequence[Mapping[str, NDArray[np.generic]]],
    personal: Arrays | None,
    train_data: Dataset,
) -> int:
    """IFCA's choice alone (lowest loss on the node's training data), for a round whose training
    comes in a second message (secure aggregation sums each cluster's nodes as one group)."""
    model = build_model(config.model, train_data.input_shape, train_data.num_classes, seed=config.seed)
    cluster, _, _ = _pick(config, model, candidates, personal, train_data)
    return 0 if cluster is None else cluster


@dataclass(frozen=True)
class PrivacyGate:
    """The department's ledger as a DP round uses it: ``charge`` a round's mechanism (σ, q, steps) and
    get the department's ε after it, or raise past the budget; ``noise_for`` finds σ for a target ε
    (``privacy.accounting.noise_for_target``'s arguments; the ledger's keeps what it found)."""

    charge: Callable[[tuple[float, float, int]], float]
    noise_for: Callable[[float, float, float, int], float] | None = None


def train_job(config: TrainConfig, *, seed: int) -> TrainJob:
    """The engine's job for this round. SCAFFOLD steps with plain SGD: its control-variate update
    (x − y)/(K·η) reads the average corrected gradient off the steps, which momentum would inflate."""
    momentum = 0.0 if _mode(config) is Personalisation.SCAFFOLD else 0.9
    return TrainJob(epochs=config.local_epochs, batch_size=config.batch_size, learning_rate=config.learning_rate,
                    proximal_mu=config.proximal_mu, seed=seed, clip_norm=config.clip_norm,
                    warmup_steps=config.warmup_steps, lr_reference_batch=config.lr_reference_batch, momentum=momentum)


def train_round(
    config: TrainConfig,
    candidates: Sequence[Mapping[str, NDArray[np.generic]]],
    personal: Arrays | None,
    train_data: Dataset,
    test_data: Dataset,
    *,
    engine: EngineSettings | None = None,
    checkpoint: Path | None = None,
    privacy: PrivacyGate | None = None,
    fresh_seed: int | None = None,
) -> NodeRound:
    """Pick (IFCA), train with the node's engine (resuming from ``checkpoint`` after a crash), evaluate
    before and after; personal state in and out. Training is seeded by the run's seed and the round,
    or by ``fresh_seed`` (the node's own entropy, in secure rounds)."""
    mode = _mode(config)
    if mode is Personalisation.DITTO and not config.ditto_lambda >= 0:
        raise ConfigError(f"ditto-lambda must be >= 0, got {config.ditto_lambda}")
    model = build_model(config.model, train_data.input_shape, train_data.num_classes, seed=config.seed)
    cluster, start, names = _pick(config, model, candidates, personal, train_data)
    arrays_to_model(model, start)
    before = evaluate(model, test_data)
    started = time.perf_counter()
    seed = config.seed + config.server_round if fresh_seed is None else fresh_seed
    job = train_job(config, seed=seed)
    scaffold = _scaffold_start(config, model, candidates, personal) if mode is Personalisation.SCAFFOLD else None
    dp_metrics: dict[str, float] = {}
    if config.dp == "local" and scaffold is not None:
        raise ConfigError("SCAFFOLD's gradient correction does not combine with DP-SGD (dp = 'local'); use dp = "
                          "'none' or 'distributed'")
    if config.dp == "local":
        from quorumfl.training.dp_sgd import (  # opacus loads only for DP runs
            plan_round,
            train_private,
        )

        if privacy is None:
            raise ConfigError("a DP round needs the department's privacy ledger; none was given")
        plan = plan_round(len(train_data), job, rounds=config.num_rounds, max_grad_norm=config.dp_clip,
                          delta=config.dp_delta, target_epsilon=config.dp_epsilon,
                          noise_multiplier=config.dp_noise_multiplier, noise_for=privacy.noise_for)
        dp_metrics["dp-epsilon"] = privacy.charge(plan.entry)  # refuses (raises) past the budget, before any training
        dp_metrics["dp-noise-multiplier"] = plan.noise_multiplier
        devices = plan_devices(engine or EngineSettings(), cuda_devices=torch.cuda.device_count())
        if devices.world > 1:  # Opacus' DPDDP: the same schedule, so the same ledger entry
            from quorumfl.training.dp_ddp import train_private_ddp

            threads = (engine or EngineSettings()).threads_per_worker
            result = train_private_ddp(model, train_data, job, plan, devices, threads=threads)
        else:
            result = train_private(model, train_data, job, plan)
        workers = devices.world
    elif config.dp in ("none", "distributed"):
        if config.dp == "distributed":  # clipped and noised after training (client.secure); charged here
            if privacy is None:
                raise ConfigError("a DP round needs the department's privacy ledger; none was given")
            # The whole update is one Gaussian mechanism per round; no subsampling is claimed (q = 1):
            # the node cannot check how the server samples.
            dp_metrics["dp-epsilon"] = privacy.charge((config.dp_noise_multiplier, 1.0, 1))
            dp_metrics["dp-noise-multiplier"] = config.dp_noise_multiplier
        run = train_model(model, train_data, job, engine, checkpoint=checkpoint,
                          correction=scaffold.correction if scaffold is not None else None)
        result, workers = run.loop, run.plan.world
    else:
        raise ConfigError(f"dp must be 'none', 'local' or 'distributed', got {config.dp!r}")
    after = evaluate(model, test_data)
    shared, mine = split_arrays(model_to_arrays(model), names)
    received = split_arrays(start, names)[0]
    if set(shared) & names:  # fail closed: a personal layer must never be in what is sent
        raise ConfigError(f"personal layer(s) {sorted(set(shared) & names)} would leave the node")
    metrics = {
        "num-examples": float(result.num_examples),
        "train-loss": result.loss,
        "global-accuracy": before.accuracy,
        "global-loss": before.loss,
        "local-accuracy": after.accuracy,
        "train-workers": float(workers),
        **dp_metrics,
        "grad-norm-mean": float(np.mean(result.grad_norms)) if result.grad_norms else 0.0,
        "grad-norm-max": float(np.max(result.grad_norms)) if result.grad_norms else 0.0,
        "grad-spikes": float(result.spikes),
        "resumed-from-step": float(result.resumed_from_step),
    }
    if result.skipped_steps:
        metrics["amp-skipped-steps"] = float(result.skipped_steps)
    kept: Arrays | None = mine if mode is Personalisation.FEDPER else None
    if scaffold is not None:  # c_i+ = c_i − c + (x − y)/Σ η over the steps; c + Δc_i goes back with the model
        kept, returned = scaffold.finish(start, model_to_arrays(model), sum(job.lr_at(s) for s in range(result.steps)))
        shared, received = {**shared, **returned}, {**received, **scaffold.sent}
    if mode is Personalisation.FEDPER:
        metrics["personal-accuracy"] = after.accuracy
    if mode is Personalisation.DITTO:
        anchor = [torch.from_numpy(np.array(start[k], copy=True)) for k, _ in model.named_parameters()]
        arrays_to_model(model, dict(personal) if personal is not None else start)
        train(model, train_data, epochs=config.local_epochs, batch_size=config.batch_size,
              learning_rate=config.learning_rate, proximal_mu=config.ditto_lambda, seed=seed + 1, anchor=anchor)
        kept = model_to_arrays(model)
        metrics["personal-accuracy"] = evaluate(model, test_data).accuracy
    metrics["train-seconds"] = time.perf_counter() - started
    if cluster is not None:
        metrics["cluster"] = float(cluster)
    return NodeRound(cluster, received, shared, kept, result.num_examples, result.loss, metrics)


def evaluate_round(
    config: TrainConfig,
    candidates: Sequence[Mapping[str, NDArray[np.generic]]],
    personal: Arrays | None,
    train_data: Dataset,
    test_data: Dataset,
) -> NodeEvaluation:
    """The department's accuracy on its own test split with the federation's model for it (global,
    its cluster's, or shared + personal layers) and, for Ditto, with its personal model."""
    model = build_model(config.model, test_data.input_shape, test_data.num_classes, seed=config.seed)
    cluster, start, _ = _pick(config, model, candidates, personal, train_data)
    arrays_to_model(model, start)
    result = evaluate(model, test_data)
    metrics = {"accuracy": result.accuracy, "loss": result.loss, "num-examples": float(result.num_examples)}
    mode = _mode(config)
    if mode is Personalisation.FEDPER:
        metrics["personal-accuracy"] = result.accuracy
    elif mode is Personalisation.DITTO and personal is not None:
        arrays_to_model(model, dict(personal))
        metrics["personal-accuracy"] = evaluate(model, test_data).accuracy
    if cluster is not None:
        metrics["cluster"] = float(cluster)
    return NodeEvaluation(cluster, metrics)
