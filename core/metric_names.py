"""The objectives' primary metric names, and how a report finds a stored run's.

Apart from ``core.tasks`` (which loads numpy and the tasks' readers) so that the admin's read-only
commands, which only read stored metrics, start without them.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CLASSIFICATION_PRIMARY", "PRIMARY_METRICS", "REGRESSION_PRIMARY", "higher_is_better", "primary_among"]

CLASSIFICATION_PRIMARY = "accuracy"
REGRESSION_PRIMARY = "mae"
PRIMARY_METRICS = (REGRESSION_PRIMARY, CLASSIFICATION_PRIMARY)  # every objective's primary metric


def primary_among(names: Iterable[str]) -> str:
    """The primary metric of a run from the metric names it recorded (``mae`` if any name is or ends
    in it, else ``accuracy``): what reports show when they have only the stored metrics."""
    names = list(names)
    for primary in PRIMARY_METRICS:
        if any(n == primary or n.endswith(f"-{primary}") for n in names):
            return primary
    return CLASSIFICATION_PRIMARY


def higher_is_better(primary: str) -> bool:
    """Whether a larger value of the primary metric is the better model (accuracy), or a smaller (MAE)."""
    return primary != REGRESSION_PRIMARY
