"""Fixtures for the edge tests: a digits model version in a state DB, promoted once to signed
INT8 artifacts (shared by the module, since QAT and the two exports take a few seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from quorumfl.core.data.datasets import holdout_split
from quorumfl.core.models import architecture_key, build_model, model_to_arrays
from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.manifest import Channel
from quorumfl.edge.promotion import promote_to_edge
from quorumfl.edge.qat import QatSettings
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.database import connect
from quorumfl.server.state.orm import EdgeArtifact
from quorumfl.server.state.repository import Repository


def train_digits_mlp(epochs: int = 10, seed: int = 0) -> tuple[nn.Module, float]:
    """A digits MLP trained by a plain torch loop on the pool the server does not hold out."""
    pool, test = holdout_split("digits", seed=0)
    torch.manual_seed(seed)
    model = build_model("mlp", pool.input_shape, 10, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.from_numpy(pool.x), torch.from_numpy(pool.y)
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for i in range(0, len(x), 32):
            idx = order[i : i + 32]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = float((model(torch.from_numpy(test.x)).argmax(1).numpy() == test.y).mean())
    return model, acc


def store_version(repo: Repository, home: Path, model: nn.Module) -> int:
    run = repo.create_run(flower_run_id=None, config={"dataset": "digits", "seed": 0, "model": "mlp"},
                          strategy="fedavg", num_rounds=1)
    stored = ModelStore(home / "models").save(model_to_arrays(model), f"run{run.id}-round1")
    version = repo.add_model_version(run_id=run.id, round_number=1, parent_id=None,
                                     architecture=architecture_key("mlp", (1, 8, 8), 10), path=str(stored.path),
                                     sha256=stored.sha256, size_bytes=stored.size_bytes, metrics={})
    return int(version.id)


@dataclass
class Published:
    home: Path
    repo: Repository
    version_id: int
    rows: list[EdgeArtifact]

    @property
    def public_key(self) -> Path:
        return self.home / "edge" / "signing-key.pub.pem"


def publish(repo: Repository, home: Path, version_id: int, *, channel: Channel = Channel.STABLE,
            formats: tuple[ArtifactFormat, ...] = (ArtifactFormat.ONNX,)) -> list[EdgeArtifact]:
    """Promote again: a newer artifact version (ONNX only unless asked, to keep tests quick)."""
    rows, _, _ = promote_to_edge(repo, version_id, home=home, channel=channel, settings=QatSettings(epochs=1),
                                 formats=formats)
    return rows


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    home = tmp_path_factory.mktemp("edge-home")
    repo = Repository(connect(f"sqlite:///{home / 'state.db'}", migrate=True))
    model, _ = train_digits_mlp()
    version_id = store_version(repo, home, model)
    rows = publish(repo, home, version_id, formats=(ArtifactFormat.ONNX, ArtifactFormat.PTE))
    return Published(home, repo, version_id, rows)


@pytest.fixture
def digits_eval() -> tuple[np.ndarray, np.ndarray]:
    _, test = holdout_split("digits", seed=0)
    return test.x, test.y
