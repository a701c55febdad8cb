"""The server's FedAvgM step against a plain-Python reference of ``m ← β·m + Δ, w ← w + η·m``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.aggregation.momentum import ServerMomentum
from quorumfl.errors import AggregationError


def _reference(start: list[float], means: list[list[float]], beta: float, lr: float) -> list[list[float]]:
    """Element by element, in Python floats: the models after each round."""
    w, m, out = list(start), [0.0] * len(start), []
    for mean in means:
        for i in range(len(w)):
            m[i] = beta * m[i] + (mean[i] - w[i])
            w[i] = w[i] + lr * m[i]
        out.append(list(w))
    return out


@settings(max_examples=60, deadline=None)
@given(
    beta=st.floats(0.0, 0.99),
    lr=st.floats(0.1, 3.0),
    rounds=st.integers(1, 6),
    size=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_reference_over_rounds(beta: float, lr: float, rounds: int, size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    start = rng.normal(size=size)
    means = [rng.normal(size=size) for _ in range(rounds)]
    step = ServerMomentum(momentum=beta, learning_rate=lr, names=["w"])
    model = {"w": start.copy()}
    expected = _reference(start.tolist(), [m.tolist() for m in means], beta, lr)
    for mean, want in zip(means, expected, strict=True):
        model = step.step(model, {"w": mean})
        np.testing.assert_allclose(model["w"], want, rtol=1e-12, atol=1e-12)


def test_plain_fedavg_is_the_mean_itself() -> None:
    mean = {"w": np.arange(4, dtype=np.float32), "b": np.ones(2, dtype=np.float32)}
    out = ServerMomentum(momentum=0.0, learning_rate=1.0, names=["w", "b"]).step(
        {"w": np.zeros(4, dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}, mean)
    assert all(out[k] is mean[k] for k in mean)


def test_buffers_and_integers_take_the_mean_as_they_are() -> None:
    """A tabular model's statistics (buffers, not in ``names``) and integer arrays never enter the momentum."""
    step = ServerMomentum(momentum=0.9, learning_rate=1.0, names=["w"])
    current = {"w": np.zeros(3, np.float32), "stats.mean": np.zeros(3, np.float32), "count": np.array([0], np.int64)}
    for value in (1.0, 2.0):
        mean = {"w": np.full(3, value, np.float32), "stats.mean": np.full(3, 5.0, np.float32),
                "count": np.array([7], np.int64)}
        current = step.step(current, mean)
        np.testing.assert_array_equal(current["stats.mean"], mean["stats.mean"])
        np.testing.assert_array_equal(current["count"], [7])
        assert current["w"].dtype == np.float32
    # m1 = 1, w1 = 1; m2 = 0.9 + (2 − 1) = 1.9, w2 = 2.9
    np.testing.assert_allclose(current["w"], 2.9, rtol=1e-6)
    assert set(step.buffer) == {"w"}


def test_refuses_a_mean_that_does_not_fit_the_model() -> None:
    step = ServerMomentum(momentum=0.5, learning_rate=1.0, names=["w"])
    with pytest.raises(AggregationError, match="arrays"):
        step.step({"w": np.zeros(2)}, {"v": np.zeros(2)})
    with pytest.raises(AggregationError, match="shape"):
        step.step({"w": np.zeros(2)}, {"w": np.zeros(3)})


@pytest.mark.parametrize(("beta", "lr"), [(-0.1, 1.0), (1.0, 1.0), (0.5, 0.0), (0.5, -1.0), (float("nan"), 1.0)])
def test_refuses_settings_out_of_range(beta: float, lr: float) -> None:
    with pytest.raises(ValueError, match="server"):
        ServerMomentum(momentum=beta, learning_rate=lr, names=["w"])
