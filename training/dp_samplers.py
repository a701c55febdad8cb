"""Exact per-example gradients of ``nn.EmbeddingBag`` for Opacus (the text task's model under DP-SGD).

Opacus 1.x's own EmbeddingBag grad sampler adds each bag's gradient with ``gsm[i][ids] += g``, an
indexed assignment that keeps one addition per distinct id: an id that occurs twice in one document
(a repeated word, a shared character n-gram — common) gets half its gradient, so per-example norms
and the clipped update are wrong (``tests/privacy/test_dp_tasks.py`` shows it against a plain loop).
This sampler accumulates duplicates (``index_put_(…, accumulate=True)``) and is registered in
Opacus' place when this module is imported (``training.dp_sgd`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from opacus.grad_sample.utils import register_grad_sampler
from torch import nn

from quorumfl.errors import ConfigError

__all__ = ["embedding_bag_grad_sample"]


@register_grad_sampler(nn.EmbeddingBag)  # type: ignore[untyped-decorator]
def embedding_bag_grad_sample(
    layer: nn.EmbeddingBag, inputs: Sequence[torch.Tensor], backprops: torch.Tensor
) -> dict[torch.Tensor, torch.Tensor]:
    """Per-bag gradient of the embedding table: (bags, num_embeddings, dim)."""
    if len(inputs) < 2 or inputs[1] is None or layer.mode not in ("sum", "mean") or len(inputs) > 2:
        raise ConfigError("DP-SGD takes EmbeddingBag in the (ids, offsets) form with mode 'sum' or 'mean'")
    ids, offsets = inputs[0], inputs[1]
    bags = offsets.shape[0]
    ends = torch.cat([offsets[1:], offsets.new_tensor([ids.shape[0]])])
    counts = ends - offsets
    bag_of = torch.repeat_interleave(torch.arange(bags, device=ids.device), counts)
    contribution = backprops[bag_of]
    if layer.mode == "mean":
        contribution = contribution / counts[bag_of].clamp(min=1).unsqueeze(1).to(backprops.dtype)
    if layer.padding_idx is not None:  # the padding id gets no gradient, as in torch's own backward
        keep = ids != layer.padding_idx
        bag_of, ids, contribution = bag_of[keep], ids[keep], contribution[keep]
    grad = torch.zeros(bags, layer.num_embeddings, layer.embedding_dim, device=ids.device, dtype=backprops.dtype)
    grad.index_put_((bag_of, ids), contribution, accumulate=True)
    return {layer.weight: grad}
