"""Partitioners that share a labelled pool out among department nodes (pure numpy, seeded).

Each returns one index array per node; together they cover the pool exactly once. IID shuffles;
Dirichlet(α) draws each class's node proportions from Dir(α) (smaller α = stronger label skew);
shards gives every node exactly ``labels_per_node`` classes.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import ConfigError

__all__ = ["Partitioner", "partition", "partition_dirichlet", "partition_iid", "partition_shards"]

Indices = NDArray[np.int64]


class Partitioner(StrEnum):
    IID = "iid"
    DIRICHLET = "dirichlet"
    SHARDS = "shards"


def _check_nodes(num_nodes: int, num_samples: int) -> None:
    if num_nodes < 1:
        raise ConfigError(f"num_nodes must be >= 1, got {num_nodes}")
    if num_samples < num_nodes:
        raise ConfigError(f"{num_samples} samples cannot be shared among {num_nodes} nodes")


def partition_iid(labels: NDArray[np.integer], num_nodes: int, *, seed: int) -> list[Indices]:
    """Shuffle and split into nearly equal parts."""
    _check_nodes(num_nodes, len(labels))
    order = np.random.default_rng(seed).permutation(len(labels)).astype(np.int64)
    return [np.sort(part) for part in np.array_split(order, num_nodes)]


def partition_dirichlet(
    labels: NDArray[np.integer], num_nodes: int, *, alpha: float, seed: int, min_size: int = 1
) -> list[Indices]:
    """Label skew: class c's samples are split by proportions drawn from Dir(alpha · 1).

    Redraws (up to 100 times, same seeded generator) until every node has ``min_size`` samples.
    """
    _check_nodes(num_nodes, len(labels))
    if not alpha > 0.0:
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    if min_size * num_nodes > len(labels):
        raise ConfigError(f"min_size {min_size} × {num_nodes} nodes exceeds {len(labels)} samples")
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    classes = np.unique(labels)
    for _attempt in range(100):
        parts: list[list[NDArray[np.int64]]] = [[] for _ in range(num_nodes)]
        for c in classes:
            idx = np.flatnonzero(labels == c).astype(np.int64)
            rng.shuffle(idx)
            props = rng.dirichlet(np.full(num_nodes, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(np.int64)
            for node, chunk in enumerate(np.split(idx, cuts)):
                parts[node].append(chunk)
        result = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(r) for r in result) >= min_size:
            return result
    raise ConfigError(
        f"could not give every one of {num_nodes} nodes {min_size} samples with alpha={alpha}; "
        "raise alpha or lower the number of nodes"
    )


def partition_shards(
    labels: NDArray[np.integer], num_nodes: int, *, labels_per_node: int, seed: int
) -> list[Indices]:
    """Every node holds exactly ``labels_per_node`` classes; each class is split evenly among
    the nodes that hold it. Needs ``num_nodes · labels_per_node >= number of classes``."""
    _check_nodes(num_nodes, len(labels))
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if not 1 <= labels_per_node <= len(classes):
        raise ConfigError(
            f"labels_per_node must be in 1..{len(classes)}, got {labels_per_node}"
        )
    if num_nodes * labels_per_node < len(classes):
        raise ConfigError(
            f"{num_nodes} nodes × {labels_per_node} labels cannot cover {len(classes)} classes; "
            "raise labels_per_node or the number of nodes"
        )
    rng = np.random.default_rng(seed)
    # Deal classes round-robin from repeated shuffles so each class is held by >= 1 node and no
    # node holds a class twice.
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    deck: list[int] = []
    for node in range(num_nodes):
        mine: list[int] = []
        while len(mine) < labels_per_node:
            if not deck:
                deck = [int(c) for c in rng.permutation(classes)]
            pick = next((c for c in deck if c not in mine), None)
            if pick is None:  # the rest of the deck is all classes this node has
                deck = [int(c) for c in rng.permutation(classes)]
                continue
            deck.remove(pick)
            mine.append(pick)
            holders[pick].append(node)
    parts: list[list[NDArray[np.int64]]] = [[] for _ in range(num_nodes)]
    for c, nodes in holders.items():
        idx = np.flatnonzero(labels == c).astype(np.int64)
        rng.shuffle(idx)
        if not nodes:  # cannot happen when num_nodes*labels_per_node >= classes (deck covers all)
            raise ConfigError(f"class {c} was dealt to no node")
        for node, chunk in zip(nodes, np.array_split(idx, len(nodes)), strict=True):
            parts[node].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]


def partition(
    labels: NDArray[np.integer],
    num_nodes: int,
    *,
    method: Partitioner | str,
    seed: int,
    alpha: float = 0.5,
    labels_per_node: int = 2,
) -> list[Indices]:
    """Dispatch on ``method`` (``iid``, ``dirichlet``, ``shards``)."""
    try:
        kind = Partitioner(method)
    except ValueError:
        raise ConfigError(
            f"partition: unknown partitioner '{method}'; choose one of {[p.value for p in Partitioner]}"
        ) from None
    if kind is Partitioner.IID:
        return partition_iid(labels, num_nodes, seed=seed)
    if kind is Partitioner.DIRICHLET:
        return partition_dirichlet(labels, num_nodes, alpha=alpha, seed=seed)
    return partition_shards(labels, num_nodes, labels_per_node=labels_per_node, seed=seed)
