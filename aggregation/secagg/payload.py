"""What a node feeds the secure sum for a weighted average, and how the server reads the sum back.

Weighted FedAvg needs Σ w_i·δ_i and Σ w_i; both are summed securely as one vector
``[w, w·loss, w·δ_1, …, w·δ_d]`` so the server learns neither a node's update nor its example
count. ``w = min(examples, max_weight) / max_weight`` keeps every entry inside the clip range
(w ≤ 1), which is what the fixed-point bound assumes; each δ_j is clipped to ±clip first, so an
honest sum satisfies 0 < Σw ≤ n, Σw·loss ≥ 0 and |Σ w·δ_j| ≤ clip·Σw. ``read_payload`` refuses a
revealed sum outside that range: one node's garbage masked vector or wrong seed share turns the
sum into noise spread over the whole modulus, which lands inside with negligible probability
over a model's many coordinates, so the model is left as it was instead of being wrecked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import AggregationError, EmptyAggregationError, SecureAggregationError

__all__ = ["SecureMean", "flatten", "unflatten", "weighted_payload", "read_payload"]

Arrays = Mapping[str, NDArray[np.generic]]
HEADER = 2  # weight, weight · train loss


def flatten(arrays: Arrays) -> NDArray[np.float64]:
    """All arrays as one float64 vector, in sorted key order (both ends agree on it)."""
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in sorted(arrays)])


def unflatten(vector: NDArray[np.float64], template: Arrays) -> dict[str, NDArray[np.generic]]:
    out: dict[str, NDArray[np.generic]] = {}
    offset = 0
    for key in sorted(template):
        ref = np.asarray(template[key])
        out[key] = vector[offset: offset + ref.size].reshape(ref.shape).astype(ref.dtype)
        offset += ref.size
    if offset != vector.shape[0]:
        raise AggregationError(f"vector of {vector.shape[0]} values does not fit the model's {offset}")
    return out


def weighted_payload(update: NDArray[np.float64], *, examples: float, loss: float, max_weight: float,
                     clip: float | None = None) -> NDArray[np.float64]:
    if not (examples > 0 and math.isfinite(examples)):
        raise AggregationError(f"a node's example count must be positive, got {examples}")
    if not (max_weight > 0 and math.isfinite(max_weight)):
        raise AggregationError(f"max weight must be positive, got {max_weight}")
    w = min(examples, max_weight) / max_weight
    head = np.array([w, w * max(loss, 0.0) if math.isfinite(loss) else 0.0])
    body = update if clip is None else np.clip(update, -clip, clip)
    return np.concatenate([head, w * body])


@dataclass(frozen=True)
class SecureMean:
    """The weighted mean update, the (normalised) total weight and the weighted mean train loss."""

    update: NDArray[np.float64]
    total_weight: float
    train_loss: float


def read_payload(total: NDArray[np.float64], *, min_weight: float, contributors: int | None = None,
                 clip: float | None = None, tolerance: float = 0.0) -> SecureMean:
    """Mean from a secure sum; ``min_weight`` guards against dividing by rounding noise. With
    ``contributors`` and ``clip`` the sum must lie in the honest range (``tolerance``: the encoding's
    error per coordinate), else ``SecureAggregationError`` says which bound it broke."""
    weight = float(total[0])
    if contributors is not None and clip is not None:
        problems = []
        if not np.all(np.isfinite(total)):
            problems.append("it has non-finite values")
        if not -tolerance <= weight <= contributors + tolerance:
            problems.append(f"its total weight {weight:.4g} is outside [0, {contributors}] ({contributors} contributors, "
                            "at most 1 each)")
        if not float(total[1]) >= -tolerance:
            problems.append(f"its weighted loss {float(total[1]):.4g} is negative")
        worst = float(np.max(np.abs(total[HEADER:]))) if total.shape[0] > HEADER else 0.0
        if weight > 0 and not worst <= clip * weight + tolerance:
            problems.append(f"an update coordinate sums to {worst:.4g}, above clip {clip:g} × total weight {weight:.4g}")
        if problems:
            raise SecureAggregationError("the revealed sum is out of range (" + "; ".join(problems) + "): a node sent a "
                                         "malformed input or share, so the model is left as it was")
    if not weight > min_weight:
        raise EmptyAggregationError(f"total weight {weight:.3g} of the secure sum is too small to divide by")
    return SecureMean(update=total[HEADER:] / weight, total_weight=weight, train_loss=float(total[1]) / weight)
