"""ε of our ledger and plans against Opacus' accountant stepping through the same schedule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import PRVAccountant, RDPAccountant

from quorumfl.errors import ConfigError
from quorumfl.privacy.accounting import epsilon, noise_for_target


def _opacus_by_steps(rounds: list[tuple[float, float, int]], delta: float) -> float:
    """The reference: Opacus' accountant told about every single optimizer step, in order."""
    accountant = PRVAccountant()
    for sigma, q, steps in rounds:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    return float(accountant.get_epsilon(delta=delta, eps_error=0.01))


def test_epsilon_equals_opacus_for_the_same_schedule() -> None:
    # Three rounds of one department, then a second run with another noise level.
    schedule = [(1.1, 0.02, 50), (1.1, 0.02, 50), (1.1, 0.02, 50), (0.9, 0.05, 20)]
    ours = epsilon(schedule, 1e-5)
    assert ours == pytest.approx(_opacus_by_steps(schedule, 1e-5), rel=1e-9)
    # PRV is tighter than RDP for the same mechanism, never looser.
    rdp = RDPAccountant()
    rdp.history = [(s, q, n) for s, q, n in schedule]
    assert ours <= rdp.get_epsilon(delta=1e-5)


@settings(max_examples=6, deadline=None)
@given(st.floats(1.0, 8.0), st.sampled_from([0.01, 0.05]), st.integers(20, 400))
def test_noise_for_a_target_never_overshoots(target: float, q: float, steps: int) -> None:
    sigma = noise_for_target(target, 1e-5, q, steps)
    assert epsilon([(sigma, q, steps)], 1e-5) <= target * 1.001
    assert epsilon([(sigma * 0.9, q, steps)], 1e-5) > epsilon([(sigma, q, steps)], 1e-5)


def test_more_rounds_spend_more_and_bad_input_is_named() -> None:
    one = epsilon([(1.0, 0.02, 100)], 1e-5)
    assert epsilon([(1.0, 0.02, 100)] * 2, 1e-5) > one > 0
    assert epsilon([], 1e-5) == 0.0
    with pytest.raises(ConfigError, match="dp-delta"):
        epsilon([(1.0, 0.02, 100)], 0.0)
    with pytest.raises(ConfigError, match="σ > 0"):
        epsilon([(0.0, 0.02, 100)], 1e-5)
    with pytest.raises(ConfigError, match="dp-epsilon"):
        noise_for_target(0.0, 1e-5, 0.02, 100)
