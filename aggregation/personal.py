"""Which of a model's arrays are personal (FedPer: they never leave the node) and which are shared.

FedPer (Arivazhagan et al., 2019) keeps some layers — usually the classifier head — on each node and
federates the rest. Layers are named by prefixes of the model's array names (``"9"`` matches
``9.weight`` and ``9.bias``); ``head`` names the model's last layer. Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import ConfigError

__all__ = ["HEAD", "merge_arrays", "personal_names", "split_arrays"]

HEAD = "head"
Arrays = Mapping[str, NDArray[np.generic]]


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def personal_names(names: Sequence[str], spec: str) -> frozenset[str]:
    """The array names that ``spec`` (comma-separated layer prefixes, or ``head``) makes personal.

    ``names`` are in the model's own order (its state dict's), so ``head`` is the last layer.
    Every prefix must match at least one array and at least one array must stay shared.
    """
    prefixes = [p.strip() for p in spec.split(",") if p.strip()]
    if not prefixes:
        return frozenset()
    if not names:
        raise ConfigError("personal-layers: the model has no arrays")
    chosen: set[str] = set()
    for prefix in prefixes:
        if prefix == HEAD:
            last = _layer(names[-1])
            matched = {n for n in names if _layer(n) == last}
        else:
            matched = {n for n in names if n == prefix or n.startswith(prefix + ".")}
        if not matched:
            layers = sorted({_layer(n) for n in names}, key=[_layer(n) for n in names].index)
            raise ConfigError(
                f"personal-layers: '{prefix}' names no layer of this model; its layers are {layers} (or write 'head')"
            )
        chosen |= matched
    if chosen >= set(names):
        raise ConfigError(f"personal-layers '{spec}' makes every layer personal; nothing would be federated")
    return frozenset(chosen)


def split_arrays(
    arrays: Arrays, personal: frozenset[str]
) -> tuple[dict[str, NDArray[np.generic]], dict[str, NDArray[np.generic]]]:
    """(shared, personal) parts of a full set of arrays."""
    missing = personal - set(arrays)
    if missing:
        raise ConfigError(f"personal layer arrays {sorted(missing)} are not in the model")
    shared = {k: v for k, v in arrays.items() if k not in personal}
    mine = {k: v for k, v in arrays.items() if k in personal}
    return shared, mine


def merge_arrays(shared: Arrays, personal: Arrays) -> dict[str, NDArray[np.generic]]:
    """The full model from its shared and personal parts, which must not overlap."""
    overlap = set(shared) & set(personal)
    if overlap:
        raise ConfigError(f"arrays {sorted(overlap)} are both shared and personal")
    return {**shared, **personal}
