"""The node's half of IFCA: evaluate every cluster model on the department's own data, keep the best.

Only the chosen index leaves the node (with its update, to the chosen cluster's sum); the losses
stay local, so the server learns which cluster fits a department, not how well the others fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray
from torch import nn

from quorumfl.aggregation.clustering import choose_cluster

from .data.datasets import Dataset
from .models import arrays_to_model
from .training import evaluate

__all__ = ["pick_cluster"]


def pick_cluster(
    model: nn.Module, candidates: Sequence[Mapping[str, NDArray[np.generic]]], data: Dataset
) -> tuple[int, list[float]]:
    """Load each candidate into ``model``, evaluate on ``data``; (lowest-loss index, all losses).

    ``model`` is left holding the chosen candidate, ready to train.
    """
    losses = []
    for arrays in candidates:
        arrays_to_model(model, dict(arrays))
        losses.append(evaluate(model, data).loss)
    best = choose_cluster(losses)
    arrays_to_model(model, dict(candidates[best]))
    return best, losses
