"""DP-SGD through Opacus: the plan is what Opacus' accountant records; per-example clipping bounds each step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quorumfl.core.data.datasets import Dataset
from quorumfl.core.models import build_model
from quorumfl.errors import ConfigError
from quorumfl.privacy.accounting import epsilon
from quorumfl.training.dp_sgd import plan_round, train_private
from quorumfl.training.engine import TrainJob


def _data(n: int = 300) -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset("synthetic", rng.normal(size=(n, 1, 8, 8)).astype(np.float32),
                   rng.integers(0, 10, n).astype(np.int64), 10)


def test_plan_spreads_the_target_over_the_run() -> None:
    job = TrainJob(epochs=2, batch_size=32, learning_rate=0.05)
    plan = plan_round(300, job, rounds=5, max_grad_norm=1.0, delta=1e-5, target_epsilon=3.0)
    assert plan.steps == 2 * 10 and plan.sample_rate == pytest.approx(0.1)
    # Five rounds of this plan reach the target (within Opacus' tolerance), never more.
    assert epsilon([plan.entry] * 5, 1e-5) <= 3.0 * 1.001
    assert epsilon([plan.entry] * 5, 1e-5) > 2.9
    with pytest.raises(ConfigError) as err:
        plan_round(300, job, rounds=0, max_grad_norm=0.0, delta=1e-5, target_epsilon=3.0, noise_multiplier=1.0)
    assert len(err.value.problems) == 3


def test_training_is_clipped_per_example_and_matches_the_plan() -> None:
    data = _data()
    job = TrainJob(epochs=1, batch_size=30, learning_rate=0.1, momentum=0.0)
    # A tiny clip bound: whatever the gradients, each step moves a weight by at most lr·(C·|B|/E[B] + noise).
    plan = plan_round(len(data), job, rounds=1, max_grad_norm=1e-4, delta=1e-5, noise_multiplier=0.5)
    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    result = train_private(model, data, job, plan)  # raises if Opacus recorded another schedule
    assert result.steps == plan.steps == 10
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True))
    assert 0 < moved < plan.steps * 0.1 * 1e-4 * 6  # 3× the expected batch, plus noise of 0.5·C
    # Without DP the same job moves weights far more.
    free = build_model("mlp", (1, 8, 8), 10, seed=1)
    from quorumfl.training.local import train
    train(free, data, epochs=1, batch_size=30, learning_rate=0.1, momentum=0.0)
    assert max(float((p.detach() - b).abs().max()) for p, b in zip(free.parameters(), before, strict=True)) > 100 * moved


def test_dp_refuses_engine_only_settings() -> None:
    job = TrainJob(epochs=1, batch_size=30, learning_rate=0.1, clip_norm=1.0)
    with pytest.raises(ConfigError, match="dp-clip clips each example"):  # before anything is charged
        plan_round(300, job, rounds=1, max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0)
    ok = TrainJob(epochs=1, batch_size=30, learning_rate=0.1)
    plan = plan_round(300, ok, rounds=1, max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="dp-clip clips each example"):
        train_private(build_model("mlp", (1, 8, 8), 10), _data(), job, plan)
    assert torch.isfinite(torch.tensor(plan.noise_multiplier))


def test_noise_and_sampling_are_secret_from_the_run_seed() -> None:
    # The server knows the run's seed; if it fixed the noise, the server could subtract it.
    data = _data()
    job = TrainJob(epochs=1, batch_size=30, learning_rate=0.1, seed=5)
    plan = plan_round(len(data), job, rounds=1, max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0)
    first, second = build_model("mlp", (1, 8, 8), 10, seed=1), build_model("mlp", (1, 8, 8), 10, seed=1)
    train_private(first, data, job, plan)
    train_private(second, data, job, plan)
    assert max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(first.parameters(), second.parameters(), strict=True)) > 1e-3


def test_two_gloo_workers_add_the_same_noise_as_one_process() -> None:
    from quorumfl.training.dp_ddp import train_private_ddp
    from quorumfl.training.engine import DevicePlan

    # Noise-only regime (C tiny, σ huge): each weight moves by a sum of `steps` draws of N(0, (lr·σC/B)²).
    rng = np.random.default_rng(0)
    data = Dataset("synthetic", rng.normal(size=(2000, 1, 8, 8)).astype(np.float32),
                   rng.integers(0, 10, 2000).astype(np.int64), 10)
    job = TrainJob(epochs=1, batch_size=100, learning_rate=1.0, momentum=0.0)
    plan = plan_round(len(data), job, rounds=1, max_grad_norm=1e-6, delta=1e-5, noise_multiplier=1000.0)
    expected = plan.steps ** 0.5 * 1.0 * 1000.0 * 1e-6 / 100
    for train in (lambda m: train_private(m, data, job, plan),
                  lambda m: train_private_ddp(m, data, job, plan, DevicePlan("cpu", 2, "gloo"))):
        model = build_model("mlp", (1, 8, 8), 10, seed=1)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        result = train(model)
        moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
        assert result.steps == plan.steps  # and Opacus' accountant recorded the charged entry (else it raises)
        assert float(moved.std()) == pytest.approx(expected, rel=0.05)
