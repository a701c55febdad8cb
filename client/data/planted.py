"""Planted groups of departments, so that cluster recovery can be measured.

Each department is put in one of G groups (balanced, shuffled by seed); group g relabels every
example y → π_g(y) with its own permutation π_g (group 0 keeps the labels). Departments of one
group then need the same model and departments of different groups need different ones — the
setting IFCA is meant to recover, and the planted group ids are the ground truth for purity.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from quorumfl.aggregation.errors import DataError

from .datasets import Dataset

__all__ = ["plant_label_permutations"]


def plant_label_permutations(
    parts: Sequence[Dataset], groups: int, *, seed: int
) -> tuple[list[Dataset], list[int], list[list[int]]]:
    """(relabelled datasets, group of each department, permutation of each group)."""
    if not 1 <= groups <= len(parts):
        raise DataError(f"groups must be between 1 and the {len(parts)} departments, got {groups}")
    classes = {p.num_classes for p in parts}
    if len(classes) != 1:
        raise DataError(f"departments disagree on the number of classes ({sorted(classes)})")
    num_classes = classes.pop()
    rng = np.random.default_rng(seed)
    membership = [int(g) for g in rng.permutation(np.arange(len(parts)) % groups)]
    permutations = [list(range(num_classes))]
    while len(permutations) < groups:
        candidate = [int(c) for c in rng.permutation(num_classes)]
        if candidate not in permutations:
            permutations.append(candidate)
    out = []
    for part, group in zip(parts, membership, strict=True):
        mapping = np.asarray(permutations[group], dtype=np.int64)
        out.append(Dataset(part.name, part.x, mapping[part.y], part.num_classes))
    return out, membership, permutations
