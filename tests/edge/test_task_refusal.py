"""Edge export takes image-task models only: a tabular or text model version is refused in one line
that says so and where the model can go instead, and nothing is published. A model of departments'
own images calibrates on a department's partition of the run's schema, never on a built-in dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quorumfl.edge.manifest import Channel
from quorumfl.edge.promotion import calibration_for, promote_to_edge, registry_root
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


def _folder_run(tmp_path: Path) -> tuple[Repository, int, dict[str, object], Path]:
    """A run on departments' own image folders (the run config carries the schema inline) and a
    department's partition imported under that schema."""
    import json

    from quorumfl.core.data import import_partition, propose_schema
    from quorumfl.core.models import build_model, model_to_arrays
    from tests.core.city_data import write_digit_folder

    write_digit_folder(tmp_path / "sample", range(200))
    schema = propose_schema(tmp_path / "sample", "image", {})
    write_digit_folder(tmp_path / "tax-office", range(200, 400))
    import_partition(tmp_path / "tax-office", tmp_path / "part", department="tax-office", schema=schema)
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=5, config={"task": "image", "model": "mlp", "task-schema": json.dumps(schema)},
                          strategy="fedavg", num_rounds=1)
    stored = ModelStore(tmp_path / "models").save(model_to_arrays(build_model("mlp", (1, 8, 8), 10)), "r1")
    version = repo.add_model_version(run_id=run.id, round_number=1, parent_id=None, architecture="mlp:1x8x8:10",
                                     path=str(stored.path), sha256=stored.sha256, size_bytes=stored.size_bytes,
                                     metrics={})
    return repo, version.id, schema, tmp_path / "part"


def test_a_model_of_departments_own_images_calibrates_on_a_partition_of_its_schema(tmp_path: Path) -> None:
    """The server holds none of the departments' images: without a partition the export is refused
    (it must not calibrate on the built-in digits), a partition of another schema is refused naming
    the difference, and a partition of the run's schema is what QAT fine-tunes and measures on."""
    from quorumfl.core.data import import_partition, propose_schema, read_partition
    from quorumfl.errors import DataError
    from tests.core.city_data import write_digit_folder

    repo, version, schema, part = _folder_run(tmp_path)
    with pytest.raises(EdgeError, match="departments' own images .* pass --partition"):
        promote_to_edge(repo, version, home=tmp_path, channel=Channel("stable"))
    write_digit_folder(tmp_path / "other", range(60))
    other_schema = {**propose_schema(tmp_path / "other", "image", {}), "classes": [str(c) for c in range(11)]}
    (tmp_path / "other" / "10").mkdir()
    import_partition(tmp_path / "other", tmp_path / "other-part", department="other", schema=other_schema)
    with pytest.raises(DataError, match="does not fit the run's schema"):
        promote_to_edge(repo, version, home=tmp_path, channel=Channel("stable"), partition=tmp_path / "other-part")
    assert not registry_root(tmp_path).exists()

    # what QAT then runs on (the QAT and export themselves: tests/edge/test_qat.py)
    calibration = calibration_for(dict(repo.get_run(repo.get_model_version(version).run_id).config), partition=part)
    mine = read_partition(part)
    np.testing.assert_array_equal(calibration.x_train, mine.train.x)
    np.testing.assert_array_equal(calibration.y_eval, mine.test.y)
    assert "tax-office" in calibration.source
