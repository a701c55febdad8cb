"""Update monitoring and robust combination of plaintext updates (pure math, no I/O).

Monitoring: for each accepted update, the L2 norm of its change Δᵢ = xᵢ − w (w: the model the round
started from), the cosine between Δᵢ and the round's aggregate change Δ̄, and the node's train loss.
Each figure gets a robust z-score against the round's other nodes, z = 0.6745·(v − median)/MAD
(Iglewicz and Hoaglin's modified z-score). A node is flagged when a figure is out by both measures:
norm z above ``THRESHOLD`` and over ``NORM_RATIO`` × the median norm; loss z above ``THRESHOLD`` and
over ``LOSS_RATIO`` × the median loss; cosine z below −``THRESHOLD`` and under half the median
cosine. The ratios are there because departments with skewed data honestly differ by tens of
percent, which a z-score alone over a handful of nodes calls an outlier. With fewer than
``MIN_NODES`` updates nothing is flagged: a median of three says little. A node whose update is ×50 its peers', or whose labels are
flipped (its change points away from the others', its loss is higher), stands out this way; a node
that shifts its update a little, within the spread of honest nodes, does not.

Robust combination (run config ``robust-aggregation``) replaces the weighted mean:

- ``norm-bound``: each Δᵢ is scaled down to at most ``factor`` × the median ‖Δ‖ of the round, then
  the example-weighted mean is taken (a scaled-up update can then move the model no further than an
  honest one);
- ``trimmed-mean``, ``median``, ``krum``: Flower's ``aggregate_trimmed_avg``, ``aggregate_median``
  and ``aggregate_krum`` (``flwr.server.strategy.aggregate``), on updates that already passed
  ``WeightedMean``'s validation (names, shapes, finite values, weight).

Secure rounds (masking, CKKS): the server never sees one update, only the revealed sum, into which
every node adds a one in the bucket of its update norm and one in the bucket of its train loss
(``aggregation.secagg.payload``: half-decade buckets). ``histogram_flags`` reads the two histograms:
nodes two or more buckets (≥ 10×) above the median bucket are counted as standing out. The server
learns how many, and in which buckets, not which nodes.

Plaintext rounds without a robust rule never hold the round's updates: the server folds each into
the running sums as it arrives and keeps, per node, the norm of its change and a ``ChangeSketch`` of
it (a CountSketch of ``SKETCH`` values: each coordinate added, with a random sign, to a random
bucket); cosines are then taken between sketches (``monitor_measured``). A sketch preserves inner
products up to about 1/√SKETCH (1.6 %) of the norms' product; a model of at most ``SKETCH``
parameters is kept exactly. The robust rules need every update at once, so with one the server holds
the round's updates in memory (nodes × model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import AggregationError

__all__ = ["LOSS_RATIO", "MIN_NODES", "NORM_RATIO", "SKETCH", "THRESHOLD", "ChangeSketch", "RobustRule",
           "UpdateStats", "histogram_flags", "monitor_measured", "monitor_updates", "robust_combine", "robust_z"]

Arrays = Mapping[str, NDArray[np.generic]]
THRESHOLD = 3.5  # Iglewicz and Hoaglin's cut for the modified z-score
NORM_RATIO = 3.0
LOSS_RATIO = 2.0
MIN_NODES = 4
SKETCH = 4096  # values per node kept for cosines in a streamed round


class RobustRule(StrEnum):
    NONE = "none"
    NORM_BOUND = "norm-bound"
    TRIMMED_MEAN = "trimmed-mean"
    MEDIAN = "median"
    KRUM = "krum"


@dataclass(frozen=True)
class UpdateStats:
    norm: float
    cosine: float
    loss: float
    z_norm: float
    z_cosine: float
    z_loss: float
    flagged: bool
    reasons: tuple[str, ...]


def _delta(update: Arrays, reference: Arrays) -> NDArray[np.float64]:
    return np.concatenate([(np.asarray(update[k], np.float64) - np.asarray(reference[k], np.float64)).ravel()
                           for k in sorted(reference)])


def _median(values: Mapping[int, float]) -> float:
    finite = [v for v in values.values() if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def robust_z(values: Mapping[int, float]) -> dict[int, float]:
    """Modified z-scores 0.6745·(v − median)/MAD; a value equal to the median scores 0, and any other
    value scores ±inf when the MAD is 0 (all others agree exactly). NaN values score NaN."""
    finite = [v for v in values.values() if math.isfinite(v)]
    if not finite:
        return {k: math.nan for k in values}
    median = float(np.median(finite))
    mad = float(np.median([abs(v - median) for v in finite]))
    out: dict[int, float] = {}
    for key, value in values.items():
        deviation = value - median
        if not math.isfinite(value):
            out[key] = math.nan
        elif mad > 0:
            out[key] = 0.6745 * deviation / mad
        else:
            out[key] = 0.0 if deviation == 0 else math.copysign(math.inf, deviation)
    return out


def monitor_updates(reference: Arrays, updates: Mapping[int, Arrays], aggregate: Arrays,
                    losses: Mapping[int, float]) -> dict[int, UpdateStats]:
    """Norm, cosine to the aggregate's change and loss of each update, their z-scores and flags."""
    mean_change = _delta(aggregate, reference)
    mean_norm = float(np.linalg.norm(mean_change))
    norms, cosines = {}, {}
    for node, arrays in updates.items():
        change = _delta(arrays, reference)
        norm = float(np.linalg.norm(change))
        norms[node] = norm
        cosines[node] = float(change @ mean_change) / (norm * mean_norm) if norm > 0 and mean_norm > 0 else math.nan
    return _judge(norms, cosines, losses)


class ChangeSketch:
    """The norm of an update's change from ``reference`` and a CountSketch of it (module docstring);
    the same buckets and signs for every update of a round (``seed``).

    The server measures every reply of a plaintext round as it arrives, while the other nodes are
    still training on the same machines in a local federation, so ``measure`` makes one float64 pass
    per update: the reference is converted once, the change is written tensor by tensor into one
    buffer (no per-tensor temporaries, no concatenation), and the signs are folded into the bucket
    index (a coordinate goes to bucket 2b or 2b + 1; the sketch is the difference of each pair) so no
    signed copy is made. The norm is numpy's own loop (``einsum``), not BLAS: after one large
    ``np.dot`` OpenBLAS's idle threads spin for ~0.1 s of CPU each, once per reply, taken from the nodes
    that share the server's machine. On 1.1M parameters, in a fresh process: 8–9 ms, 1,300–1,700 page
    faults and 15–18 ms of CPU per update before; 3.4–3.9 ms, no page faults and ~3.6 ms of CPU after
    (measured with ``benchmarks/round_overhead.py``). One round's replies are measured in turn (the server's
    exchange loop), so the change buffer is reused; ``measure`` is not for concurrent calls on one
    instance."""

    def __init__(self, reference: Arrays, *, seed: int = 0) -> None:
        self.reference = {k: reference[k] for k in sorted(reference)}
        self._slices: dict[str, slice] = {}
        start = 0
        for name, value in self.reference.items():
            self._slices[name] = slice(start, start + int(np.size(value)))
            start += int(np.size(value))
        self._reference_flat = np.empty(start, dtype=np.float64)
        for name, value in self.reference.items():
            self._reference_flat[self._slices[name]] = np.asarray(value, np.float64).ravel()
        self._flat = self._reference_flat.copy()  # each update's change, in turn; its pages mapped now, not per update
        self._index: NDArray[np.intp] | None = None
        if start > SKETCH:
            rng = np.random.default_rng(seed)
            buckets = rng.integers(0, SKETCH, start)
            negative = rng.choice(np.array([True, False]), start)  # the draws of the signs -1.0, +1.0
            self._index = (2 * buckets + negative).astype(np.intp)  # bucket 2b: sign +1, 2b + 1: sign −1

    def measure(self, arrays: Arrays) -> tuple[float, NDArray[np.float64]]:
        """(‖x − w‖, sketch of x − w); raises KeyError or ValueError when names or shapes differ."""
        values = {}
        for name, value in self.reference.items():
            values[name] = array = np.asarray(arrays[name])
            if array.shape != np.shape(value):
                raise ValueError(f"'{name}' has another shape than the model")
            if array.dtype.kind not in "biuf":
                raise ValueError(f"'{name}' is not real-valued ({array.dtype})")
        change = self._flat if self._index is not None else np.empty_like(self._flat)  # a small model's is returned
        for name, cut in self._slices.items():
            np.subtract(values[name].reshape(-1), self._reference_flat[cut], out=change[cut])
        norm = math.sqrt(float(np.einsum("i,i->", change, change)))  # np.dot would wake BLAS threads (class doc)
        if self._index is None:
            return norm, change
        pairs = np.bincount(self._index, weights=change, minlength=2 * SKETCH)
        return norm, np.asarray(pairs[0::2] - pairs[1::2], dtype=np.float64)


def monitor_measured(measured: Mapping[int, tuple[float, NDArray[np.float64]]], mean_sketch: NDArray[np.float64],
                     losses: Mapping[int, float]) -> dict[int, UpdateStats]:
    """``monitor_updates`` from each update's (norm, sketch) and the aggregate change's sketch: the
    norms are exact, the cosines those of the sketches."""
    mean_length = float(np.linalg.norm(mean_sketch))
    norms, cosines = {}, {}
    for node, (norm, sketch) in measured.items():
        length = float(np.linalg.norm(sketch))
        norms[node] = norm
        cosines[node] = (float(sketch @ mean_sketch) / (length * mean_length)
                         if length > 0 and mean_length > 0 else math.nan)
    return _judge(norms, cosines, losses)


def _judge(norms: Mapping[int, float], cosines: Mapping[int, float],
           losses: Mapping[int, float]) -> dict[int, UpdateStats]:
    """z-scores of the figures and the flags (module docstring)."""
    loss = {node: float(losses.get(node, math.nan)) for node in norms}
    z_norm, z_cos, z_loss = robust_z(norms), robust_z(cosines), robust_z(loss)
    judged = len(norms) >= MIN_NODES
    median_norm, median_loss, median_cos = (_median(v) for v in (norms, loss, cosines))
    stats = {}
    for node in norms:
        reasons = []
        if judged and z_norm[node] > THRESHOLD and norms[node] > NORM_RATIO * median_norm:
            reasons.append(f"update norm {norms[node]:.3g}, {norms[node] / median_norm:.1f}× the median "
                           f"(z {z_norm[node]:.1f})")
        if judged and z_cos[node] < -THRESHOLD and cosines[node] < 0.5 * median_cos:
            reasons.append(f"cosine to the aggregate {cosines[node]:.2f} against a median {median_cos:.2f} "
                           f"(z {z_cos[node]:.1f})")
        if judged and z_loss[node] > THRESHOLD and loss[node] > LOSS_RATIO * median_loss:
            reasons.append(f"train loss {loss[node]:.3g}, {loss[node] / median_loss:.1f}× the median "
                           f"(z {z_loss[node]:.1f})")
        stats[node] = UpdateStats(norms[node], cosines[node], loss[node], z_norm[node], z_cos[node], z_loss[node],
                                  bool(reasons), tuple(reasons))
    return stats


def histogram_flags(norm_histogram: Sequence[float], loss_histogram: Sequence[float], *,
                    edges: tuple[Sequence[float], Sequence[float]]) -> tuple[int, list[str]]:
    """A secure round's histograms (nodes per bucket): how many nodes lie two or more buckets above the
    median bucket in norm or in loss, and why (bucket ranges from ``edges``: norm and loss edges)."""
    flagged, reasons = 0, []
    for name, histogram, bounds in (("update norm", norm_histogram, edges[0]), ("train loss", loss_histogram, edges[1])):
        counts = [int(round(c)) for c in histogram]
        total = sum(counts)
        if total < MIN_NODES:
            continue
        cumulative, median = 0, 0
        for index, count in enumerate(counts):
            cumulative += count
            if 2 * cumulative >= total:
                median = index
                break
        high = sum(counts[median + 2:])
        if high:
            floor = bounds[median + 1] if median + 1 < len(bounds) else float("inf")
            reasons.append(f"{high} node(s) with {name} at least {floor:.3g} (≥ 10× the median bucket's)")
            flagged = max(flagged, high)
    return flagged, reasons


def robust_combine(rule: RobustRule, reference: Arrays, updates: Sequence[tuple[Arrays, float]], *,
                   fraction: float = 0.2, norm_factor: float = 2.0) -> dict[str, NDArray[np.generic]]:
    """The round's model by ``rule`` from validated updates (arrays, example weight); see the module
    docstring. ``fraction``: the share trimmed at each end (trimmed mean) or assumed Byzantine (Krum)."""
    if not updates:
        raise AggregationError("no update to combine")
    names = sorted(reference)
    dtypes = {k: np.asarray(reference[k]).dtype for k in names}
    if rule is RobustRule.NORM_BOUND:
        changes = [(_delta(arrays, reference), weight) for arrays, weight in updates]
        bound = norm_factor * float(np.median([np.linalg.norm(c) for c, _ in changes]))
        total = sum(w for _, w in changes)
        mean = np.zeros_like(changes[0][0])
        for change, weight in changes:
            norm = float(np.linalg.norm(change))
            scale = min(1.0, bound / norm) if norm > 0 else 1.0
            mean += (weight / total) * scale * change
        out, start = {}, 0
        for k in names:
            base = np.asarray(reference[k], np.float64)
            out[k] = (base + mean[start:start + base.size].reshape(base.shape)).astype(dtypes[k])
            start += base.size
        return out
    from flwr.server.strategy.aggregate import (
        aggregate_krum,
        aggregate_median,
        aggregate_trimmed_avg,
    )

    results = [([np.asarray(arrays[k], np.float64) for k in names], int(max(1, round(weight)))) for arrays, weight in updates]
    if rule is RobustRule.TRIMMED_MEAN:
        combined = aggregate_trimmed_avg(results, proportiontocut=fraction)
    elif rule is RobustRule.MEDIAN:
        combined = aggregate_median(results)
    elif rule is RobustRule.KRUM:
        byzantine = int(math.floor(fraction * len(results)))
        if len(results) < 2 * byzantine + 3:
            raise AggregationError(f"Krum with {byzantine} Byzantine node(s) needs at least {2 * byzantine + 3} "
                                   f"updates, got {len(results)}")
        combined = aggregate_krum(results, num_malicious=byzantine, to_keep=0)
    else:
        raise AggregationError(f"robust rule {rule.value!r} does not combine updates")
    return {k: np.asarray(v).astype(dtypes[k]) for k, v in zip(names, combined, strict=True)}
