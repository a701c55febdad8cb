"""Update monitoring and robust combination against plain numpy/scipy references, and as an attacker
would try them: a scaled-up update, a reversed one, too few nodes to judge."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import trim_mean

from quorumfl.aggregation.monitor import (
    MIN_NODES,
    SKETCH,
    ChangeSketch,
    RobustRule,
    monitor_updates,
    robust_combine,
    robust_z,
)
from quorumfl.errors import AggregationError


def _round(nodes: int = 8, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """A model and honest updates: a shared direction plus each node's own noise."""
    rng = np.random.default_rng(seed)
    reference = {"w": rng.standard_normal((20, 5)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    direction = {k: rng.standard_normal(v.shape) for k, v in reference.items()}
    updates = {n: {k: (v + 0.1 * direction[k] + 0.03 * rng.standard_normal(v.shape)).astype(np.float32)
                   for k, v in reference.items()} for n in range(nodes)}
    return reference, updates


def _mean(updates: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.mean([u[k] for u in updates.values()], axis=0).astype(np.float32) for k in next(iter(updates.values()))}


def test_robust_z_is_the_modified_z_score() -> None:
    values = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 100.0}
    median, mad = 3.0, 1.0  # |v − 3| = 2, 1, 0, 1, 97 → median 1
    z = robust_z(values)
    assert z == {k: pytest.approx(0.6745 * (v - median) / mad) for k, v in values.items()}
    assert robust_z({0: 1.0, 1: 1.0, 2: 1.0, 3: 5.0})[3] == math.inf  # all others agree exactly
    assert robust_z({0: 1.0, 1: 1.0})[0] == 0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=12), st.randoms())
def test_robust_z_ignores_order(values: list[float], random: object) -> None:
    keyed = dict(enumerate(values))
    shuffled = list(keyed.items())
    random.shuffle(shuffled)  # type: ignore[attr-defined]
    assert robust_z(dict(shuffled)) == robust_z(keyed)


def test_a_scaled_update_is_flagged_by_its_norm_and_honest_ones_are_not() -> None:
    reference, updates = _round()
    updates[3] = {k: reference[k] + 50 * (v - reference[k]) for k, v in updates[3].items()}  # ×50 its change
    aggregate = _mean(updates)
    stats = monitor_updates(reference, updates, aggregate, {n: 0.5 for n in updates})
    assert stats[3].flagged and "update norm" in stats[3].reasons[0]
    assert not any(s.flagged for n, s in stats.items() if n != 3)
    change = np.concatenate([(updates[3][k].astype(np.float64) - reference[k]).ravel() for k in sorted(reference)])
    assert stats[3].norm == pytest.approx(float(np.linalg.norm(change)), rel=1e-6)


def test_a_reversed_update_is_flagged_by_its_cosine_and_loss() -> None:
    reference, updates = _round()
    updates[5] = {k: reference[k] - (v - reference[k]) for k, v in updates[5].items()}  # same norm, opposite way
    losses = {n: 0.5 + 0.01 * n for n in updates}
    losses[5] = 2.3  # labels flipped: it fits the others' data badly
    stats = monitor_updates(reference, updates, _mean(updates), losses)
    assert stats[5].flagged and stats[5].cosine < 0
    assert any("cosine" in r for r in stats[5].reasons) and any("loss" in r for r in stats[5].reasons)
    assert [n for n, s in stats.items() if s.flagged] == [5]


def test_too_few_nodes_flag_nothing() -> None:
    reference, updates = _round(nodes=MIN_NODES - 1)
    updates[0] = {k: reference[k] + 50 * (v - reference[k]) for k, v in updates[0].items()}
    stats = monitor_updates(reference, updates, _mean(updates), {})
    assert not any(s.flagged for s in stats.values())


def test_median_and_trimmed_mean_match_numpy_and_scipy() -> None:
    reference, updates = _round(nodes=9, seed=1)
    pairs = [(u, 100.0) for u in updates.values()]
    median = robust_combine(RobustRule.MEDIAN, reference, pairs)
    trimmed = robust_combine(RobustRule.TRIMMED_MEAN, reference, pairs, fraction=0.2)
    for k in reference:
        stack = np.stack([u[k] for u in updates.values()]).astype(np.float64)
        np.testing.assert_allclose(median[k], np.median(stack, axis=0), rtol=1e-6)
        np.testing.assert_allclose(trimmed[k], trim_mean(stack, 0.2, axis=0), rtol=1e-6)
        assert median[k].dtype == reference[k].dtype


def test_norm_bound_caps_a_scaled_update_and_keeps_honest_ones() -> None:
    reference, updates = _round(nodes=6, seed=2)
    honest = robust_combine(RobustRule.NORM_BOUND, reference, [(u, 1.0) for u in updates.values()], norm_factor=2.0)
    for k in reference:  # every honest change is within 2× the median: the plain mean
        np.testing.assert_allclose(honest[k], _mean(updates)[k], rtol=1e-5, atol=1e-6)
    updates[0] = {k: reference[k] + 50 * (v - reference[k]) for k, v in updates[0].items()}
    bounded = robust_combine(RobustRule.NORM_BOUND, reference, [(u, 1.0) for u in updates.values()], norm_factor=2.0)
    changes = {n: np.concatenate([(u[k].astype(np.float64) - reference[k]).ravel() for k in sorted(reference)])
               for n, u in updates.items()}
    bound = 2.0 * np.median([np.linalg.norm(c) for c in changes.values()])
    expected = np.mean([c * min(1.0, bound / np.linalg.norm(c)) for c in changes.values()], axis=0)
    got = np.concatenate([(bounded[k].astype(np.float64) - reference[k]).ravel() for k in sorted(reference)])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    plain = np.mean(list(changes.values()), axis=0)
    assert np.linalg.norm(got) < np.linalg.norm(plain) / 3  # the ×50 update no longer drags the model


def test_krum_picks_an_honest_update_and_needs_enough_nodes() -> None:
    reference, updates = _round(nodes=7, seed=3)
    updates[0] = {k: reference[k] + 50 * (v - reference[k]) for k, v in updates[0].items()}
    chosen = robust_combine(RobustRule.KRUM, reference, [(u, 1.0) for u in updates.values()], fraction=0.2)
    assert any(all(np.array_equal(chosen[k], u[k]) for k in reference) for n, u in updates.items() if n != 0)
    with pytest.raises(AggregationError, match="Krum"):
        robust_combine(RobustRule.KRUM, reference, [(u, 1.0) for u in list(updates.values())[:4]], fraction=0.49)


def test_histogram_flags_count_nodes_two_buckets_above_the_median() -> None:
    from quorumfl.aggregation.monitor import histogram_flags
    from quorumfl.aggregation.secagg.payload import BUCKETS, LOSS_EDGES, NORM_EDGES

    edges = (NORM_EDGES, LOSS_EDGES)

    def hist(**counts: int) -> list[float]:
        out = [0.0] * BUCKETS
        for index, count in counts.items():
            out[int(index[1:])] = float(count)
        return out

    calm = hist(b6=3, b7=2)
    assert histogram_flags(calm, calm, edges=edges) == (0, [])
    count, reasons = histogram_flags(hist(b6=3, b7=2, b10=1), calm, edges=edges)
    assert count == 1 and "update norm at least" in reasons[0]
    assert histogram_flags(hist(b6=3, b7=3), calm, edges=edges)[0] == 0  # one bucket up: an honest spread
    count, reasons = histogram_flags(calm, hist(b6=4, b9=2), edges=edges)
    assert count == 2 and "train loss" in reasons[0]
    assert histogram_flags(hist(b6=2, b12=1), hist(b6=3), edges=edges)[0] == 0  # fewer than MIN_NODES


def test_a_change_sketch_matches_a_plain_numpy_countsketch_over_several_tensors_and_dtypes() -> None:
    rng = np.random.default_rng(3)
    reference = {"b.weight": rng.standard_normal((300, 40)).astype(np.float32), "a.bias": rng.standard_normal(40),
                 "c.steps": np.array([7], dtype=np.int64)}
    sketch = ChangeSketch(reference, seed=5)
    names = sorted(reference)  # the coordinates in name order, each tensor flattened
    size = sum(reference[k].size for k in names)
    assert size > SKETCH
    draws = np.random.default_rng(5)  # the documented draws: a bucket, then a sign, per coordinate
    buckets, signs = draws.integers(0, SKETCH, size), draws.choice(np.array([-1.0, 1.0]), size)
    for _ in range(3):  # the change buffer is reused from one update to the next
        update = {k: (v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in reference.items()}
        change = np.concatenate([(np.asarray(update[k], np.float64) - np.asarray(reference[k], np.float64)).ravel()
                                 for k in names])
        norm, sketched = sketch.measure(update)
        assert norm == pytest.approx(float(np.linalg.norm(change)), rel=1e-12)
        expected = np.bincount(buckets, weights=signs * change, minlength=SKETCH)
        np.testing.assert_allclose(sketched, expected, rtol=1e-12, atol=1e-12 * float(np.abs(change).sum()))


def test_a_change_sketch_refuses_an_update_it_cannot_measure() -> None:
    reference = {"w": np.zeros(SKETCH + 1, dtype=np.float32)}
    sketch = ChangeSketch(reference)
    with pytest.raises(ValueError, match="another shape"):
        sketch.measure({"w": np.zeros(SKETCH, dtype=np.float32)})
    with pytest.raises(ValueError, match="not real-valued"):
        sketch.measure({"w": np.zeros(SKETCH + 1, dtype=np.complex64)})
    with pytest.raises(KeyError):
        sketch.measure({"v": np.zeros(SKETCH + 1, dtype=np.float32)})
