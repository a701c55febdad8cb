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
    QAT_PREFIX,
    arrays_to_model,
    model_to_arrays,
    split_control,
)
from quorumfl.core.tasks import ModelSpec, image_schema
from quorumfl.core.tasks.modules import Standardize, find_statistics
from quorumfl.errors import ConfigError, DataError
from quorumfl.protocol.wire import TrainConfig
from quorumfl.training.engine import EngineSettings, TrainJob, plan_devices, train_model
from quorumfl.training.local import EvalResult, evaluate, train

__all__ = [
    "NodeEvaluation", "NodeRound", "Personalisation", "evaluate_round", "model_spec", "pick_round", "train_job",
    "train_round",
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


def model_spec(config: TrainConfig, data: Dataset) -> ModelSpec:
    """The run's model: its task and schema (a request without a schema: the node's image dataset's)."""
    import json

    schema = config.schema or json.dumps(image_schema(data.name, data.input_shape, data.num_classes))
    return ModelSpec(config.task, config.model, schema)


def _build(config: TrainConfig, data: Dataset) -> torch.nn.Module:
    return model_spec(config, data).build(seed=config.seed)


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


def _statistics_round(config: TrainConfig, model: torch.nn.Module) -> bool:
    """The first round of a fresh run of a task whose model standardises its inputs (tabular): the
    node contributes its feature statistics instead of training. Skipped under differential privacy
    (statistics of raw data are not covered by ε): those runs keep the range-scaled inputs."""
    stats = find_statistics(model)
    return stats is not None and stats.needs_statistics() and config.dp == "none"


def _contribute_statistics(
    config: TrainConfig, model: torch.nn.Module, train_data: Dataset, start: Arrays, names: frozenset[str],
    cluster: int | None, before: EvalResult, personal: Arrays | None, scaffold: _Scaffold | None, started: float,
) -> NodeRound:
    """The statistics round's reply: the model as received, with this department's mean and second
    moment in its ``Standardize`` layer. The round's (secure) weighted mean by example count turns them
    into the federation's statistics; the server sees no department's own."""
    stats = find_statistics(model)
    assert stats is not None
    x = np.asarray(train_data.x, dtype=np.float32)
    if x.size and float(np.max(np.abs(x))) > 1.0:  # a secure sum clips; statistics of larger values would be cut
        raise DataError(f"the statistics round needs the task's inputs scaled to [-1, 1] (its reader's job), this "
                        f"department's reach {float(np.max(np.abs(x))):.4g}; scale them in the task's reader")
    stats.set_statistics(torch.from_numpy(x))
    shared, mine = split_arrays(model_to_arrays(model), names)
    received = split_arrays(start, names)[0]
    mode = _mode(config)
    kept: Arrays | None = mine if mode is Personalisation.FEDPER else dict(personal) if personal is not None else None
    if scaffold is not None:  # nothing trained: c_i stays, c goes back as it came
        kept = dict(scaffold.c_i)
        shared, received = {**shared, **scaffold.sent}, {**received, **scaffold.sent}
    primary = before.primary
    metrics = {"num-examples": float(len(train_data)), "train-loss": before.loss, f"global-{primary}": before.value,
               "global-loss": before.loss, f"local-{primary}": before.value, "statistics-round": 1.0,
               "train-seconds": time.perf_counter() - started}
    if cluster is not None:
        metrics["cluster"] = float(cluster)
    return NodeRound(cluster, received, shared, kept, len(train_data), before.loss, metrics)


def _qat_round(
    config: TrainConfig, model: torch.nn.Module, train_data: Dataset, test_data: Dataset, start: Arrays,
    candidates: Sequence[Mapping[str, NDArray[np.generic]]], cluster: int | None, before: EvalResult, seed: int,
    started: float,
) -> NodeRound:
    """A federated QAT round (run config ``qat-rounds``): the received model fine-tuned with fake
    quantisation in the loop on this department's data (``quorumfl.training.qat``; the round's local
    epochs, batch size and learning rate, SGD with momentum 0.9), its activation observers starting
    from the federation's ranges once an earlier QAT round set them. What goes back: the trained
    weights and the ranges this department's observers saw (``qat.encode_ranges``), both averaged by
    the server as any array is, under the round's secure aggregation."""
    from quorumfl.training import qat

    if _mode(config) is not Personalisation.NONE or len(candidates) != 1 or config.dp != "none" \
            or config.compression != "none":
        raise ConfigError("a federated QAT round (qat-rounds) trains one global model (FedAvg or FedProx) without "
                          "dp or compression; the server asked for another combination")
    sent = {k: v for k, v in candidates[0].items() if k.startswith(QAT_PREFIX)}
    if not sent:
        raise ConfigError("the server asked for a QAT round but sent no activation ranges with the model")
    received_ranges = qat.decode_ranges(sent)
    features = torch.from_numpy(np.ascontiguousarray(train_data.x))
    labels = torch.from_numpy(np.ascontiguousarray(train_data.y))
    if len(features) == 0:
        raise DataError("this department has no training data for the QAT round")
    example = features[: max(2, min(len(features), config.batch_size))]
    if len(example) < 2:
        example = torch.cat([example, example])
    prepared = qat.prepare(model, example)
    if any(pair != (0.0, 0.0) for pair in received_ranges.values()):  # all zero: no QAT round has set them yet
        qat.set_activation_ranges(prepared, received_ranges, freeze=False)
    loss = qat.fine_tune(prepared, features, labels, train_data.objective, epochs=config.local_epochs,
                         batch_size=config.batch_size, learning_rate=config.learning_rate, momentum=0.9, seed=seed,
                         optimizer=config.optimizer)
    qat.load_trained(prepared, model)
    seen = qat.activation_ranges(prepared)
    if set(seen) != set(received_ranges):
        raise ConfigError("the activation ranges the server sent do not fit this model's observers; the server and "
                          "this node run different QuorumFL or torch versions")
    after = evaluate(model, test_data)
    metrics = {"num-examples": float(len(train_data)), "train-loss": loss, f"global-{before.primary}": before.value,
               "global-loss": before.loss, f"local-{after.primary}": after.value, "qat-round": 1.0,
               "train-seconds": time.perf_counter() - started}
    if cluster is not None:
        metrics["cluster"] = float(cluster)
    shared = {**model_to_arrays(model), **qat.encode_ranges(seen)}
    return NodeRound(cluster, {**start, **sent}, shared, None, len(train_data), loss, metrics)


def _global_statistics(model: torch.nn.Module, start: Arrays) -> None:
    """Give a personal model (Ditto) the federation's standardisation from the global model."""
    stats = find_statistics(model)
    for prefix, module in model.named_modules():
        if stats is not None and module is stats:
            for buffer in Standardize.STATISTICS:
                key = f"{prefix}.{buffer}" if prefix else buffer
                getattr(module, buffer).copy_(torch.from_numpy(np.array(start[key], copy=True)))


def pick_round(
    config: TrainConfig,
    candidates: Sequence[Mapping[str, NDArray[np.generic]]],
    personal: Arrays | None,
    train_data: Dataset,
) -> int:
    """IFCA's choice alone (lowest loss on the node's training data), for a round whose training
    comes in a second message (secure aggregation sums each cluster's nodes as one group)."""
    model = _build(config, train_data)
    cluster, _, _ = _pick(config, model, candidates, personal, train_data)
    return 0 if cluster is None else cluster


@dataclass(frozen=True)
class PrivacyGate:
    """The department's ledger as a DP round uses it: ``charge`` a round's mechanism (σ, q, steps) and
    get the department's ε after it, or raise past the budget; ``noise_for`` finds σ for a target ε
    (``privacy.accounting.noise_for_target``'s arguments; the ledger's keeps what it found); ``budget``:
    the department's total ε (node config ``dp-budget``), reported beside the ε spent."""

    charge: Callable[[tuple[float, float, int]], float]
    noise_for: Callable[[float, float, float, int], float] | None = None
    budget: float | None = None


def train_job(config: TrainConfig, *, seed: int) -> TrainJob:
    """The engine's job for this round. SCAFFOLD steps with plain SGD: its control-variate update
    (x − y)/(K·η) reads the average corrected gradient off the steps, which momentum would inflate."""
    scaffold = _mode(config) is Personalisation.SCAFFOLD
    if scaffold and config.optimizer != "sgd":
        raise ConfigError(f"SCAFFOLD's control variates assume plain SGD steps; the run asks for optimizer "
                          f"{config.optimizer!r}: set optimizer = \"sgd\" for a SCAFFOLD run")
    momentum = 0.0 if scaffold else 0.9
    return TrainJob(epochs=config.local_epochs, batch_size=config.batch_size, learning_rate=config.learning_rate,
                    optimizer=config.optimizer,
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
    model = _build(config, train_data)
    cluster, start, names = _pick(config, model, candidates, personal, train_data)
    arrays_to_model(model, start)
    before = evaluate(model, test_data)
    started = time.perf_counter()
    seed = config.seed + config.server_round if fresh_seed is None else fresh_seed
    job = train_job(config, seed=seed)
    scaffold = _scaffold_start(config, model, candidates, personal) if mode is Personalisation.SCAFFOLD else None
    if _statistics_round(config, model):
        return _contribute_statistics(config, model, train_data, start, names, cluster, before, personal, scaffold,
                                      started)
    if config.qat:
        return _qat_round(config, model, train_data, test_data, start, candidates, cluster, before, seed, started)
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
        if privacy.budget is not None:
            dp_metrics["dp-budget"] = privacy.budget
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
            if privacy.budget is not None:
                dp_metrics["dp-budget"] = privacy.budget
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
        f"global-{before.primary}": before.value,
        "global-loss": before.loss,
        f"local-{after.primary}": after.value,
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
        metrics[f"personal-{after.primary}"] = after.value
    if mode is Personalisation.DITTO:
        anchor = [torch.from_numpy(np.array(start[k], copy=True)) for k, _ in model.named_parameters()]
        arrays_to_model(model, dict(personal) if personal is not None else start)
        _global_statistics(model, start)
        train(model, train_data, epochs=config.local_epochs, batch_size=config.batch_size,
              learning_rate=config.learning_rate, proximal_mu=config.ditto_lambda, seed=seed + 1, anchor=anchor,
              optimizer=config.optimizer)
        kept = model_to_arrays(model)
        personal_eval = evaluate(model, test_data)
        metrics[f"personal-{personal_eval.primary}"] = personal_eval.value
    metrics["train-seconds"] = time.perf_counter() - started
    if cluster is not None:
        metrics["cluster"] = float(cluster)
    return NodeRound(cluster, received, shared, kept, result.num_examples, result.loss, metrics)


def federation_model(config: TrainConfig, candidates: Sequence[Mapping[str, NDArray[np.generic]]],
                     personal: Arrays | None, train_data: Dataset) -> torch.nn.Module:
    """The federation's model for this department (global, its cluster's, or shared + its personal layers)."""
    model = _build(config, train_data)
    arrays_to_model(model, _pick(config, model, candidates, personal, train_data)[1])
    return model


def evaluate_round(
    config: TrainConfig,
    candidates: Sequence[Mapping[str, NDArray[np.generic]]],
    personal: Arrays | None,
    train_data: Dataset,
    test_data: Dataset,
) -> NodeEvaluation:
    """The department's metrics (the task's) on its own test split with the federation's model for it
    (global, its cluster's, or shared + personal layers) and, for Ditto, with its personal model."""
    model = _build(config, test_data)
    cluster, start, _ = _pick(config, model, candidates, personal, train_data)
    arrays_to_model(model, start)
    result = evaluate(model, test_data)
    metrics = {**result.metrics, "num-examples": float(result.num_examples)}
    mode = _mode(config)
    if mode is Personalisation.FEDPER:
        metrics[f"personal-{result.primary}"] = result.value
    elif mode is Personalisation.DITTO and personal is not None:
        arrays_to_model(model, dict(personal))
        _global_statistics(model, start)
        metrics[f"personal-{result.primary}"] = evaluate(model, test_data).value
    if cluster is not None:
        metrics["cluster"] = float(cluster)
    return NodeEvaluation(cluster, metrics)
