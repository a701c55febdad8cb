"""Distributed DP under secure aggregation: each node clips its update and adds its share of the noise.

A node clips its update to L2 norm C and adds Gaussian noise of variance σ²C²/t per coordinate,
where t is the secure-aggregation threshold: any revealed sum has at least t contributions, so it
carries noise of variance at least σ²C² — the Gaussian mechanism with sensitivity C (one
department's whole update) and noise multiplier σ — while no single node's noise protects its own
update on its own; the sum is only revealed with the others' (the masking). Departments count
equally in this mode (weight 1): an example-weighted sum would shrink the noise of small departments.
The federation's ε is the PRV accountant's for (σ, q = fraction of departments per round, rounds).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import ConfigError

__all__ = ["clip_update", "noisy_share"]


def clip_update(update: NDArray[np.floating], clip: float) -> NDArray[np.float64]:
    """``update · min(1, C / ||update||₂)``."""
    if not clip > 0:
        raise ConfigError(f"dp-clip must be > 0, got {clip}")
    vector = np.asarray(update, dtype=np.float64)
    norm = float(np.linalg.norm(vector))
    return vector * min(1.0, clip / norm) if norm > 0 else vector.copy()


def noisy_share(update: NDArray[np.floating], *, clip: float, noise_multiplier: float, share: int,
                rng: np.random.Generator, constant: NDArray[np.bool_] | None = None) -> NDArray[np.float64]:
    """The clipped update plus this node's noise share N(0, σ²C²/share).

    ``constant`` marks coordinates that no training changes whatever the data (the tabular model's
    standardisation buffers outside its statistics round): they are sent as exactly 0, outside the
    clipped vector and without noise. Noise there would only move the model (a drifting σ² blows
    up the inputs); a fixed 0 carries nothing about the data, so the guarantee is unchanged.
    """
    if not noise_multiplier > 0 or share < 1:
        raise ConfigError(f"distributed DP needs σ > 0 and a noise share >= 1, got σ={noise_multiplier}, share={share}")
    vector = np.asarray(update, dtype=np.float64)
    if constant is None:
        constant = np.zeros(vector.shape, dtype=bool)
    if constant.shape != vector.shape:
        raise ConfigError(f"the constant-coordinate mask has shape {constant.shape}, the update {vector.shape}")
    free = ~constant
    out = np.zeros_like(vector)
    clipped = clip_update(vector[free], clip)
    out[free] = clipped + rng.normal(0.0, noise_multiplier * clip / np.sqrt(share), size=clipped.shape)
    return out
