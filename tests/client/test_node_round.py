"""A node's round for every strategy (``client.node_round``), checked against plain torch references."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from quorumfl.aggregation.personal import personal_names, split_arrays
from quorumfl.client.node_round import evaluate_round, pick_round, train_round
from quorumfl.core.data.datasets import Dataset, load_dataset
from quorumfl.core.data.planted import plant_label_permutations
from quorumfl.core.models import arrays_to_model, build_model, model_to_arrays
from quorumfl.errors import ConfigError
from quorumfl.protocol.wire import TrainConfig
from quorumfl.training.local import evaluate, train

CONFIG = TrainConfig(server_round=1, model="mlp", local_epochs=2, batch_size=32, learning_rate=0.05,
                     proximal_mu=0.0, seed=0)


@pytest.fixture(scope="module")
def planted() -> tuple[list[Dataset], list[int]]:
    torch.set_num_threads(1)
    full, _ = load_dataset("digits")
    idx = np.random.default_rng(0).permutation(len(full))
    parts = [full.subset(idx[i::4][:300]) for i in range(4)]
    datasets, membership, _ = plant_label_permutations(parts, 2, seed=1)
    return datasets, membership


def test_ifca_picks_the_lowest_loss_model_and_trains_that_one(planted: tuple[list[Dataset], list[int]]) -> None:
    datasets, membership = planted
    candidates = []
    for group in (0, 1):  # one model per planted group, trained on one of its departments
        model = build_model("mlp", datasets[0].input_shape, 10, seed=0)
        train(model, datasets[membership.index(group)], epochs=10, batch_size=32, learning_rate=0.05)
        candidates.append(model_to_arrays(model))
    for data, group in zip(datasets, membership, strict=True):
        losses = []
        for arrays in candidates:  # the reference: evaluate each candidate by hand
            model = build_model("mlp", data.input_shape, 10)
            arrays_to_model(model, arrays)
            losses.append(evaluate(model, data).loss)
        work = train_round(CONFIG, candidates, None, data, data)
        assert work.cluster == group == int(np.argmin(losses)) == pick_round(CONFIG, candidates, None, data)
        assert work.metrics["cluster"] == group
        for key, value in work.received.items():
            np.testing.assert_array_equal(value, candidates[group][key])
        # What it trained is the chosen model trained the plain way.
        reference = build_model("mlp", data.input_shape, 10)
        arrays_to_model(reference, candidates[group])
        train(reference, data, epochs=2, batch_size=32, learning_rate=0.05, seed=1)
        for key, value in model_to_arrays(reference).items():
            np.testing.assert_allclose(work.shared[key], value, rtol=0, atol=1e-6)


def test_fedper_returns_only_shared_layers_and_keeps_its_own(planted: tuple[list[Dataset], list[int]]) -> None:
    data = planted[0][0]
    config = replace(CONFIG, personalisation="fedper", personal_layers="head")
    full = model_to_arrays(build_model("mlp", data.input_shape, 10, seed=5))
    personal = personal_names(list(full), "head")
    shared, _ = split_arrays(full, personal)

    first = train_round(config, [shared], None, data, data)
    assert set(first.shared) == set(shared) and set(first.received) == set(shared)
    assert first.personal is not None and set(first.personal) == personal
    second = train_round(replace(config, server_round=2), [first.shared], first.personal, data, data)
    assert not set(second.shared) & personal
    # The node's own head carried over: round 2 starts from it, not from a fresh one.
    assert second.metrics["global-accuracy"] == pytest.approx(first.metrics["local-accuracy"])
    with pytest.raises(ConfigError, match="must stay on the node"):
        train_round(config, [full], None, data, data)


def test_ditto_trains_the_personal_model_towards_the_global_one(planted: tuple[list[Dataset], list[int]]) -> None:
    data = planted[0][0]
    global_arrays = model_to_arrays(build_model("mlp", data.input_shape, 10, seed=5))
    config = replace(CONFIG, personalisation="ditto", ditto_lambda=0.5)
    work = train_round(config, [global_arrays], None, data, data)
    assert work.personal is not None and set(work.personal) == set(global_arrays)

    # Reference: the personal model is the global one trained with λ/2·||v − w_global||² (seed + 1).
    reference = build_model("mlp", data.input_shape, 10)
    arrays_to_model(reference, global_arrays)
    anchor = [torch.from_numpy(global_arrays[k].copy()) for k, _ in reference.named_parameters()]
    train(reference, data, epochs=2, batch_size=32, learning_rate=0.05, proximal_mu=0.5, seed=2, anchor=anchor)
    for key, value in model_to_arrays(reference).items():
        np.testing.assert_allclose(work.personal[key], value, rtol=0, atol=1e-6)
    metrics = evaluate_round(config, [work.shared], work.personal, data, data).metrics
    assert {"accuracy", "personal-accuracy"} <= set(metrics)


def test_an_unknown_personalisation_is_refused(planted: tuple[list[Dataset], list[int]]) -> None:
    data = planted[0][0]
    arrays = model_to_arrays(build_model("mlp", data.input_shape, 10))
    with pytest.raises(ConfigError, match="personalisation must be one of"):
        train_round(replace(CONFIG, personalisation="fedbn"), [arrays], None, data, data)
