"""What the train phase of a round produced, whichever way it was aggregated (plaintext or masked)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

__all__ = ["TrainPhase"]


@dataclass
class TrainPhase:
    """New global arrays (None if the round produced none), who is in them, and per-node facts.

    ``node_metrics`` are what nodes reported in plaintext (in masked mode only their training time).
    ``error`` says why no arrays were produced when the reason is not per-node.
    """

    arrays: dict[str, NDArray[np.generic]] | None
    accepted: list[int] = field(default_factory=list)
    total_examples: float = 0.0
    train_loss: float = float("nan")
    node_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    departments: dict[int, str | None] = field(default_factory=dict)
    error: str | None = None
