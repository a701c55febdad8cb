"""IFCA on a node: the cluster model trained on data like the node's has the lowest loss and is picked."""

from __future__ import annotations

import numpy as np
import torch

from quorumfl.client.clustering import pick_cluster
from quorumfl.client.data.datasets import load_dataset
from quorumfl.client.data.planted import plant_label_permutations
from quorumfl.client.models import build_model, model_to_arrays
from quorumfl.client.training import evaluate, train


def test_each_planted_group_picks_the_model_trained_on_its_labelling() -> None:
    torch.set_num_threads(1)
    full, _ = load_dataset("digits")
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(full))
    parts = [full.subset(idx[i::4][:300]) for i in range(4)]
    planted, membership, _ = plant_label_permutations(parts, 2, seed=1)
    candidates = []
    for group in (0, 1):  # one model per planted group, trained on one of its departments
        model = build_model("mlp", full.input_shape, 10, seed=0)
        train(model, planted[membership.index(group)], epochs=10, batch_size=32, learning_rate=0.05)
        candidates.append(model_to_arrays(model))
    for part, group in zip(planted, membership, strict=True):
        model = build_model("mlp", full.input_shape, 10, seed=3)
        chosen, losses = pick_cluster(model, candidates, part)
        assert chosen == group == int(np.argmin(losses))
        assert evaluate(model, part).loss == losses[chosen]  # the node is left holding the chosen model
