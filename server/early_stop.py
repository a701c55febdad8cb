"""Stopping a run when it stops improving: ``early-stop-patience`` rounds without a better figure.

The figure is the one each round records and ``runs list`` shows: the server's held-out metric, or,
where the server holds no data (tables, texts), the departments' example-weighted evaluation of the
model the round started from on their own test splits (under secure aggregation, its securely summed
value). That figure lags one round behind the model it measures, so a stop comes one round after
the last improvement is visible. ``num-rounds`` is then the most rounds a run takes. A round that
failed (no figure) neither improves nor counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EARLY_STOP", "EarlyStop", "round_figure"]

EARLY_STOP = "early-stop"  # the run-level metric recorded at the round after which the run stopped


@dataclass
class EarlyStop:
    patience: int  # 0: never stop early
    higher_is_better: bool
    best: float | None = None
    since: int = 0  # rounds with a figure since the best one

    def update(self, value: float | None) -> bool:
        """Take one round's figure; True when the run should stop after this round."""
        if self.patience <= 0 or value is None or not math.isfinite(value):
            return False
        if self.best is None or (value > self.best if self.higher_is_better else value < self.best):
            self.best, self.since = value, 0
        else:
            self.since += 1
        return self.since >= self.patience


def round_figure(metrics: Mapping[str, float], primary: str) -> float | None:
    """The round's figure: the server's held-out ``primary``, else the departments' ``federated-<primary>``."""
    for name in (primary, f"federated-{primary}"):
        value = metrics.get(name)
        if value is not None and math.isfinite(value):
            return float(value)
    return None
