"""Privacy accounting: ε of a DP-SGD schedule and the noise for a target ε, by Opacus' PRV accountant.

A schedule is a list of ``(noise_multiplier, sample_rate, steps)`` entries: the same form as
``opacus.accountants.PRVAccountant.history``. Entries of several rounds and runs on the same
department's data compose into one ε (the PRV accountant composes heterogeneous entries exactly,
up to its stated ``eps_error``). Nothing here is hand-written accounting: it is Opacus' numbers.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import numpy as np
from opacus.accountants import PRVAccountant
from opacus.accountants.utils import get_noise_multiplier

from quorumfl.errors import ConfigError

__all__ = ["Entry", "epsilon", "noise_for_target", "steps_per_epoch"]

Entry = tuple[float, float, int]  # (noise multiplier σ, sample rate q, steps)
EPS_ERROR = 0.01


def _check(entries: Sequence[Entry], delta: float) -> None:
    if not 0 < delta < 1:
        raise ConfigError(f"dp-delta must be in (0, 1), got {delta}")
    for sigma, q, steps in entries:
        if not (sigma > 0 and 0 < q <= 1 and steps >= 1):
            raise ConfigError(f"a DP schedule entry needs σ > 0, 0 < q <= 1 and steps >= 1, got {(sigma, q, steps)}")


def epsilon(entries: Sequence[Entry], delta: float) -> float:
    """ε at ``delta`` of all ``entries`` composed (0 for an empty schedule)."""
    _check(entries, delta)
    if not entries:
        return 0.0
    merged: dict[tuple[float, float], int] = {}  # the same mechanism n times, then m times = n + m times
    for s, q, n in entries:
        merged[(float(s), float(q))] = merged.get((float(s), float(q)), 0) + int(n)
    accountant = PRVAccountant()
    accountant.history = [(s, q, n) for (s, q), n in merged.items()]
    with warnings.catch_warnings(), np.errstate(divide="ignore"):  # RDP's alpha range; log(1 − q) at q = 1
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta=delta, eps_error=EPS_ERROR))


@functools.lru_cache(maxsize=64)  # a binary search of PRV evaluations: seconds; the same plan recurs per round
def noise_for_target(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest σ (within Opacus' tolerance) whose schedule of ``steps`` stays within ``target_epsilon``."""
    if not target_epsilon > 0:
        raise ConfigError(f"dp-epsilon must be > 0, got {target_epsilon}")
    _check([(1.0, sample_rate, steps)], delta)
    with warnings.catch_warnings(), np.errstate(divide="ignore"):
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant="prv", epsilon_tolerance=0.01, eps_error=EPS_ERROR))


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Poisson sampling with rate q = batch / N takes 1/q steps per epoch on average (Opacus' convention)."""
    return max(1, math.ceil(num_examples / batch_size))
