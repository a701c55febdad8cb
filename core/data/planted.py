"""Planted groups of departments, so that cluster recovery can be measured.

Each department is put in one of G groups (balanced, shuffled by seed); group g relabels every
example y → π_g(y) with its own permutation π_g (group 0 keeps the labels). Departments of one
group then need the same model and departments of different groups need different ones — the
setting IFCA is meant to recover, and the planted group ids are the ground truth for purity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from quorumfl.core.data.datasets import Dataset
from quorumfl.core.data.store import read_partition, write_partition
from quorumfl.errors import DataError

__all__ = ["plant_label_permutations", "plant_partitions"]


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


def plant_partitions(paths: Mapping[str, Path], groups: int, *, seed: int) -> dict[str, int]:
    """Relabel partition directories on disk (train and test alike) by planted group; returns each
    department's group. Used to lay out a federation whose cluster structure is known."""
    names = sorted(paths)
    parts = [read_partition(paths[n]) for n in names]
    trains, membership, perms = plant_label_permutations([p.train for p in parts], groups, seed=seed)
    for name, part, train, group in zip(names, parts, trains, membership, strict=True):
        mapping = np.asarray(perms[group], dtype=np.int64)
        test = Dataset(part.test.name, part.test.x, mapping[part.test.y], part.test.num_classes)
        write_partition(paths[name], replace(part, train=train, test=test))
    return dict(zip(names, membership, strict=True))
