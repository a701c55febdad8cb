"""Edge export takes image-task models only: a tabular or text model version is refused in one line
that says so and where the model can go instead, and nothing is published."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quorumfl.edge.manifest import Channel
from quorumfl.edge.promotion import promote_to_edge, registry_root
from quorumfl.errors import EdgeError
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository


@pytest.mark.parametrize("task", ["tabular", "text"])
def test_a_non_image_model_is_refused_before_anything_is_published(tmp_path: Path, task: str) -> None:
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=5, config={"task": task, "model": "mlp"}, strategy="fedavg", num_rounds=1)
    stored = ModelStore(tmp_path / "models").save({"w": np.zeros(3, np.float32)}, "r1")
    version = repo.add_model_version(run_id=run.id, round_number=1, parent_id=None, architecture=f"{task}:mlp:abc",
                                     path=str(stored.path), sha256=stored.sha256, size_bytes=stored.size_bytes,
                                     metrics={})
    with pytest.raises(EdgeError, match=f"'{task}' task: edge export .* takes the image task's models only"):
        promote_to_edge(repo, version.id, home=tmp_path, channel=Channel("stable"))
    assert not registry_root(tmp_path).exists()
