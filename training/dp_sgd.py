"""DP-SGD on a department's data with Opacus: per-example clipping to C, Gaussian noise σC, Poisson batches.

``plan_round`` gives the round's mechanism as the accountant sees it, *before* training, so the
ledger can refuse it; ``train_private`` then trains with exactly that schedule and checks that
Opacus' own accountant recorded the same entry (fails closed otherwise). The noise multiplier comes
from the run's target ε over the whole planned run (rounds × local epochs), or is given directly.

FedProx/Ditto's proximal pull does not touch the data, so it is applied after each private step as
``w ← w − lr·μ·(w − w_anchor)`` and costs no privacy.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from quorumfl.core.data.datasets import Dataset
from quorumfl.errors import ConfigError, PrivacyBudgetError
from quorumfl.privacy.accounting import Entry, noise_for_target
from quorumfl.training import dp_samplers  # noqa: F401  (exact EmbeddingBag per-example gradients)
from quorumfl.training.engine import LoopResult, TrainJob

__all__ = ["DpPlan", "plan_round", "prepare_module", "private_loop", "train_private"]


@dataclass(frozen=True)
class DpPlan:
    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    steps: int  # this round's steps

    @property
    def entry(self) -> Entry:
        return (self.noise_multiplier, self.sample_rate, self.steps)


def _check_job(job: TrainJob) -> None:
    if job.clip_norm or job.warmup_steps:
        raise ConfigError("clip-norm and warmup-steps do not apply with DP (dp-clip clips each example); set them to 0")


def plan_round(num_examples: int, job: TrainJob, *, rounds: int, max_grad_norm: float, delta: float,
               target_epsilon: float = 0.0, noise_multiplier: float = 0.0,
               noise_for: Callable[[float, float, float, int], float] | None = None) -> DpPlan:
    """The round's DP-SGD schedule: Opacus' sample rate 1/⌈N/B⌉ and ⌈N/B⌉ steps per epoch. ``noise_for``
    finds σ for the target (default ``noise_for_target``; the node passes its ledger's, which keeps it)."""
    _check_job(job)
    problems = []
    if not max_grad_norm > 0:
        problems.append(f"dp-clip must be > 0, got {max_grad_norm}")
    if (target_epsilon > 0) == (noise_multiplier > 0):
        problems.append("give exactly one of dp-epsilon (a target for the run) and dp-noise-multiplier")
    if rounds < 1:
        problems.append(f"num-rounds must be >= 1, got {rounds}")
    if num_examples < 1:
        problems.append("the department has no training examples")
    if problems:
        raise ConfigError(problems)
    per_epoch = math.ceil(num_examples / job.batch_size)
    sample_rate = 1 / per_epoch
    steps = job.epochs * per_epoch
    sigma = noise_multiplier or (noise_for or noise_for_target)(target_epsilon, delta, sample_rate, rounds * steps)
    return DpPlan(sigma, max_grad_norm, sample_rate, steps)


def train_private(model: nn.Module, data: Dataset, job: TrainJob, plan: DpPlan, *,
                  anchor: list[torch.Tensor] | None = None) -> LoopResult:
    """Train ``model`` in place with DP-SGD for ``plan``; returns the loop figures (mean loss of the last epoch)."""
    fixed = prepare_module(model, job)
    result = private_loop(fixed, fixed, data, job, plan, anchor=anchor)
    if fixed is not model:
        model.load_state_dict(fixed.state_dict())
    return result


def prepare_module(model: nn.Module, job: TrainJob) -> nn.Module:
    """The model as DP-SGD can train it (``ModuleValidator.fix``), or a ConfigError naming what cannot be fixed."""
    _check_job(job)
    model.train()
    fixed: nn.Module = ModuleValidator.fix(model)
    problems = ModuleValidator.validate(fixed, strict=False)
    if problems:
        raise ConfigError(f"the model has layers DP-SGD cannot train: {problems}")
    return fixed


def private_loop(module: nn.Module, wrapped: nn.Module, data: Dataset, job: TrainJob, plan: DpPlan, *,
                 anchor: list[torch.Tensor] | None = None) -> LoopResult:
    """The DP-SGD loop on ``wrapped`` (``module`` itself, or Opacus' DPDDP around it in a DDP worker).

    Opacus gives every worker the whole data set: in DDP it samples each worker's shard with the same
    rate q, so the union is one Poisson sample, and only rank 0 adds the noise.
    """
    anchor_t = [p.detach().clone() for p in module.parameters()] if anchor is None else list(anchor)
    # Batch sampling and noise must be secret from everyone, the server included (it knows the run's
    # seed): both generators are seeded from the OS CSPRNG. Opacus' secure_mode (torchcsprng) is not
    # available for this torch; a secret 63-bit seed per round keeps the noise unpredictable.
    generator = torch.Generator().manual_seed(secrets.randbits(63))
    dataset = TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))
    loader = DataLoader(dataset, batch_size=job.batch_size, generator=generator)
    optimizer = job.make_optimizer(module.parameters())  # Opacus clips and noises any optimizer's gradients
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="prv")
        private, optimizer, loader = engine.make_private(
            module=wrapped, optimizer=optimizer, data_loader=loader, noise_multiplier=plan.noise_multiplier,
            max_grad_norm=plan.max_grad_norm, poisson_sampling=True,
            noise_generator=torch.Generator().manual_seed(secrets.randbits(63)),
        )
    objective = data.objective
    private.train()
    steps, epoch_loss = 0, math.nan
    for _ in range(job.epochs):
        total, seen = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad(set_to_none=True)
            if len(yb) == 0:  # Poisson sampling may draw an empty batch: still one (noise-only) step
                optimizer.step()
                steps += 1
                continue
            loss: Any = objective.loss(private(xb), yb, reduction="mean")  # (torch's backward() is untyped)
            with warnings.catch_warnings():  # Opacus' hooks on a first layer whose input needs no grad
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                loss.backward()
            optimizer.step()
            if job.proximal_mu > 0:
                with torch.no_grad():
                    for p, a in zip(module.parameters(), anchor_t, strict=True):
                        p.add_(p - a, alpha=-job.base_lr() * job.proximal_mu)
            total += float(loss.detach()) * len(yb)
            seen += len(yb)
            steps += 1
        epoch_loss = total / max(seen, 1)
    recorded = engine.accountant.history
    if len(recorded) != 1 or not (math.isclose(recorded[0][0], plan.noise_multiplier)
                                  and math.isclose(recorded[0][1], plan.sample_rate) and recorded[0][2] == plan.steps):
        raise PrivacyBudgetError(f"Opacus recorded {recorded}, the ledger was charged {plan.entry}; the update is "
                                 "withheld")
    return LoopResult(loss=epoch_loss, num_examples=len(data), steps=steps)
