"""What a node feeds the secure sum for a weighted average, and how the server reads the sum back.

Weighted FedAvg needs Σ w_i·δ_i and Σ w_i; both are summed securely as one vector
``[w, w·loss, w·value, w·eval_loss, norm histogram (BUCKETS), loss histogram (BUCKETS), w·δ_1, …, w·δ_d]``
so the server learns neither a node's update nor its example count. Each node puts a one in the
bucket of its update's L2 norm (taken before ``norm_bound`` scales the update down) and one in the
bucket of its train loss: the revealed sum is the round's two histograms, which show a node whose
update or loss stands out without saying which node it is (``aggregation.monitor.histogram_flags``).
Buckets are half-decades: norms from 10⁻⁴ to 10³, losses from 10⁻³ to 10⁴, the ends open; a
non-finite figure counts in the top bucket. A histogram entry is ``min(1, clip)`` so it stays inside
the encoding's range; each histogram must sum to the number of contributors. ``loss`` is the node's train loss; ``value`` and ``eval_loss`` are what the node
measured on its own test split with the model it received (the task's primary metric in the
objective's unit, e.g. accuracy, or MAE divided by the target's range), so the round's federated
metric is revealed only as a weighted mean, like the update. Header values are clipped to [0, clip]
(a non-finite one counts as 0). ``w = min(examples, max_weight) / max_weight`` keeps every entry
inside the clip range (w ≤ 1), which is what the fixed-point bound assumes; each δ_j is clipped to
±clip first, so an honest sum satisfies 0 < Σw ≤ n, the weighted header sums ≥ 0 and
|Σ w·δ_j| ≤ clip·Σw. ``read_payload`` refuses a
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

__all__ = ["BUCKETS", "HEADER", "LOSS_EDGES", "NORM_EDGES", "SecureMean", "bucket", "flatten", "unflatten",
           "weighted_payload", "read_payload"]

Arrays = Mapping[str, NDArray[np.generic]]
BUCKETS = 16
NORM_EDGES = 10.0 ** (np.arange(BUCKETS - 1) / 2 - 4)  # 10^-4 … 10^3: the inner edges of the norm buckets
LOSS_EDGES = 10.0 ** (np.arange(BUCKETS - 1) / 2 - 3)  # 10^-3 … 10^4
SCALARS = 4  # weight, weight · train loss, weight · evaluated value, weight · evaluated loss
HEADER = SCALARS + 2 * BUCKETS  # then the norm and the loss histograms


def bucket(value: float, edges: NDArray[np.float64]) -> int:
    """The histogram bucket of ``value`` (a non-finite value: the top bucket)."""
    if not math.isfinite(value):
        return len(edges)
    return int(np.searchsorted(edges, value, side="right"))


def _unit(clip: float | None) -> float:
    return min(1.0, clip) if clip is not None else 1.0


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


def _header_value(value: float, clip: float | None) -> float:
    if not math.isfinite(value):
        return 0.0
    return min(max(value, 0.0), clip) if clip is not None else max(value, 0.0)


def weighted_payload(update: NDArray[np.float64], *, examples: float, loss: float, max_weight: float,
                     clip: float | None = None, value: float = math.nan, eval_loss: float = math.nan,
                     norm_bound: float = 0.0) -> NDArray[np.float64]:
    """The vector a node feeds the secure sum (module docstring). ``norm_bound`` > 0: the update is
    scaled down to that L2 norm first (its histogram bucket is the norm it had)."""
    if not (examples > 0 and math.isfinite(examples)):
        raise AggregationError(f"a node's example count must be positive, got {examples}")
    if not (max_weight > 0 and math.isfinite(max_weight)):
        raise AggregationError(f"max weight must be positive, got {max_weight}")
    if not (norm_bound >= 0 and math.isfinite(norm_bound)):
        raise AggregationError(f"the update norm bound must be >= 0, got {norm_bound}")
    w = min(examples, max_weight) / max_weight
    head = np.array([w] + [w * _header_value(v, clip) for v in (loss, value, eval_loss)])
    norm = float(np.linalg.norm(update))
    if norm_bound > 0 and norm > norm_bound:
        update = update * (norm_bound / norm)
    histograms = np.zeros(2 * BUCKETS)
    histograms[bucket(norm, NORM_EDGES)] = _unit(clip)
    histograms[BUCKETS + bucket(loss, LOSS_EDGES)] = _unit(clip)
    body = update if clip is None else np.clip(update, -clip, clip)
    return np.concatenate([head, histograms, w * body])


@dataclass(frozen=True)
class SecureMean:
    """The weighted mean update, the (normalised) total weight, the weighted mean train loss, and the
    weighted means of what the nodes measured with the received model (value in the objective's unit)."""

    update: NDArray[np.float64]
    total_weight: float
    train_loss: float
    eval_value: float = math.nan
    eval_loss: float = math.nan
    norm_histogram: tuple[float, ...] = ()  # nodes per norm bucket (``NORM_EDGES``)
    loss_histogram: tuple[float, ...] = ()  # nodes per loss bucket (``LOSS_EDGES``)


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
        for index, name in ((1, "weighted loss"), (2, "weighted evaluated value"), (3, "weighted evaluated loss")):
            if not -tolerance <= float(total[index]) <= clip * weight + tolerance:
                problems.append(f"its {name} {float(total[index]):.4g} is outside [0, clip {clip:g} × total weight]")
        histograms = total[SCALARS:HEADER] / _unit(clip)
        slack = tolerance / _unit(clip)
        if np.any(histograms < -slack) or np.any(histograms > contributors + slack):
            problems.append(f"a histogram bucket is outside [0, {contributors}] nodes")
        for name, part in (("norm", histograms[:BUCKETS]), ("loss", histograms[BUCKETS:])):
            if not abs(float(part.sum()) - contributors) <= 0.5:
                problems.append(f"its {name} histogram counts {float(part.sum()):.4g} nodes, not the {contributors} "
                                "contributors")
        worst = float(np.max(np.abs(total[HEADER:]))) if total.shape[0] > HEADER else 0.0
        if weight > 0 and not worst <= clip * weight + tolerance:
            problems.append(f"an update coordinate sums to {worst:.4g}, above clip {clip:g} × total weight {weight:.4g}")
        if problems:
            raise SecureAggregationError("the revealed sum is out of range (" + "; ".join(problems) + "): a node sent a "
                                         "malformed input or share, so the model is left as it was")
    if not weight > min_weight:
        raise EmptyAggregationError(f"total weight {weight:.3g} of the secure sum is too small to divide by")
    counts = np.round(total[SCALARS:HEADER] / _unit(clip)).astype(float)
    return SecureMean(update=total[HEADER:] / weight, total_weight=weight, train_loss=float(total[1]) / weight,
                      eval_value=float(total[2]) / weight, eval_loss=float(total[3]) / weight,
                      norm_histogram=tuple(counts[:BUCKETS]), loss_histogram=tuple(counts[BUCKETS:]))
