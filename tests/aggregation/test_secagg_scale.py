"""Masking at 1,000 departments: 10 % of them drop out at each stage and the unmasked sum is still
the numpy sum of the survivors (slow suite).

The federation is the real node and coordinator code (``NodeEpoch``/``CoordinatorEpoch``, node state
serialised between stages as a node keeps it between Flower messages) with the run config's default
threshold (0.6) and the sparse graph that 1,000 nodes get (degree 174, local threshold 88). The
stages dropped at are the ones a simulated run has (``quorumfl simulate --dropout``): key
advertisement, share exchange, masked input and unmasking. Which departments drop where is drawn by
hypothesis: any 10 % at each stage. One example takes about 90 s on two cores, so the slow suite
runs ``QUORUMFL_SCALE_EXAMPLES`` examples (default 1); the closing figures were taken with more.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quorumfl.aggregation.secagg import FixedPoint, MaskingParams, resolve_threshold
from quorumfl.aggregation.secagg.graph import sparse_parameters

from .secagg_harness import Dropouts, Federation

DEPARTMENTS = 1000
STAGES = ("advertise", "share", "mask", "unmask")
EXAMPLES = int(os.environ.get("QUORUMFL_SCALE_EXAMPLES", "1"))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(order=st.permutations(range(DEPARTMENTS)), seed=st.integers(0, 2**32 - 1))
def test_ten_percent_dropouts_at_every_stage_of_1000_departments_give_the_survivors_numpy_sum(
    order: list[int], seed: int
) -> None:
    nodes = [(2**63 + 977 * i) % 2**64 for i in range(DEPARTMENTS)]
    tenth = DEPARTMENTS // 10
    drop = Dropouts(**{stage: {nodes[i] for i in order[k * tenth:(k + 1) * tenth]} for k, stage in enumerate(STAGES)})
    params = MaskingParams(threshold=resolve_threshold(0.6, DEPARTMENTS), slots=1)
    rng = np.random.default_rng(seed)
    values = {u: rng.uniform(-3.0, 3.0, size=32) for u in nodes}

    fed = Federation.setup(nodes, params, Dropouts(advertise=drop.advertise, share=drop.share))
    assert sparse_parameters(len(fed.coordinator.members), 0.2, 0.1) is not None  # the sparse graph, not the complete one
    assert all(len(fed.coordinator.neighbours(u)) < 200 for u in fed.coordinator.members)
    (outcome,) = fed.round([fed.coordinator.ready], values, Dropouts(mask=drop.mask, unmask=drop.unmask), seed=seed)

    assert outcome.error is None and outcome.total is not None, outcome.error
    survivors = set(nodes) - drop.advertise - drop.share - drop.mask
    assert set(outcome.survivors) == survivors and len(survivors) == DEPARTMENTS - 3 * tenth
    reference = np.sum([values[u] for u in sorted(survivors)], axis=0)
    error = np.max(np.abs(outcome.total - reference))
    assert error <= FixedPoint(32, 8.0, len(fed.coordinator.members)).error_bound, error
