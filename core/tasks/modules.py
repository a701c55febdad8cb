"""Torch building blocks of the tabular and text tasks' models.

``Standardize`` holds the federation's feature statistics as buffers (they travel and are averaged
with the model like any other array); ``needs_statistics``/``set_statistics`` are the hook a node
uses in the statistics round (see ``quorumfl.core.tasks.tabular``). ``HashedBag`` is a fastText-style
classifier: the mean of learned embeddings of hashed word and character n-grams, then a linear layer
(Joulin et al., "Bag of Tricks for Efficient Text Classification", 2017); no pretrained weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quorumfl.core.models import (
    seeded,  # plug-in tasks seed their models with it (examples/city_task)
)

__all__ = ["HashedBag", "MaskedMeanBag", "Standardize", "find_statistics", "seeded"]

MIN_VARIANCE = 1e-3  # a feature (nearly) constant across the federation is not blown up by 1/σ


class Standardize(nn.Module):
    """``(x − mean) / σ`` with the federation's mean and second moment; identity until they are set.
    Its inputs must lie in [-1, 1] (the task's reader scales them): the statistics travel through the
    round's secure sum, whose encoding is bounded.

    ``floor`` (per feature; −∞ = none) is the support a one-hot category slot needs: once the
    statistics are in, a slot whose federation-wide share of records (its mean) is below its floor
    is read as 0, i.e. pooled with the absent categories. So the vocabulary of slots the model uses
    is decided by the securely summed counts, never by one department, and a category that a
    handful of records (one department's, one citizen's) hold gets no weight of its own. The floor
    comes from the schema at build time (not a buffer that travels)."""

    STATISTICS = ("mean", "sq_mean", "ready")  # the buffers that travel with the model (``floor`` does not)
    mean: torch.Tensor
    sq_mean: torch.Tensor
    ready: torch.Tensor
    floor: torch.Tensor

    def __init__(self, features: int, floor: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("sq_mean", torch.ones(features))
        self.register_buffer("ready", torch.zeros(1))  # 1 once the statistics round has filled it
        if floor is None:
            floor = torch.full((features,), -math.inf)
        if floor.shape != (features,):
            raise ValueError(f"floor has shape {tuple(floor.shape)}, expected ({features},)")
        self.register_buffer("floor", floor.float(), persistent=False)

    def needs_statistics(self) -> bool:
        return bool(self.ready.item() < 0.5)

    @torch.no_grad()
    def set_statistics(self, x: torch.Tensor) -> None:
        """This department's mean and second moment; the round's weighted mean makes them the federation's."""
        x = x.double()
        self.mean.copy_(x.mean(dim=0).float())
        self.sq_mean.copy_((x * x).mean(dim=0).float())
        self.ready.fill_(1.0)

    def kept(self) -> torch.Tensor:
        """The features the model reads: all until the statistics are in, then those at or above their floor."""
        return (self.mean >= self.floor) | (self.ready < 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = torch.clamp(self.sq_mean - self.mean * self.mean, min=MIN_VARIANCE)
        scaled = (x - self.mean) * torch.rsqrt(variance)
        return torch.where(self.kept(), scaled, torch.zeros_like(scaled))


def find_statistics(model: nn.Module) -> Standardize | None:
    """The model's ``Standardize`` layer, if it has one."""
    return next((m for m in model.modules() if isinstance(m, Standardize)), None)


class HashedBag(nn.Module):
    """Token ids (N, L), 0 = padding → mean embedding → logits."""

    def __init__(self, buckets: int, dim: int, outputs: int) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(buckets, dim, mode="mean", padding_idx=0)
        self.classifier = nn.Linear(dim, outputs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # the (ids, offsets) form of a bag batch, which Opacus' per-example gradients of EmbeddingBag take
        present = tokens != 0
        counts = present.sum(dim=1)
        offsets = torch.cumsum(counts, dim=0) - counts
        logits: torch.Tensor = self.classifier(self.embedding(tokens[present], offsets))
        return logits

    def export_form(self) -> nn.Module:
        """The same function on the same weights in operators that ONNX and ExecuTorch export (the
        ragged ``embedding_bag`` with its data-dependent id count does not)."""
        return MaskedMeanBag(self)


class MaskedMeanBag(nn.Module):
    """``HashedBag``'s function as a masked mean of gathered embeddings: (N, L) ids → logits. An
    all-padding document gives the zero vector, as ``EmbeddingBag`` does for an empty bag."""

    def __init__(self, bag: HashedBag) -> None:
        super().__init__()
        self.embedding = bag.embedding
        self.classifier = bag.classifier

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != 0).to(self.embedding.weight.dtype).unsqueeze(-1)
        vectors = nn.functional.embedding(tokens, self.embedding.weight) * mask
        logits: torch.Tensor = self.classifier(vectors.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0))
        return logits
