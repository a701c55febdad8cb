"""Planted label-permutation groups: balanced membership, one consistent permutation per group."""

from __future__ import annotations

import numpy as np
import pytest

from quorumfl.core.data.datasets import Dataset
from quorumfl.core.data.planted import plant_label_permutations
from quorumfl.errors import DataError


def _parts(n: int) -> list[Dataset]:
    rng = np.random.default_rng(0)
    return [Dataset("toy", rng.normal(size=(30, 1, 2, 2)).astype(np.float32), rng.integers(0, 5, 30), 5)
            for _ in range(n)]


def test_groups_are_balanced_and_each_relabels_with_its_own_permutation() -> None:
    parts = _parts(7)
    planted, membership, perms = plant_label_permutations(parts, 3, seed=4)
    assert sorted(membership.count(g) for g in range(3)) == [2, 2, 3]
    assert perms[0] == list(range(5)) and len({tuple(p) for p in perms}) == 3
    for original, new, group in zip(parts, planted, membership, strict=True):
        np.testing.assert_array_equal(new.y, np.asarray(perms[group])[original.y])
        np.testing.assert_array_equal(new.x, original.x)
    again, membership_again, _ = plant_label_permutations(parts, 3, seed=4)
    assert membership_again == membership  # the seed fixes everything


def test_impossible_group_counts_are_refused() -> None:
    with pytest.raises(DataError, match="groups"):
        plant_label_permutations(_parts(2), 3, seed=0)
