"""SCAFFOLD through the federation loop and the real ClientApp handlers (in-process Grid), against a
plain-torch SCAFFOLD written out here: the same data, seeds and schedule, plain SGD along g − c_i + c, option II's c_i+ = c_i − c + (x − y)/(K·η), and the example-weighted means of the
models and of c + Δc_i on the server. Masked rounds must give the same within the fixed-point error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from quorumfl.core.data import prepare_partitions
from quorumfl.core.data.store import read_partition
from quorumfl.core.models import (
    CONTROL_PREFIX,
    arrays_to_model,
    build_model,
    model_to_arrays,
    split_control,
)
from quorumfl.errors import ConfigError
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RunStatus

from .test_clustered_rounds import _contexts as _kept_apart
from .test_rounds import (
    LoopbackGrid,
    _contexts,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)

RUN = {"strategy": "scaffold", "num-rounds": 2, "local-epochs": 2, "batch-size": 32, "learning-rate": 0.05,
       "seed": 3}


@pytest.fixture
def three_parts(tmp_path: Path) -> dict[str, Path]:
    """Three departments, label-skewed (Dirichlet 0.3): where SCAFFOLD's correction matters."""
    return prepare_partitions(tmp_path / "data", ["tax-office", "parks", "libraries"], seed=2, method="dirichlet",
                              alpha=0.3)


def _reference(parts: dict[str, Path], rounds: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Plain-torch SCAFFOLD (option II, full participation, server step 1) on the nodes' own data."""
    torch.set_num_threads(1)
    data = [read_partition(p).train for p in parts.values()]
    shape, classes = data[0].input_shape, data[0].num_classes
    model = build_model("mlp", shape, classes, seed=RUN["seed"])
    names = [n for n, _ in model.named_parameters()]
    x = {k: v.astype(np.float64) for k, v in model_to_arrays(model).items()}
    c = {n: np.zeros_like(x[n]) for n in x}
    c_nodes = [{n: np.zeros_like(x[n]) for n in names} for _ in data]
    lr = RUN["learning-rate"]
    for number in range(1, rounds + 1):
        trained, new_c, weights = [], [], []
        for i, part in enumerate(data):
            arrays_to_model(model, {k: v.astype(np.float32) for k, v in x.items()})
            params = dict(model.named_parameters())
            correction = {n: torch.from_numpy((c[n] - c_nodes[i][n]).astype(np.float32)) for n in names}
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD, as option II assumes
            generator = torch.Generator().manual_seed(RUN["seed"] + number)
            features, labels = torch.from_numpy(part.x), torch.from_numpy(part.y)
            steps = 0
            for _ in range(RUN["local-epochs"]):
                for batch in torch.split(torch.randperm(len(labels), generator=generator), RUN["batch-size"]):
                    optimizer.zero_grad()
                    loss = nn.functional.cross_entropy(model(features[batch]), labels[batch], reduction="sum") / len(batch)
                    loss.backward()
                    for n in names:
                        params[n].grad += correction[n]
                    optimizer.step()
                    steps += 1
            y = {k: v.astype(np.float64) for k, v in model_to_arrays(model).items()}
            c_plus = {n: c_nodes[i][n] - c[n] + (x[n] - y[n]) / (steps * lr) for n in names}
            new_c.append({n: c[n] + (c_plus[n] - c_nodes[i][n]) for n in names})
            c_nodes[i] = c_plus
            trained.append(y)
            weights.append(float(len(labels)))
        w = np.array(weights) / sum(weights)
        x = {k: sum(w[i] * trained[i][k] for i in range(len(data))) for k in x}
        c = {n: sum(w[i] * new_c[i][n] for i in range(len(data))) for n in names}
    return x, c


def _last_model(repo: object, run_id: int) -> dict[str, np.ndarray]:
    version = repo.list_model_versions(run_id=run_id)[-1]  # type: ignore[attr-defined]
    return ModelStore.load(version.path, version.sha256)


def test_scaffold_equals_a_plain_torch_scaffold(tmp_path: Path, three_parts: dict[str, Path]) -> None:
    fed, repo = _federation(tmp_path, LoopbackGrid(_contexts(three_parts)), **RUN)
    run_id = fed.run()
    assert repo.get_run(run_id).status == RunStatus.COMPLETED, repo.get_run(run_id).error

    stored = _last_model(repo, run_id)
    model, control = split_control(stored)
    x, c = _reference(three_parts, RUN["num-rounds"])
    for key in x:
        np.testing.assert_allclose(model[key], x[key], rtol=0, atol=2e-5)
        np.testing.assert_allclose(control[key], c[key], rtol=0, atol=2e-4)
    assert max(float(np.abs(v).max()) for v in control.values()) > 1e-3  # the variates moved
    assert repo.list_model_versions(run_id=run_id)[-1].architecture.endswith("|scaffold")


def test_masked_scaffold_equals_plaintext_scaffold(tmp_path: Path, three_parts: dict[str, Path]) -> None:
    # Each run's nodes keep their c_i in a state folder of the run's own (same Flower run id here).
    plain, repo = _federation(tmp_path, LoopbackGrid(_kept_apart(three_parts, tmp_path / "plain")), **RUN)
    plain_run = plain.run()
    masked, repo = _federation(tmp_path, LoopbackGrid(_kept_apart(three_parts, tmp_path / "masked")), **RUN,
                               **{"secure-aggregation": "masking", "secagg-threshold": 2})
    masked_run = masked.run()
    assert repo.get_run(masked_run).status == RunStatus.COMPLETED, repo.get_run(masked_run).error

    reference, stored = _last_model(repo, plain_run), _last_model(repo, masked_run)
    assert set(stored) == set(reference) and any(k.startswith(CONTROL_PREFIX) for k in stored)
    for key, value in stored.items():  # 2^-16 fixed point, clip 8, two rounds
        np.testing.assert_allclose(value, reference[key], rtol=0, atol=1e-3, err_msg=key)
    # ...and so the plain-torch SCAFFOLD too (the departments opted into repeatable training).
    model, control = split_control(stored)
    x, c = _reference(three_parts, RUN["num-rounds"])
    for key in x:
        np.testing.assert_allclose(model[key], x[key], rtol=0, atol=1e-4, err_msg=key)
        np.testing.assert_allclose(control[key], c[key], rtol=0, atol=1e-4, err_msg=key)


def test_scaffold_refuses_what_it_does_not_combine_with() -> None:
    with pytest.raises(ConfigError, match="scaffold with dp 'local'"):
        RunConfig.from_mapping({"strategy": "scaffold", "dp": "local", "model": "mlp-tanh"})
    with pytest.raises(ConfigError, match="scaffold with compression"):
        RunConfig.from_mapping({"strategy": "scaffold", "compression": "int8"})
