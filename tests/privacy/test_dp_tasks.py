"""DP-SGD on the tabular and text tasks' models: Opacus' per-example gradients equal a plain torch loop.

The text model's EmbeddingBag is where per-example gradients are easy to get wrong (Opacus takes the
(ids, offsets) form); the tabular model's Standardize layer has buffers only and must not disturb them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from opacus import GradSampleModule

from quorumfl.core.tasks.modules import HashedBag, Standardize
from quorumfl.training import dp_samplers  # noqa: F401  (what DP-SGD uses: registered on import)


def _per_example_reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One backward pass per example: the obviously-correct per-example gradients."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            grads[name].append(p.grad.detach().clone())
    return {n: torch.stack(g) for n, g in grads.items()}


@pytest.mark.parametrize("kind", ["text", "tabular"])
def test_opacus_per_example_gradients_equal_a_plain_loop(kind: str) -> None:
    torch.manual_seed(0)
    if kind == "text":
        model: torch.nn.Module = HashedBag(buckets=50, dim=6, outputs=3)
        x = torch.randint(1, 50, (8, 7))
        x[2, 4:] = 0  # padded documents of different lengths
        x[5, 1:] = 0
    else:
        stats = Standardize(5)
        stats.set_statistics(torch.rand(100, 5))
        model = torch.nn.Sequential(stats, torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
        x = torch.rand(8, 5)
    y = torch.randint(0, 3, (8,))
    reference = _per_example_reference(model, x, y)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped.zero_grad()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        torch.nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
    for name, p in model.named_parameters():
        sample = p.grad_sample  # type: ignore[attr-defined]
        np.testing.assert_allclose(sample.numpy(), reference[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_opacus_own_embedding_bag_sampler_undercounts_repeated_ids_which_is_why_ours_replaces_it() -> None:
    from opacus.grad_sample.embedding import compute_embeddingbag_gradsampler

    layer = torch.nn.EmbeddingBag(10, 2, mode="sum")
    ids, offsets = torch.tensor([3, 3, 4]), torch.tensor([0])  # one document with id 3 twice
    backprops = torch.ones(1, 2)
    theirs = compute_embeddingbag_gradsampler(layer, [ids, offsets], backprops)[layer.weight]
    ours = dp_samplers.embedding_bag_grad_sample(layer, [ids, offsets], backprops)[layer.weight]
    assert theirs[0, 3, 0] == 1.0 and ours[0, 3, 0] == 2.0 and ours[0, 4, 0] == 1.0  # d(sum)/d(row 3) is 2
